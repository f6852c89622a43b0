"""Capture patches: workarounds for upstream bugs that must act before ``torch.export`` runs,
registered in :mod:`hfexport.pipeline.patches` (scope ``"capture"``) and applied only around it."""

from __future__ import annotations

import contextlib
import functools
import math
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


@register_patch(
    "torch.nn:Module.to",
    name="module_to_without_change",
    reason=(
        "a forward that casts a submodule to the dtype it already has (SwitchTransformers' router: "
        "self.classifier.to(self.dtype)) fails non-strict export, whose fake parameters cannot be swapped "
        '("_apply(): Couldn\'t swap Linear.weight"); a conversion that changes no tensor returns the module as is'
    ),
    upstream="https://github.com/pytorch/pytorch/issues/153056",
)
def _module_to_without_change(original: Callable) -> Callable:
    @functools.wraps(original)
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        unchanged = memory_format is None and all(
            (device is None or t.device == device)
            and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
            for t in tensors
        )
        return self if unchanged else original(self, *args, **kwargs)

    return to


@register_patch(
    "torch.nn.functional:max_pool1d",
    name="max_pool1d_as_max_pool2d",
    reason=(
        "aten.max_pool1d reads its input's length as a plain integer, so torch.export fixes a dynamic "
        "length to the sample's (Eq(s27, 7): SEW and SEW-D pool their attention mask with it, CANINE "
        "its characters); max_pool2d over a height of one computes the same maxima with a symbolic length"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/103892",  # the same for adaptive_max_pool1d
)
def _max_pool1d_as_max_pool2d(original: Callable) -> Callable:
    def pair(value: Any, fill: int) -> tuple[int, int]:
        value = value[0] if isinstance(value, list | tuple) else value
        return (fill, value)

    @functools.wraps(original)
    def max_pool1d(
        input: torch.Tensor,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        dilation: Any = 1,
        ceil_mode: bool = False,
        return_indices: bool = False,
    ) -> Any:
        if isinstance(input.shape[-1], int):  # a static length: nothing to fix
            return original(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
        stride = kernel_size if stride is None or stride == [] else stride
        pooled = torch.nn.functional.max_pool2d(
            input.unsqueeze(-2),
            pair(kernel_size, 1),
            pair(stride, 1),
            pair(padding, 0),
            pair(dilation, 1),
            ceil_mode=ceil_mode,
            return_indices=return_indices,
        )
        if return_indices:
            return pooled[0].squeeze(-2), pooled[1].squeeze(-2)
        return pooled.squeeze(-2)

    return max_pool1d


def _codec_conv_padding_in_integers(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, padding_cache: Any = None) -> torch.Tensor:
        if padding_cache is not None:  # streaming: the cache holds the left context
            return original(self, hidden_states, padding_cache)
        length = hidden_states.shape[-1]
        conv = self.conv
        stride = conv.stride[0]
        kernel = (conv.kernel_size[0] - 1) * conv.dilation[0] + 1
        total = kernel - stride
        # _get_extra_padding_for_conv1d: ceil((length - kernel + total) / stride) frames, in integers
        frames = -((kernel - total - length) // stride)
        extra = frames * stride + kernel - total - length
        right = total // 2
        paddings = (total, extra) if self.causal else (total - right, right + extra)
        hidden_states = self.conv(self._pad1d(hidden_states, paddings, mode=self.pad_mode))
        if getattr(self, "norm_type", None) == "time_group_norm":
            hidden_states = self.norm(hidden_states)
        return hidden_states

    return forward


# EnCodec's padded convolution and its copies: the paddings are tensors (buffers), so every one is an
# .item() during capture (a data-dependent size: GuardOnDataDependentSymNode Eq(u0, 1) in _pad1d)
for _family, _conv in (
    ("encodec", "EncodecConv1d"),
    ("wavtokenizer", "WavTokenizerConv1d"),
    ("pocket_tts_audio_tokenizer", "PocketTTSAudioTokenizerConv1d"),
    ("mimi", "MimiConv1d"),
):
    register_patch(
        f"transformers.models.{_family}.modeling_*:{_conv}.forward",
        name=f"{_family}_conv_padding_in_integers",
        reason=(
            f"{_conv} keeps its kernel, stride and padding as integer tensors, so the paddings it computes "
            "for a dynamic length are data-dependent sizes (GuardOnDataDependentSymNode in _pad1d); computed "
            "from the convolution's own integers they are symbolic sizes, the same numbers"
        ),
        upstream="https://github.com/pytorch/pytorch/issues/155162",
    )(_codec_conv_padding_in_integers)


@register_patch(
    "transformers.models.encodec.modeling_*:EncodecModel.encode",
    name="encodec_one_chunk_without_a_loop",
    reason=(
        "with no chunk_length EnCodec encodes the whole waveform as one chunk, in a loop over "
        "range(0, length, length) that fixes the length to the sample's; the one chunk is encoded directly"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/136216",  # Python control flow on an input's size
)
def _encodec_one_chunk_without_a_loop(original: Callable) -> Callable:
    @functools.wraps(original)
    def encode(
        self: torch.nn.Module,
        input_values: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        bandwidth: float | None = None,
        return_dict: bool | None = None,
    ) -> Any:
        bandwidth = self.config.target_bandwidths[0] if bandwidth is None else bandwidth
        if (
            self.config.chunk_length is not None
            or isinstance(input_values.shape[-1], int)
            or bandwidth not in self.config.target_bandwidths
            or input_values.shape[1] not in (1, 2)
        ):
            return original(self, input_values, padding_mask, bandwidth, return_dict)
        if padding_mask is None:
            mask = torch.ones_like(input_values).bool()
        else:
            mask = padding_mask.view(padding_mask.shape[0], -1, padding_mask.shape[-1]).bool()
        codes, scale = self._encode_frame(mask * input_values, bandwidth)
        frames, scales = torch.stack([codes]), [scale]
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if not return_dict:
            return frames, scales, 0
        return sys.modules[type(self).__module__].EncodecEncoderOutput(frames, scales, 0)

    return encode


@register_patch(
    "transformers.models.cpmant.modeling_*:CpmAntModel._prepare_attention_mask",
    name="cpmant_padding_mask_from_arange",
    reason=(
        "CPM-Ant counts its left padding down with torch.tensor(list(range(length))[::-1]), a Python list as "
        "long as the sample (Eq(s70, 8)); torch.arange counting down makes the same mask for any length"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/136216",  # Python control flow on an input's size
)
def _cpmant_padding_mask_from_arange(original: Callable) -> Callable:
    @functools.wraps(original)
    def prepare(
        self: torch.nn.Module, input_ids: torch.Tensor, span: torch.Tensor, context: torch.Tensor, length: torch.Tensor
    ) -> torch.Tensor:
        batch, seqlen = input_ids.shape
        positions = torch.arange(seqlen, device=input_ids.device)
        attention_mask = context[:, None, :] | (
            context[:, :, None].logical_not() & (positions <= positions.view(-1, 1)).view(1, seqlen, seqlen)
        )
        attention_mask = attention_mask & (span[:, None, :] == span[:, :, None])
        left = torch.arange(seqlen - self.prompt_length - 1, -1, -1, device=input_ids.device)
        mask_1d = left[None, :].repeat(batch, 1) < length[:, None]
        prompt = torch.ones(batch, self.prompt_length, device=input_ids.device).bool()
        mask_1d = torch.cat((prompt, mask_1d), dim=1)
        return mask_1d.view(batch, seqlen, 1) & mask_1d.view(batch, 1, seqlen) & attention_mask

    return prepare


@register_patch(
    "transformers.models.reformer.modeling_*:AxialPositionEmbeddings.forward",
    name="reformer_axial_positions_by_indexing",
    reason=(
        "Reformer's axial position encodings (in eval) cut the table at positions.max().item() and select "
        "each row's positions in a Python loop over the batch, fixing the batch to the sample's (Eq(s72, 2)); "
        "indexing the whole table by the position ids selects the same encodings for any batch"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/136216",  # Python control flow on an input's size
)
def _reformer_axial_positions_by_indexing(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
        shape = tuple(self.axial_pos_shape)
        if self.training or math.prod(shape) < position_ids.shape[1]:
            return original(self, position_ids)  # training, or the length check's error
        table = torch.cat([weight.expand(shape + weight.shape[-1:]) for weight in self.weights], dim=-1)
        return table.reshape(-1, table.shape[-1])[position_ids]

    return forward


@register_patch(
    "transformers.models.canine.modeling_*:CanineAttention.forward",
    name="canine_local_attention_as_a_block_mask",
    reason=(
        "CANINE's local attention attends within chunks of the characters in a Python loop over "
        "range(0, length, stride), fixing the length to the sample's; with chunks that neither overlap nor "
        "attend to the first position (how CanineModel builds its character encoder) it is attention masked "
        "to the diagonal blocks (-inf outside, so each row's softmax is its chunk's)"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/136216",  # Python control flow on an input's size
)
def _canine_local_attention_as_a_block_mask(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
    ) -> tuple:
        width = self.attend_from_chunk_width
        blocks = self.local and width == self.attend_from_chunk_stride == self.attend_to_chunk_width
        blocks = blocks and width == self.attend_to_chunk_stride
        blocks = blocks and not (self.always_attend_to_first_position or self.first_position_attends_to_all)
        if (
            not blocks
            or output_attentions
            or attention_mask is None
            or attention_mask.ndim != 3
            or isinstance(hidden_states.shape[1], int)
        ):
            return original(self, hidden_states, attention_mask, output_attentions)
        chunk = torch.arange(hidden_states.shape[1], device=hidden_states.device) // width
        additive = (1.0 - attention_mask.float()) * torch.finfo(hidden_states.dtype).min
        additive = additive.masked_fill(chunk[:, None] != chunk[None, :], float("-inf"))
        context = self.self(hidden_states, hidden_states, additive[:, None], False)[0]
        return (self.output(context, hidden_states),)

    return forward


def _sizes_of_one_as_any_size(original: Callable) -> Callable:
    """``original`` traced with sizes of one treated as any size (torch.export's size-oblivious
    reasoning), so a size that is one at the sample is not fixed by a contiguity check."""

    @functools.wraps(original)
    def size_oblivious(*args: Any, **kwargs: Any) -> Any:
        from torch.fx.experimental import _config as shapes_config

        with shapes_config.patch(backed_size_oblivious=True):
            return original(*args, **kwargs)

    return size_oblivious


register_patch(
    "transformers.models.canine.modeling_*:CanineModel._repeat_molecules",
    name="canine_molecules_repeated_for_any_count",
    reason=(
        "CANINE repeats its molecules back to characters with repeat_interleave; a sample of up to 11 "
        "characters has one molecule past the first, and that size of one is fixed by the repeat's "
        "contiguity check (Eq((s41//4) - 1, 1)). Repeated with sizes of one treated as any size, as "
        "torch.export's size-oblivious reasoning does"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/146315",  # 0/1 specialization of dynamic sizes
)(_sizes_of_one_as_any_size)


for _compressor in ("DeepseekV4CSACompressor", "DeepseekV4Indexer"):
    register_patch(
        f"transformers.models.deepseek_v4.modeling_deepseek_v4:{_compressor}.forward",
        name=f"deepseek_v4_{_compressor.removeprefix('DeepseekV4').lower()}_for_any_window_count",
        reason=(
            f"{_compressor} copies each window's overlap from the window before (new_kv[:, 1:] = "
            "chunk_kv[:, :-1]); at the sample's 8 tokens there is one such window, and the copy's contiguity "
            "check fixed that count (Eq((s70//4) - 1, 1)): the program took at most 11 tokens. Traced with "
            "sizes of one treated as any size, it takes any length"
        ),
        upstream="https://github.com/pytorch/pytorch/issues/146315",  # 0/1 specialization of dynamic sizes
    )(_sizes_of_one_as_any_size)


@register_patch(
    "transformers.models.switch_transformers.modeling_*:SwitchTransformersExperts.forward",
    name="switch_experts_dense",
    reason=(
        "SwitchTransformers' experts loop in Python over the experts that some token chose (nonzero(), then "
        "where() per expert): data-dependent, so the trace cannot go through it (Could not guard on Eq(u0, 0)). "
        "Every expert runs on every token instead and its output counts with the token's routing weight, zero "
        "where the router did not choose it (or the expert was over capacity): the same sums"
    ),
    upstream="https://github.com/huggingface/transformers/issues/38518",
)
def _switch_experts_dense(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        selected_experts: torch.Tensor,
        routing_weights: torch.Tensor,
    ) -> torch.Tensor:
        # selected_experts: [tokens, 1, experts] one-hot (top-1); routing_weights: [tokens, 1]
        weights = selected_experts.to(routing_weights.dtype) * routing_weights[:, :, None]
        final = torch.zeros_like(hidden_states)
        for index in range(self.num_experts):
            expert_out = self[f"expert_{index}"](hidden_states)
            final = final + (expert_out * weights[:, 0, index, None]).to(hidden_states.dtype)
        return final

    return forward


@register_patch(
    "transformers.integrations.moe:ExpertsInterface.get_interface",
    name="eager_experts_as_batched_mm",
    reason=(
        "experts left on transformers' eager implementation (OpenAI Privacy Filter asks for it; grouped_mm "
        "falls back to it where it cannot run) loop in Python over the experts some token chose (nonzero()), "
        "which the trace cannot go through (Could not guard on Eq(u0, 0)). transformers' batched_mm "
        "implementation computes each token's chosen experts with gathered weights instead: the same sums, "
        "in another order"
    ),
    upstream="https://github.com/huggingface/transformers/issues/38518",
)
def _eager_experts_as_batched_mm(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_interface(self: Any, experts_implementation: str | None, default: Callable) -> Callable:
        if experts_implementation not in (None, "eager") or "batched_mm" not in self:
            return original(self, experts_implementation, default)
        return self["batched_mm"]

    return get_interface


@register_patch(
    "transformers.models.udop.modeling_udop:combine_image_text_embeddings",
    name="udop_patches_by_scatter",
    reason=(
        "UDOP keeps the image patches no word's box points at by walking the tensors in Python (zip(*ind), "
        "one boolean index per row, padded one row at a time), which no trace can follow (The tensor has a "
        "non-zero number of elements, but its data is not allocated yet). Each kept patch is scattered to its "
        "place among the kept ones instead (cumsum of the mask): the same rows and padding"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/122898",
)
def _udop_patches_by_scatter(original: Callable) -> Callable:
    @functools.wraps(original)
    def combine_image_text_embeddings(
        image_embeddings: torch.Tensor,
        inputs_embeds: torch.Tensor,
        bbox: torch.Tensor,
        visual_bbox: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        num_patches: int = 14,
        max_len: int = 0,
        image_size: int = 224,
        patch_size: int = 16,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        module = sys.modules[original.__module__]
        batch, patches, width = image_embeddings.shape
        centre_x = torch.floor((bbox[:, :, 0] + bbox[:, :, 2]) / 2.0 * num_patches).long()
        centre_y = torch.floor((bbox[:, :, 1] + bbox[:, :, 3]) / 2.0 * num_patches).long()
        ocr_points = centre_x.clip(0, num_patches - 1) + centre_y.clip(0, num_patches - 1) * num_patches
        bbox = bbox.to(torch.float32 if bbox.device.type == "mps" else torch.float64)
        target_seg = (bbox.mean(-1) == 0.0) | (bbox.mean(-1) == 1.0)
        words_vision = torch.gather(image_embeddings, 1, ocr_points.unsqueeze(-1).expand(-1, -1, width))
        inputs_embeds += words_vision.masked_fill(target_seg[..., None], 0.0)
        kept = torch.ones(batch, patches, dtype=torch.bool, device=image_embeddings.device)
        kept = kept.scatter(1, ocr_points, False)
        # a kept patch goes to its rank among the kept ones; a dropped one to a spare last slot
        place = torch.where(kept, kept.long().cumsum(1) - 1, patches)
        length = patches if max_len == 0 else max_len - inputs_embeds.size(1)

        def packed(rows: torch.Tensor) -> torch.Tensor:
            spare = rows.new_zeros(batch, patches + 1, rows.shape[-1])
            out = spare.scatter(1, place[..., None].expand(-1, -1, rows.shape[-1]), rows)[:, :patches]
            if length > patches:
                return torch.cat([out, out.new_zeros(batch, length - patches, out.shape[-1])], 1)
            return out[:, :length]

        if visual_bbox is None:
            visual_bbox = module.get_visual_bbox(image_size=image_size, patch_size=patch_size)
            visual_bbox = visual_bbox.unsqueeze(0).repeat(batch, 1, 1).to(image_embeddings.device)
        inputs_embeds = torch.cat([inputs_embeds, packed(image_embeddings)], 1)
        bbox = torch.cat([bbox, packed(visual_bbox)], 1)
        if attention_mask is not None:
            count = kept.sum(1, keepdim=True)
            visual_mask = torch.arange(length, device=attention_mask.device)[None, :] < count
            attention_mask = torch.cat([attention_mask, visual_mask.to(attention_mask.dtype)], 1)
        return inputs_embeds, bbox, attention_mask

    return combine_image_text_embeddings


@register_patch(
    "transformers.models.fsmt.modeling_fsmt:SinusoidalPositionalEmbedding.forward",
    name="fsmt_positions_from_a_cache_counter",
    reason=(
        "FSMT's decoder offsets its positions by cache.get_seq_length(), a static cache's token counter "
        "(a tensor), and grows its sinusoid table in a Python if on it: no trace can follow (Could not guard on "
        "data-dependent expression Eq(u0, 1)). With a counter the positions index the table as it is (it holds "
        "max_position_embeddings positions, more than a static cache within the model's limits reaches)"
    ),
    upstream="https://github.com/huggingface/transformers/issues/45987",
)
def _fsmt_positions_from_a_cache_counter(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self: torch.nn.Embedding, input: torch.Tensor, *, cache_length: Any = 0) -> torch.Tensor:
        if not isinstance(cache_length, torch.Tensor):
            return original(self, input, cache_length=cache_length)
        positions = self.make_positions(input, self.padding_idx) + cache_length
        return torch.nn.functional.embedding(positions, self.weight, self.padding_idx)

    return forward


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


PACKED_ATTENTION_REASON = (
    "a vision (or audio) tower packs every image's patches into one sequence and attends within each "
    "image: without flash attention its code splits the sequence with cu_seqlens.tolist() and runs one "
    "attention per image, whose data-dependent split sizes fail the trace (GuardOnDataDependentSymNode; "
    "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ... share the code). The flash-attention branch passes "
    "cu_seqlens to the attention function instead; SDPA over all patches with the block-diagonal mask "
    "cu_seqlens draws computes the same attention"
)


@register_patch(
    "transformers.models.*.modeling_*:is_flash_attention_requested",
    name="packed_attention_branch",
    reason=PACKED_ATTENTION_REASON,
    upstream="https://github.com/pytorch/pytorch/issues/158786",
)
def _packed_attention_branch(original: Callable) -> Callable:
    @functools.wraps(original)
    def is_flash_attention_requested(config: Any = None, *args: Any, **kwargs: Any) -> bool:
        if original(config, *args, **kwargs):
            return True
        # only where the caller attends over packed sequences (it holds their boundaries) with SDPA,
        # whose function takes them below (packed_sequences_as_sdpa_masks)
        caller = sys._getframe(1).f_locals
        return "cu_seqlens" in caller and getattr(config, "_attn_implementation", None) == "sdpa"

    return is_flash_attention_requested


@register_patch(
    "transformers.modeling_utils:AttentionInterface.get_interface",
    name="packed_sequences_as_sdpa_masks",
    reason=PACKED_ATTENTION_REASON,
    upstream="https://github.com/pytorch/pytorch/issues/158786",
)
def _packed_sequences_as_sdpa_masks(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_interface(self: Any, attn_implementation: str, default: Callable) -> Callable:
        found = original(self, attn_implementation, default)
        if attn_implementation != "sdpa":
            return found

        def attention(
            module: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None = None,
            *args: Any,
            cu_seq_lens_q: torch.Tensor | None = None,
            cu_seq_lens_k: torch.Tensor | None = None,
            max_length_q: Any = None,
            max_length_k: Any = None,
            **kwargs: Any,
        ) -> Any:
            if cu_seq_lens_q is not None and attention_mask is None:
                attention_mask = segment_mask(cu_seq_lens_q, query.shape[2])[None, None]
            return found(module, query, key, value, attention_mask, *args, **kwargs)

        return attention

    return get_interface


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
    "transformers.models.*.modeling_*:mamba_selective_scan",
    name="selective_scan_as_scan_op",
    reason=(
        "Mamba's selective scan (Mamba, Falcon-Mamba, Jamba, Zamba) without its CUDA kernels is a Python "
        "loop over the sequence, so torch.export unrolls it and fixes the sequence axis to the sample's "
        "length (a program that takes only 8 tokens). The same recurrence as torch's scan higher-order "
        "op traces once for any length, and ONNX (a Scan node) and ExecuTorch (a loop of jumps) both lower it"
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


@register_patch(
    "torch.nn.modules.rnn:LSTM.forward",
    name="lstm_as_scan_op",
    reason=(
        "torch.export decomposes nn.LSTM into a Python loop over the time axis and fixes that axis to the "
        "sample's length (Parakeet's and Nemotron ASR's transducer predictors: a program that takes only "
        "the sample's decoder tokens). The same recurrence as torch's scan higher-order op traces once for "
        "any length; packed sequences and projected LSTMs keep torch's own forward"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/115092",
)
def _lstm_as_scan_op(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(self: torch.nn.LSTM, input: Any, hx: Any = None) -> Any:
        from torch._higher_order_ops.scan import scan

        if not isinstance(input, torch.Tensor) or self.proj_size > 0:
            return original(self, input, hx)  # a PackedSequence
        batched = input.dim() == 3
        if batched:
            steps = input.transpose(0, 1) if self.batch_first else input  # time first: scan walks axis 0
        else:
            steps = input.unsqueeze(1)
        directions = 2 if self.bidirectional else 1
        shape = (self.num_layers * directions, steps.shape[1], self.hidden_size)
        if hx is None:
            h0, c0 = steps.new_zeros(shape), steps.new_zeros(shape)  # two: scan refuses aliased carries
        else:
            h0, c0 = (h if batched else h.unsqueeze(1) for h in hx)
        last_h, last_c = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = f"l{layer}" + ("_reverse" if direction else "")
                w_ih, w_hh = getattr(self, f"weight_ih_{suffix}"), getattr(self, f"weight_hh_{suffix}")
                sequence = steps.flip(0) if direction else steps
                gates_in = sequence @ w_ih.T  # every step's input projection at once, outside the scan
                if self.bias:
                    gates_in = gates_in + getattr(self, f"bias_ih_{suffix}") + getattr(self, f"bias_hh_{suffix}")

                index = layer * directions + direction
                carry = (h0[index].clone(), c0[index].clone())
                (h, c), out = scan(_lstm_step(w_hh.T.contiguous()), carry, gates_in)
                outputs.append(out.flip(0) if direction else out)
                last_h.append(h)
                last_c.append(c)
            steps = torch.cat(outputs, dim=-1) if directions == 2 else outputs[0]
        output = steps.transpose(0, 1) if batched and self.batch_first else steps
        h_n, c_n = torch.stack(last_h), torch.stack(last_c)
        if not batched:
            output, h_n, c_n = output.squeeze(1), h_n.squeeze(1), c_n.squeeze(1)
        return output, (h_n, c_n)

    return forward


def _lstm_step(w_hh_t: torch.Tensor) -> Callable:
    """One LSTM time step over ``(h, c)`` given the step's input projection (torch's gate order;
    ``w_hh_t``: the hidden-to-hidden weight transposed)."""

    def step(carry: tuple[torch.Tensor, torch.Tensor], gates_x: torch.Tensor) -> tuple:
        h, c = carry
        i, f, g, o = (gates_x + h @ w_hh_t).chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h, c), h.clone()

    return step


@register_patch(
    "transformers.models.rwkv.modeling_rwkv:rwkv_linear_attention_cpu",
    name="rwkv_recurrence_as_scan_op",
    reason=(
        "RWKV's time mixing without its CUDA kernel is a Python loop over the sequence, so torch.export "
        "unrolls it and fixes the sequence axis to the sample's length. The same recurrence (numerator, "
        "denominator and running maximum as the carry) as torch's scan higher-order op traces once for "
        "any length"
    ),
    upstream="https://github.com/huggingface/transformers/blob/main/src/transformers/models/rwkv/modeling_rwkv.py",
)
def _rwkv_recurrence_as_scan_op(original: Callable) -> Callable:
    @functools.wraps(original)
    def rwkv_linear_attention_cpu(
        time_decay: torch.Tensor,
        time_first: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        state: list[torch.Tensor] | None = None,
        return_state: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        from torch._higher_order_ops.scan import scan

        # the carry is row-major from the first step on: so is its initial value, as scan wants
        if state is None:
            zeros = key.new_zeros(key[:, 0].shape, dtype=torch.float32)
            carry = (zeros, zeros.clone(), zeros - 1e38)
        else:
            carry = tuple(t.contiguous() for t in state)
        decay = -torch.exp(time_decay)

        def step(carry: tuple, xs: tuple) -> tuple[tuple, torch.Tensor]:
            num_state, den_state, max_state = carry
            current_key, current_value = xs
            current_key = current_key.float()
            max_for_output = torch.maximum(max_state, current_key + time_first)
            e1 = torch.exp(max_state - max_for_output)
            e2 = torch.exp(current_key + time_first - max_for_output)
            output = ((e1 * num_state + e2 * current_value) / (e1 * den_state + e2)).to(key.dtype)
            max_for_state = torch.maximum(max_state + decay, current_key)
            e1 = torch.exp(max_state + decay - max_for_state)
            e2 = torch.exp(current_key - max_for_state)
            return (e1 * num_state + e2 * current_value, e1 * den_state + e2, max_for_state), output

        carry, outputs = scan(step, carry, (key.transpose(0, 1), value.transpose(0, 1)))
        returned = list(carry) if return_state or state is not None else None
        return outputs.transpose(0, 1), returned

    return rwkv_linear_attention_cpu


@register_patch(
    "transformers.models.ovis2.modeling_ovis2:Ovis2Model.forward",
    name="ovis2_visual_indicators_by_where",
    reason=(
        "Ovis2 writes each visual indicator token's embedding only `if mask.any()`, a branch on the ids' "
        "values (GuardOnDataDependentSymNode Eq(u1, 1)); torch.where writes the same embeddings, none where "
        "the token is absent, without the branch. The rest of the forward is transformers 5.24's"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/136216",  # Python control flow on a tensor's value
)
def _ovis2_visual_indicators_by_where(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(
        self: Any,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        mm_encoder_outputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        branchless = input_ids is not None and inputs_embeds is None and pixel_values is not None
        if not branchless or mm_encoder_outputs is not None or "past_key_values" in kwargs:
            return original(
                self, input_ids, pixel_values, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache,
                mm_encoder_outputs, **kwargs,
            )  # fmt: skip
        as_tuple = kwargs.pop("return_dict", None) is False
        inputs_embeds = self.get_input_embeddings()(input_ids)
        image = self.get_image_features(pixel_values=pixel_values, return_dict=True)
        mask = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds, image_features=image.pooler_output)
        inputs_embeds = inputs_embeds.masked_scatter(mask, image.pooler_output.to(inputs_embeds.dtype))
        indicators = image.visual_indicator_features.to(inputs_embeds.dtype)
        for i, token in enumerate(self.visual_indicator_token_ids):
            inputs_embeds = torch.where((input_ids == token).unsqueeze(-1), indicators[i], inputs_embeds)
        outputs = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        output = sys.modules[type(self).__module__].Ovis2ModelOutputWithPast(**outputs, image_outputs=image)
        return output.to_tuple() if as_tuple else output

    return forward
