"""zero_fully_masked_attention_rows: counts and numerics (eager semantics kept in torch)."""

import torch

from hfexport import get_pass

aten = torch.ops.aten


class Attention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def count(program, target):
    return sum(1 for n in program.graph.nodes if n.target is target)


def test_fully_masked_rows_become_zero_and_others_are_unchanged():
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :2] = False  # two padded query rows in the second sequence
    program = torch.export.export(Attention(), (q, k, v, mask))
    assert count(program, aten.where.ScalarOther) == 0
    result = get_pass("zero_fully_masked_attention_rows")(program)
    assert result.counts == {"rewritten": 1, "missed": 0}
    assert count(result.program, aten.where.ScalarOther) == 1 and count(result.program, aten.any.dim) == 1
    got = result.program.module()(q, k, v, mask)
    torch.testing.assert_close(got, Attention()(q, k, v, mask), atol=1e-6, rtol=0)
    assert torch.equal(got[1, :, :2], torch.zeros_like(got[1, :, :2]))


def test_float_masks_are_left_alone():
    q, k, v = (torch.randn(1, 2, 3, 8) for _ in range(3))
    program = torch.export.export(Attention(), (q, k, v, torch.zeros(1, 1, 3, 3)))
    result = get_pass("zero_fully_masked_attention_rows")(program)
    assert result.counts == {"rewritten": 0, "missed": 1} and not result.modified
    assert "| missed: mask is not boolean (torch.float32) |" in result.files["rewrites.md"]
    assert count(result.program, aten.where.ScalarOther) == 0
