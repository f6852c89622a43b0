"""Capture patches: workarounds for upstream bugs that must act before ``torch.export`` runs,
registered in :mod:`hfexport.pipeline.patches` (scope ``"capture"``) and applied only around it."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from hfexport.pipeline.patches import register_patch


@register_patch(
    "torch.nn.functional:scaled_dot_product_attention",
    name="sdpa_math_backend_on_cpu",
    reason=(
        "CPU SDPA's fused kernels check the mask shape with Eq(batch, 1), which fails the trace "
        "with GuardOnDataDependentSymNode when the batch axis is data-dependent (vision towers "
        "that select patches with a boolean mask); the math backend has no such check. Only "
        "for data-dependent sizes: the math backend's fake run costs (SmolLM2-135M's decode "
        "capture 7.9 s without it against 9.2 s)"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/180202",
)
def _sdpa_math_backend_on_cpu(original: Callable) -> Callable:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.nn.attention import SDPBackend, sdpa_kernel

    @functools.wraps(original)
    def scaled_dot_product_attention(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensors = [t for t in (query, *args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if query.device.type != "cpu" or not any(free_unbacked_symbols(t.shape) for t in tensors):
            return original(query, *args, **kwargs)
        with sdpa_kernel(SDPBackend.MATH):
            return original(query, *args, **kwargs)

    return scaled_dot_product_attention


def segment_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, length]`` boolean mask letting position ``i`` attend to ``j`` only when both
    lie in the same segment of the packed sequence ``cu_seqlens`` (``[0, end_0, end_1, …]``)."""
    positions = torch.arange(length, device=cu_seqlens.device)
    segment = (positions[:, None] >= cu_seqlens[None, 1:]).sum(-1)
    return segment[:, None] == segment[None, :]


@register_patch(
    "transformers.integrations.sdpa_attention:use_gqa_in_sdpa",
    name="sdpa_grouped_query_attention",
    reason=(
        "with an attention mask, transformers expands each key/value head to the query heads that share "
        "it (repeat_kv: an expand and a reshape per layer) instead of passing SDPA enable_gqa, which GPU "
        "kernels take only without a mask. Traced with a symbolic batch those views cost: SmolLM2-135M's "
        "ONNX decode capture took 7.0 s, 5.3 s with enable_gqa. The captured SDPA computes the same "
        "attention; the grouped_query_attention pass then attends per key/value head, as it does over "
        "repeat_kv"
    ),
    upstream="https://github.com/huggingface/transformers/pull/39412",
)
def _sdpa_grouped_query_attention(original: Callable) -> Callable:
    @functools.wraps(original)
    def use_gqa_in_sdpa(*args: Any, **kwargs: Any) -> bool:
        return True

    return use_gqa_in_sdpa


@register_patch(
    "transformers.models.qwen2_vl.modeling_qwen2_vl:VisionAttention.forward",
    name="qwen2_vl_vision_attention_as_one_masked_sdpa",
    reason=(
        "the vision tower attends within each image by splitting the packed patches with "
        "cu_seqlens.tolist() and running one attention per image; the split sizes are data-dependent "
        "and the trace fails (GuardOnDataDependentSymNode). One SDPA over all patches with a "
        "block-diagonal mask built from cu_seqlens computes the same attention"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/158786",
)
def _qwen2_vl_vision_attention(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        length = hidden_states.shape[0]
        # [length, 3 * dim] -> three [length, heads, head_dim]
        query, key, value = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).unbind(1)
        cos, sin = position_embeddings
        query, key = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision(query, key, cos, sin)
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        mask = segment_mask(cu_seqlens, length)[None, None]
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scaling)
        return self.proj(output[0].transpose(0, 1).reshape(length, -1))

    return forward


@register_patch(
    "transformers.masking_utils:_vmap_expansion_sdpa",
    name="mask_functions_by_broadcasting",
    reason=(
        "an attention mask made from a custom mask function (Gemma 3's bidirectional image tokens, "
        "token_type_ids indexed per query and key) is built with torch.vmap, which torch.export records "
        "as a flat_apply higher-order op that a .pt2 cannot save (SerializeError: Failed serializing node "
        "flat_apply). transformers' index-based mask functions take broadcast indices as well, which is "
        "how it builds every other mask: the same mask, from ordinary tensor ops"
    ),
    upstream="https://github.com/pytorch/pytorch/pull/181263",  # vmap in export graphs not serialised (related)
)
def _mask_functions_by_broadcasting(original: Callable) -> Callable:
    @functools.wraps(original)
    def expansion(mask_function: Callable) -> Callable:
        def broadcast(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
            mask = mask_function(
                batch[:, None, None, None],
                head[None, :, None, None],
                query[None, None, :, None],
                key[None, None, None, :],
            )
            # sizes, not len(): len() of a symbolic size is a Python int, which fixes the axis
            return mask.expand(batch.shape[0], head.shape[0], query.shape[0], key.shape[0])

        return broadcast

    return expansion


@register_patch(
    "transformers.masking_utils:TransformGetItemToIndex",
    name="mask_functions_index_as_tensor_ops",
    reason=(
        "the other half of mask_functions_by_broadcasting: around the vmap'd mask function, transformers "
        "turns tensor indexing into an autograd function, which torch.export also records as an unsavable "
        "flat_apply; with broadcast indices ordinary indexing is what the mask function needs"
    ),
    upstream="https://github.com/pytorch/pytorch/pull/181263",  # vmap in export graphs not serialised (related)
)
def _mask_functions_index_as_tensor_ops(original: Callable) -> Callable:
    return contextlib.nullcontext


@register_patch(
    "transformers.models.*mamba.modeling_*mamba:mamba_selective_scan",
    name="selective_scan_as_scan_op",
    reason=(
        "Mamba's selective scan without its CUDA kernels is a Python loop over the sequence, so "
        "torch.export unrolls it and fixes the sequence axis to the sample's length (a program that "
        "takes only 8 tokens). The same recurrence as torch's scan higher-order op traces once for any "
        "length, and ONNX (a Scan node) and ExecuTorch (a loop of jumps) both lower it"
    ),
    # transformers keeps the sequential loop under export: "There is no onnx translation for this op"
    # (its associative_scan branch, skipped when exporting)
    upstream="https://github.com/huggingface/transformers/blob/main/src/transformers/models/mamba/modeling_mamba.py",
)
def _selective_scan_as_scan_op(original: Callable) -> Callable:
    @functools.wraps(original)
    def mamba_selective_scan(
        hidden_states: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        delta_bias: torch.Tensor | None = None,
        delta_softplus: bool = False,
        return_last_state: bool = False,
        **kwargs: Any,
    ) -> Any:
        from torch._higher_order_ops.scan import scan

        batch_size, intermediate_size, _ = hidden_states.shape
        input_dtype = hidden_states.dtype
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = torch.nn.functional.softplus(dt)
        B, C = B.transpose(1, 2), C.transpose(1, 2)
        discrete_a = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
        delta_b_u = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()
        # the loop's state is in the input dtype before its first step and promoted after: the
        # scan's carry keeps one dtype, the promoted one (zeros are zeros in either)
        state_dtype = torch.promote_types(torch.promote_types(discrete_a.dtype, delta_b_u.dtype), input_dtype)
        state = torch.zeros(batch_size, intermediate_size, A.shape[-1], dtype=state_dtype, device=A.device)

        def step(state: torch.Tensor, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            decay, update = xs
            state = decay * state + update
            return state, state.clone()

        # the sequence axis first: scan walks axis 0. Every step's state comes out and is read
        # out after the scan, as a product and a sum: ExecuTorch's edge passes fail on a scan body
        # with a matmul ('SymInt' object has no attribute 'unsqueeze'), and a batched matmul is a
        # reshape of two dynamic axes, which XNNPACK cannot take
        state, states = scan(step, state, (discrete_a.permute(2, 0, 1, 3), delta_b_u.permute(2, 0, 1, 3)))
        outputs = (states.to(input_dtype) * C.transpose(0, 1)[:, :, None, :]).sum(-1)
        scan_output = outputs.permute(1, 2, 0)
        if D is not None:
            scan_output = scan_output + hidden_states * D[None, :, None]
        if z is not None:
            scan_output = scan_output * torch.nn.functional.silu(z)
        return (scan_output, state) if return_last_state else scan_output

    return mamba_selective_scan
