"""Cleanup passes: op counts before / after on a tiny module, numerics unchanged."""

import torch
from graphs import count

from hfexport import get_pass


class Casts(torch.nn.Module):
    def forward(self, x):
        y = x.to(torch.float32)  # no-op: x is already fp32
        z = (y * 2).to(torch.float16).to(torch.float32)  # real conversions
        unused = x + 1  # noqa: F841  dead
        return z + y


def export(module, *args):
    return torch.export.export(module, args)


def test_remove_noop_conversions_keeps_real_casts():
    x = torch.randn(3, 4)
    program = export(Casts(), x)
    before = count(program, torch.ops.aten.to.dtype)
    expected = program.module()(x)
    result = get_pass("remove_noop_conversions")(program)
    assert before == 3
    assert count(result.program, torch.ops.aten.to.dtype) == 2
    assert result.counts == {"rewritten": 1} and result.modified
    torch.testing.assert_close(result.program.module()(x), expected, atol=0, rtol=0)


def test_dead_code_elimination_removes_unused_nodes():
    x = torch.randn(3, 4)
    program = export(Casts(), x)
    assert count(program, torch.ops.aten.add.Tensor) == 2
    result = get_pass("dead_code_elimination")(program)
    assert count(result.program, torch.ops.aten.add.Tensor) == 1
    torch.testing.assert_close(result.program.module()(x), Casts()(x))


def test_remove_tensor_metadata_asserts():
    x = torch.randn(3, 4)
    program = export(Casts(), x)
    before = count(program, torch.ops.aten._assert_tensor_metadata.default)
    assert before > 0
    result = get_pass("remove_tensor_metadata_asserts")(program)
    assert count(result.program, torch.ops.aten._assert_tensor_metadata.default) == 0
    assert result.counts["rewritten"] == before
    torch.testing.assert_close(result.program.module()(x), Casts()(x))


def test_remove_runtime_asserts_drops_shape_checks():
    class Narrow(torch.nn.Module):
        def forward(self, x, n):
            return x[: n.item()]

    x, n = torch.randn(8, 2), torch.tensor(3)
    program = torch.export.export(Narrow(), (x, n))
    asserts = torch.ops.aten._assert_scalar.default
    before = count(program, asserts) + count(program, torch.ops.aten.sym_constrain_range_for_size.default)
    assert before > 0
    result = get_pass("remove_runtime_asserts")(program)
    assert count(result.program, asserts) == 0
    assert result.counts["rewritten"] >= 1
    torch.testing.assert_close(result.program.module()(x, n), x[:3])


class AttentionOutput(torch.nn.Module):
    """Attention outputs flattened back to hidden size: made contiguous first (CLIP) or reshaped
    straight from the transpose (T5). Whether either copies depends on SDPA's output layout."""

    def forward(self, x):
        attention = torch.nn.functional.scaled_dot_product_attention(x, x, x)
        clip = attention.transpose(1, 2).contiguous().reshape(x.shape[0], x.shape[2], -1)
        t5 = attention.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)
        return clip, t5


def test_explicit_contiguous_copies_keeps_the_copies_through_a_retrace():
    x = torch.randn(2, 4, 5, 8)
    program = export(AttentionOutput(), x)
    expected = program.module()(x)
    result = get_pass("explicit_contiguous_copies")(program)
    assert result.counts == {"rewritten": 2}
    assert count(result.program, torch.ops.aten.contiguous.default) == 0
    clones = [n for n in result.program.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(clones) == 2 and all(c.kwargs == {"memory_format": torch.contiguous_format} for c in clones)
    # a retrace keeps explicit copies whatever layout SDPA gives (it could drop a contiguous or
    # record a view); end to end: LLaVA's CLIP tower on ExecuTorch, T5's encoder on ONNX
    retraced = result.program.run_decompositions()
    assert count(retraced, torch.ops.aten.clone.default) >= 2
    for got, want in zip(retraced.module()(x), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


class Squeezes(torch.nn.Module):
    def forward(self, x):
        return x.squeeze(2) + x.squeeze(1).unsqueeze(1)  # axis 2 is not 1: a no-op; axis 1 is


def test_remove_noop_squeezes_keeps_real_ones_and_runs_on_onnx_runtime(tmp_path):
    # a squeeze of an axis that is not 1 is torch's no-op and ONNX's error (Parakeet's .squeeze(2)
    # of its decoder token axis: "Dimension of input 2 must be 1 instead of 4" in ONNX Runtime)
    import onnxruntime

    x = torch.randn(2, 1, 4, 3)
    dims = {0: torch.export.Dim.AUTO, 2: torch.export.Dim.AUTO}
    program = torch.export.export(Squeezes(), (x,), dynamic_shapes=(dims,))
    assert count(program, torch.ops.aten.squeeze.dim) == 2
    result = get_pass("remove_noop_squeezes")(program)
    assert count(result.program, torch.ops.aten.squeeze.dim) == 1
    assert result.counts == {"rewritten": 1}
    other = torch.randn(3, 1, 5, 3)
    torch.testing.assert_close(result.program.module()(other), Squeezes()(other), atol=0, rtol=0)
    torch.onnx.export(result.program, (x,), str(tmp_path / "m.onnx"), dynamo=True)
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    (got,) = session.run(None, {session.get_inputs()[0].name: other.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), Squeezes()(other))
