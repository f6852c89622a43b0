"""attention_as_custom_sdpa: a batch-of-one program's attention on ExecuTorch's fused kernel,
counts and numerics (the kernel's CPU implementation runs in torch)."""

import pytest
import torch
from graphs import count

from hfexport import get_pass

pytest.importorskip("executorch")

aten = torch.ops.aten


class Attention(torch.nn.Module):
    def __init__(self, enable_gqa: bool = True) -> None:
        super().__init__()
        self.enable_gqa = enable_gqa

    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.3, enable_gqa=self.enable_gqa
        )


@pytest.mark.parametrize("kv_heads", [2, 6])
def test_a_batch_of_one_attends_on_custom_sdpa_with_eager_results(kv_heads):
    q, k, v = torch.randn(1, 6, 5, 8), torch.randn(1, kv_heads, 9, 8), torch.randn(1, kv_heads, 9, 8)
    mask = torch.rand(1, 1, 5, 9) > 0.4
    mask[..., 0] = True
    mask[:, :, 3] = False  # a query row that sees no key: zeros, as eager SDPA gives
    queries = torch.export.Dim("queries", max=9)
    dynamic = ({2: queries}, None, None, {2: queries})
    module = Attention(enable_gqa=kv_heads != 6)
    program = torch.export.export(module, (q, k, v, mask), dynamic_shapes=dynamic)
    result = get_pass("attention_as_custom_sdpa")(program)
    assert result.counts == {"rewritten": 1, "missed": 0}
    assert count(result.program, aten.scaled_dot_product_attention.default) == 0
    assert count(result.program, torch.ops.llama.custom_sdpa.default) == 1
    got = result.program.module()(q, k, v, mask)
    torch.testing.assert_close(got, module(q, k, v, mask), atol=1e-6, rtol=0)
    assert torch.equal(got[:, :, 3], torch.zeros_like(got[:, :, 3]))
    step = (q[:, :, :1], k, v, mask[:, :, :1])  # one query, as a decode step has
    torch.testing.assert_close(result.program.module()(*step), module(*step), atol=1e-6, rtol=0)


def test_what_the_kernel_cannot_take_is_left_and_counted():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.ones(2, 1, 3, 6, dtype=torch.bool)
    program = torch.export.export(Attention(), (q, k, v, mask))
    result = get_pass("attention_as_custom_sdpa")(program)
    assert result.counts == {"rewritten": 0, "missed": 1} and not result.modified
    assert "missed: not a batch of one" in result.files["rewrites.md"]

    program = torch.export.export(Attention(), (q[:1], k[:1], v[:1], torch.zeros(1, 1, 3, 6)))
    result = get_pass("attention_as_custom_sdpa")(program)
    assert result.counts == {"rewritten": 0, "missed": 1}
    assert "missed: no boolean mask" in result.files["rewrites.md"]
    assert count(result.program, aten.scaled_dot_product_attention.default) == 1

    # MiniCPM3's MLA: values narrower than keys, which the kernel asserts against ("Key cache and
    # value cache must have same size") where the pass had rewritten it
    narrow = torch.randn(1, 2, 6, 4)
    program = torch.export.export(Attention(), (q[:1], k[:1], narrow, mask[:1]))
    result = get_pass("attention_as_custom_sdpa")(program)
    assert result.counts == {"rewritten": 0, "missed": 1}
    assert "missed: keys and values of different head sizes" in result.files["rewrites.md"]


def test_the_kernel_reads_only_the_keys_up_to_the_last_visible_one():
    """A static cache's slots past the last key any query sees are not read: what they hold (NaN
    here, an unwritten slot) cannot reach the output, and the rest is eager's."""
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    mask = torch.zeros(1, 1, 2, 16, dtype=torch.bool)
    mask[..., :5] = True
    mask[:, :, 0, 4] = False  # causal: the first query sees 4 keys, the second 5
    program = torch.export.export(Attention(), (q, k, v, mask))
    result = get_pass("attention_as_custom_sdpa")(program)
    assert result.counts == {"rewritten": 1, "missed": 0}
    unwritten_k, unwritten_v = k.clone(), v.clone()
    unwritten_k[:, :, 5:], unwritten_v[:, :, 5:] = float("nan"), float("nan")
    got = result.program.module()(q, unwritten_k, unwritten_v, mask)
    torch.testing.assert_close(got, Attention()(q, k, v, mask), atol=1e-6, rtol=0)
    assert count(result.program, aten._local_scalar_dense.default) == 1  # the extent, read from the mask
