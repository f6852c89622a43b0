"""Attention passes: zero_fully_masked_attention_rows, grouped_query_attention and
attention_as_matmuls, counts and numerics (eager semantics kept in torch)."""

import pytest
import torch
from graphs import count

from hfexport import get_pass

aten = torch.ops.aten


class Attention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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


def repeat_kv(x, groups):
    """transformers' repeat_kv: each KV head expanded to the query heads that share it."""
    batch, heads, length, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


class GroupedAttention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        groups = q.shape[1] // k.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.3
        )


class NativeGroupedAttention(torch.nn.Module):
    """SDPA's own grouped-query attention, as hfexport captures transformers' (its
    ``sdpa_grouped_query_attention`` patch)."""

    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)


@pytest.mark.parametrize("module", [GroupedAttention, NativeGroupedAttention])
@pytest.mark.parametrize(
    ("mask_shape", "dtype"), [((2, 1, 5, 9), torch.bool), ((2, 1, 1, 9), torch.bool), ((1, 1, 5, 9), torch.float32)]
)
def test_grouped_query_attention_attends_over_each_kv_head_once(mask_shape, dtype, module):
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    mask = torch.rand(mask_shape) > 0.3 if dtype == torch.bool else torch.randn(mask_shape)
    if dtype == torch.bool:
        mask[..., 0] = True  # every row sees a key
    batch = torch.export.Dim("batch", min=1, max=8)
    queries = torch.export.Dim("queries", max=9)
    mask_axes = {**({0: batch} if mask_shape[0] > 1 else {}), **({2: queries} if mask_shape[2] > 1 else {})}
    dynamic = ({0: batch, 2: queries}, {0: batch}, {0: batch}, mask_axes or None)
    program = torch.export.export(module(), (q, k, v, mask), dynamic_shapes=dynamic)
    assert count(program, aten.expand.default) == (2 if module is GroupedAttention else 0)
    result = get_pass("grouped_query_attention")(program)
    assert result.counts == {"rewritten": 1, "missed": 0}
    sdpa = next(n for n in result.program.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert [tuple(a.meta["val"].shape[1:]) for a in sdpa.args[1:3]] == [(2, 9, 8), (2, 9, 8)]  # the KV heads
    assert not sdpa.kwargs.get("enable_gqa")
    result.program.graph_module.graph.eliminate_dead_code()
    assert count(result.program, aten.expand.default) == 1  # the mask rows, repeated per group
    for batch_size, query_len in [(2, 5), (3, 2)]:  # the sample's shape, another batch and length
        q = torch.randn(batch_size, 6, query_len, 8)
        k, v = torch.randn(batch_size, 2, 9, 8), torch.randn(batch_size, 2, 9, 8)
        m = mask[:1].repeat(batch_size, 1, 1, 1) if mask_shape[0] > 1 else mask
        m = m[:, :, :query_len] if mask_shape[2] > 1 else m
        torch.testing.assert_close(
            result.program.module()(q, k, v, m), GroupedAttention()(q, k, v, m), atol=1e-6, rtol=1e-5
        )


def test_grouped_query_attention_leaves_causal_attention_alone():
    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)

    program = torch.export.export(Causal(), (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)))
    result = get_pass("grouped_query_attention")(program)
    assert result.counts == {"rewritten": 0, "missed": 1} and not result.modified
    assert "causal or dropout SDPA" in result.files["rewrites.md"]


def test_grouped_query_attention_repeats_a_shared_mask_once_for_all_layers():
    class TwoLayers(torch.nn.Module):
        def forward(self, q, k, v, mask):
            first = GroupedAttention()(q, k, v, mask)
            return GroupedAttention()(first, k * 2, v, mask)

    q, k, v = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    mask = torch.rand(1, 1, 5, 9) > 0.3
    mask[..., 0] = True
    program = torch.export.export(TwoLayers(), (q, k, v, mask))
    result = get_pass("grouped_query_attention")(program)
    assert result.counts == {"rewritten": 2, "missed": 0}
    result.program.graph_module.graph.eliminate_dead_code()
    assert count(result.program, aten.expand.default) == 1  # the mask's rows, once
    torch.testing.assert_close(result.program.module()(q, k, v, mask), TwoLayers()(q, k, v, mask), atol=1e-6, rtol=1e-5)


class TwoAttentions(torch.nn.Module):
    """Two layers attending with one mask (as every decoder layer does)."""

    def forward(self, q, k, v, mask):
        first = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return torch.nn.functional.scaled_dot_product_attention(first, k, v, attn_mask=mask, scale=0.2)


@pytest.mark.parametrize("masked", [True, False])
def test_attention_as_matmuls_converts_the_mask_once_and_keeps_eager_semantics(masked):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(2)
    mask[1, :, :2] = False  # two fully masked query rows (a left-padded sequence)
    mask = mask if masked else None
    program = torch.export.export(TwoAttentions(), (q, k, v, mask))
    result = get_pass("attention_as_matmuls")(program)
    assert result.counts == {"rewritten": 2}
    assert count(result.program, aten.scaled_dot_product_attention.default) == 0
    assert count(result.program, aten.where.Scalar) == (1 if masked else 0)  # once for both layers
    assert count(result.program, aten.any.dim) == (1 if masked else 0)
    got, expected = result.program.module()(q, k, v, mask), TwoAttentions()(q, k, v, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if masked:  # eager's zeros for rows that see no key, not NaN nor an average
        assert torch.equal(got[1, :, :2], torch.zeros_like(got[1, :, :2]))


def test_attention_as_matmuls_leaves_float_masks_and_causal_attention_alone():
    class Causal(torch.nn.Module):
        def forward(self, q, k, v, mask):
            causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return causal + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q = torch.randn(1, 2, 3, 8)
    program = torch.export.export(Causal(), (q, q, q, torch.zeros(1, 1, 3, 3)))
    result = get_pass("attention_as_matmuls")(program)
    assert result.counts == {"rewritten": 0} and not result.modified
