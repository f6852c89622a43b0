"""rotate_half_as_linear: transformers' rotate_half as one linear layer, with exactly its values."""

import torch
from graphs import count
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hfexport import get_pass

aten = torch.ops.aten


class Rotary(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)


def test_rotate_half_becomes_a_linear_with_the_same_values():
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    angles = torch.randn(1, 5, 16)
    inputs = (q, k, angles.cos(), angles.sin())
    seq = torch.export.Dim("seq", max=32)
    shapes = ({2: seq}, {2: seq}, {1: seq}, {1: seq})  # the decode graph's query length is dynamic
    program = torch.export.export(Rotary(), inputs, dynamic_shapes=shapes)
    assert count(program, aten.neg.default) == 2 and count(program, aten.slice.Tensor) == 4
    expected = Rotary()(*inputs)
    result = get_pass("rotate_half_as_linear")(program)
    assert result.counts == {"rewritten": 2}
    for target in (aten.neg.default, aten.slice.Tensor, aten.cat.default):
        assert count(result.program, target) == 0
    assert count(result.program, aten.linear.default) == 2
    for got, want in zip(result.program.module()(*inputs), expected, strict=True):
        assert torch.equal(got, want)
    shorter = (q[:, :, :3], k[:, :, :3], angles[:, :3].cos(), angles[:, :3].sin())
    for got, want in zip(result.program.module()(*shorter), Rotary()(*shorter), strict=True):
        assert torch.equal(got, want)


def test_a_concatenation_of_other_slices_is_left_alone():
    class NotRotateHalf(torch.nn.Module):
        def forward(self, x):
            return torch.cat((-x[..., 4:], x[..., :2]), dim=-1)  # halves that do not meet

    program = torch.export.export(NotRotateHalf(), (torch.randn(2, 8),))
    result = get_pass("rotate_half_as_linear")(program)
    assert result.counts == {"rewritten": 0} and not result.modified


class ComplexRotary(torch.nn.Module):
    """Llama 4's rotary embedding: complex frequencies from polar, a complex product, back to real."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))

    def forward(self, q, positions):
        from transformers.models.llama4.modeling_llama4 import apply_rotary_emb

        freqs = positions[..., None].float() * self.inv_freq
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs) * 1.0
        rotated, _ = apply_rotary_emb(q, q, freqs_cis)
        return rotated


def test_complex_rotary_becomes_real_arithmetic_that_onnx_runtime_and_executorch_run(tmp_path):
    # ONNX has no complex tensors ("No decompositions registered for the complex-valued input")
    # and ExecuTorch's edge dialect failed on view_as_complex: Llama 4 generated on Dynamo only
    import onnxruntime
    from executorch.exir import to_edge

    q, positions = torch.randn(2, 5, 4, 16), torch.arange(5).expand(2, 5)
    axes = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    shapes = (axes, axes)
    program = torch.export.export(ComplexRotary(), (q, positions), dynamic_shapes=shapes)
    assert count(program, aten.view_as_complex.default) == 2 and count(program, aten.polar.default) == 1
    result = get_pass("complex_as_real")(program)
    assert result.modified and result.counts == {"rewritten": 14}
    assert not any(
        isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_complex() for n in result.program.graph.nodes
    )
    longer, at = torch.randn(3, 9, 4, 16), torch.arange(9).expand(3, 9)
    torch.testing.assert_close(result.program.module()(longer, at), ComplexRotary()(longer, at))
    torch.onnx.export(result.program, (q, positions), str(tmp_path / "m.onnx"), dynamo=True)
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    names = [i.name for i in session.get_inputs()]
    (got,) = session.run(None, dict(zip(names, (longer.numpy(), at.contiguous().numpy()), strict=True)))
    torch.testing.assert_close(torch.from_numpy(got), ComplexRotary()(longer, at))
    to_edge(result.program)  # raised on view_as_complex before
