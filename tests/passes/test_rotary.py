"""rotate_half_as_linear: transformers' rotate_half as one linear layer, with exactly its values."""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hfexport import get_pass

aten = torch.ops.aten


class Rotary(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)


def count(program, target):
    return sum(1 for n in program.graph.nodes if n.target is target)


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
