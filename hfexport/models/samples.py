"""Sample inputs for a transformers model, from its forward signature and its config alone.

The command line's fallback when a checkpoint folder has no tokenizer, image processor or feature
extractor, and the coverage sweep's inputs: token ids (avoiding the special ids), an attention
mask, ``token_type_ids`` (two segments) and ``bbox`` when ``forward`` takes them; ``pixel_values``
sized from ``image_size`` / ``num_channels`` (sub-configs included), flattened patches with
``image_grid_thw`` for Qwen2-VL-style encoders; ``input_features`` (mel bins x frames, in the order
the first convolution reads) or ``input_values`` (a waveform long enough for the feature encoder's
strides); ``decoder_input_ids`` for encoder-decoder models; and, for multimodal models, the image
placeholder tokens in ``input_ids`` that the vision tower's output fills.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import torch

__all__ = ["config_sample_inputs"]


def config_sample_inputs(
    model: torch.nn.Module, batch: int = 2, seq: int = 8, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Sample inputs for ``model(**inputs)`` built from ``model.forward``'s parameters and
    ``model.config``: ``batch`` rows of ``seq`` text tokens (audio frames and image placeholders
    scale from ``seq`` where the model allows). Another ``batch`` / ``seq`` gives a second valid
    shape. Deterministic for a ``seed``."""
    params = set(inspect.signature(model.forward).parameters)
    config = getattr(model, "config", None)
    generator = torch.Generator().manual_seed(seed)
    inputs: dict[str, torch.Tensor] = {}
    image_tokens = 0
    image_token = _image_token_id(config, params)
    if "pixel_values" in params and not _takes_audio(params):
        pixels, extra, image_tokens = _pixel_inputs(model, config, params, batch, generator)
        if pixels is not None:
            inputs["pixel_values"] = pixels
            inputs.update(extra)
    if params & {"input_features", "input_values"}:
        inputs.update(_audio_inputs(model, config, params, batch, seq, generator))
    if "flattened_patches" in params:
        patches = _flattened_patches(config, batch, generator)
        # the patches' own mask is the attention mask of a model without text (Pix2Struct)
        inputs.update(patches if "input_ids" not in params else {"flattened_patches": patches["flattened_patches"]})
    if "input_ids" in params:
        ids = _token_ids(config, batch, seq, generator)
        if image_token is not None and "pixel_values" in inputs:
            placeholders = torch.full((batch, image_tokens), image_token, dtype=ids.dtype)
            ids = torch.cat([_framed(config, placeholders), ids], dim=1)
        elif "image_embeds_position_mask" in params and "flattened_patches" in inputs:
            # Kosmos-2.5: the image fills the positions its mask marks (its processor puts <s> there)
            count = _image_tokens(config, 0, None)
            placeholders = torch.full((batch, count), getattr(config, "bos_token_id", None) or 0, dtype=ids.dtype)
            ids = torch.cat([placeholders, ids], dim=1)
            inputs["image_embeds_position_mask"] = (torch.arange(ids.shape[1]) < count).long().repeat(batch, 1)
        inputs["input_ids"] = ids
        if "mm_token_type_ids" in params and image_token is not None:
            inputs["mm_token_type_ids"] = (ids == image_token).long()
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones_like(ids)
        if "token_type_ids" in params:  # a multimodal model marks its image tokens there (Gemma 3)
            image = image_token is not None and "pixel_values" in inputs
            inputs["token_type_ids"] = (ids == image_token).long() if image else _segments(config, ids)
        if "bbox" in params:
            inputs["bbox"] = _boxes(ids.shape, generator)
    if "decoder_input_ids" in params and _is_encoder_decoder(config):
        decoder_vocab = _vocab(getattr(config, "decoder", None) or config)
        inputs["decoder_input_ids"] = torch.randint(
            0, max(1, decoder_vocab - 32), (batch, max(1, seq // 2)), generator=generator
        )
    if inputs.get("pixel_values") is not None and image_token is not None and "input_ids" in inputs:
        _match_placeholders(model, inputs, image_token)
    if "input_features" in inputs and inputs["input_features"].dim() == 3 and not _runs(model, inputs):
        # (batch, mel, frames) and (batch, frames, mel) both exist; a model not taking the first takes the other
        swapped = {**inputs, "input_features": inputs["input_features"].transpose(1, 2).contiguous()}
        if "attention_mask" in swapped and "input_ids" not in swapped:
            swapped["attention_mask"] = torch.ones(batch, swapped["input_features"].shape[1], dtype=torch.long)
        if _runs(model, swapped):
            inputs = swapped
    if "pixel_values" in inputs and inputs["pixel_values"].dim() == 4 and not _runs(model, inputs):
        # images as (batch, images or frames, channels, height, width): Idefics3, ViViT
        frames = _side(_find(config, "num_frames", prefer="vision")) or 1
        stacked = inputs["pixel_values"][:, None].expand(-1, frames, -1, -1, -1).contiguous()
        if _runs(model, {**inputs, "pixel_values": stacked}):
            inputs = {**inputs, "pixel_values": stacked}
    if "input_values" in inputs and inputs["input_values"].dim() == 2 and not _runs(model, inputs):
        # a waveform as (batch, samples) or as (batch, channels, samples) with one channel
        channelled = {**inputs, "input_values": inputs["input_values"][:, None]}
        for masked in [channelled] if "attention_mask" not in channelled else [channelled, _unmasked(channelled)]:
            if _runs(model, masked):
                inputs = masked
                break
    return inputs


def with_rope_positions(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with ``position_ids`` made by the model's own ``get_rope_index`` when it has one
    and the inputs hold images (Qwen2-VL, Qwen3-VL, GLM-4V, ...: three rotary sections whose positions
    follow each image's grid). Left to the model, that function walks the ids in Python
    (``tolist`` and ``groupby``), which no trace can follow; as an input, the program takes the
    positions a caller computes with the same function."""
    if "position_ids" in inputs or "input_ids" not in inputs or "position_ids" not in _forward_params(model):
        return inputs
    grids = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw") if k in inputs}
    rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
    if not grids or not callable(rope_index):
        return inputs
    token_types = inputs.get("mm_token_type_ids")
    if token_types is None:
        image_token = getattr(model.config, "image_token_id", None)
        token_types = (inputs["input_ids"] == image_token).int() if image_token is not None else None
    try:
        with torch.no_grad():
            positions, _ = rope_index(
                inputs["input_ids"], mm_token_type_ids=token_types, attention_mask=inputs.get("attention_mask"), **grids
            )
    except Exception:  # another signature: the model computes its positions itself, as before
        return inputs
    return {**inputs, "position_ids": positions}


def _forward_params(model: torch.nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _unmasked(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value for name, value in inputs.items() if name != "attention_mask"}


def _runs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> bool:
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception:  # a probe: the caller sees the failure when it runs the model itself
        return False
    return True


# ---------------------------------------------------------------- text


def _special_ids(config: Any) -> set[int]:
    found: set[int] = set()
    for holder in _configs(config):
        for key, value in vars(holder).items():
            if key.endswith(("_token_id", "_token_index", "_token_ids")):
                for v in value if isinstance(value, (list, tuple)) else [value]:
                    if type(v) is int:
                        found.add(v)
    return found


def _vocab(config: Any) -> int:
    for holder in (config, _text_config(config)):
        vocab = getattr(holder, "vocab_size", None)
        if type(vocab) is int and vocab > 0:
            return vocab
    return 128


def _token_ids(config: Any, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """Random ids in the vocabulary that are no special token (placeholders, padding, ends)."""
    vocab = _vocab(config)
    special = _special_ids(config)
    allowed = torch.tensor([i for i in range(vocab) if i not in special] or list(range(vocab)))
    return allowed[torch.randint(0, len(allowed), (batch, seq), generator=generator)]


def _segments(config: Any, ids: torch.Tensor) -> torch.Tensor:
    """Two segments (a sentence pair) when the model has two token types, else all zeros."""
    types = torch.zeros_like(ids)
    if getattr(config, "type_vocab_size", 1) and getattr(config, "type_vocab_size", 1) >= 2:
        types[:, ids.shape[1] // 2 :] = 1
    return types


def _boxes(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    corners = torch.randint(0, 1000, (*shape, 2, 2), generator=generator).sort(dim=-2).values
    return corners.reshape(*shape, 4)  # x0, y0, x1, y1 with x0 <= x1 and y0 <= y1


def _is_encoder_decoder(config: Any) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


# ---------------------------------------------------------------- configs


def _configs(config: Any) -> list[Any]:
    """The config then its sub-configs (vision first), depth first."""
    if config is None:
        return []
    found = [config]
    for key in sorted(vars(config), key=lambda k: (not k.startswith("vision"), k)):
        value = getattr(config, key, None)
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and value is not config:
            found.extend(_configs(value))
    return found


def config_image_sizes(config: Any) -> set[tuple[int, int]]:
    """The ``(height, width)`` image sizes the config and its sub-configs name (``image_size``)."""
    sizes = set()
    for holder in _configs(config):
        value = getattr(holder, "image_size", None)
        if type(value) is int:
            sizes.add((value, value))
        elif isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
            sizes.add((value[0], value[1]))
    return sizes


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except (AttributeError, ValueError, TypeError):
        return config


def _find(config: Any, *names: str, prefer: str | None = None) -> Any:
    holders = _configs(config)
    if prefer:
        holders = [h for h in holders if prefer in type(h).__name__.lower()] + holders
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if value is not None:
                return value
    return None


def _side(value: Any) -> int | None:
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, dict):
        value = value.get("height") or value.get("shortest_edge")
    return value if type(value) is int else None


# ---------------------------------------------------------------- images


def _takes_audio(params: set[str]) -> bool:
    return bool(params & {"input_features", "input_values"}) and "pixel_values" not in params


def _pixel_inputs(
    model: torch.nn.Module, config: Any, params: set[str], batch: int, generator: torch.Generator
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor], int]:
    """``(pixel_values, extra inputs, image placeholder tokens per image)``."""
    channels = _side(_find(config, "num_channels", "in_channels", "in_chans", "image_channels", prefer="vision")) or 3
    patch = _side(_find(config, "patch_size", prefer="vision"))
    if "image_grid_thw" in params:
        merge = _side(_find(config, "spatial_merge_size", prefer="vision")) or 1
        temporal = _side(_find(config, "temporal_patch_size", prefer="vision")) or 1
        patch = patch or 14
        side = 2 * merge
        grid = torch.tensor([[1, side, side]] * batch)
        pixels = torch.randn(batch * side * side, channels * temporal * patch * patch, generator=generator)
        return pixels, {"image_grid_thw": grid}, side * side // (merge * merge)
    size = _side(_find(config, "image_size", "img_size", "input_size", prefer="vision"))
    if size is None:
        size = patch * 4 if patch else 64
    pixels = torch.randn(batch, channels, size, size, generator=generator)
    tokens = _image_tokens(config, size, patch)
    extra: dict[str, torch.Tensor] = {}
    if "pixel_mask" in params:
        extra["pixel_mask"] = torch.ones(batch, size, size, dtype=torch.long)
    return pixels, extra, tokens


def _flattened_patches(config: Any, batch: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Pix2Struct's image input: a 4 x 4 grid of patches as rows ``[row, column, pixels...]`` (1-based
    row and column ids, as its image processor numbers them) and their mask."""
    width = _side(_find(config, "patch_embed_hidden_size", prefer="vision")) or 768
    rows, cols = torch.meshgrid(torch.arange(1, 5), torch.arange(1, 5), indexing="ij")
    ids = torch.stack([rows.flatten(), cols.flatten()], dim=-1).float().expand(batch, -1, -1)
    pixels = torch.randn(batch, ids.shape[1], width, generator=generator)
    return {
        "flattened_patches": torch.cat([ids, pixels], dim=-1),
        "attention_mask": torch.ones(batch, ids.shape[1], dtype=torch.long),
    }


def _image_tokens(config: Any, size: int, patch: int | None) -> int:
    """Placeholder tokens one image fills in ``input_ids``, from the config's own count or its patches."""
    for name in (
        "mm_tokens_per_image",
        "image_seq_length",
        "num_image_tokens",
        "image_seq_len",
        "num_query_tokens",
        "latent_query_num",
    ):
        value = getattr(config, name, None)
        if type(value) is int and value > 0:
            return value
    if not patch:
        return 1
    tokens = (size // patch) ** 2
    merge = _side(_find(config, "spatial_merge_size", "merge_size", prefer="vision"))
    if merge:
        tokens //= merge * merge
    if getattr(config, "vision_feature_select_strategy", None) == "full":
        tokens += 1
    return max(1, tokens)


def _framed(config: Any, placeholders: torch.Tensor) -> torch.Tensor:
    """Placeholders wrapped in the vision start / end tokens when the config has them."""
    start = getattr(config, "vision_start_token_id", None)
    end = getattr(config, "vision_end_token_id", None)
    parts = []
    batch = placeholders.shape[0]
    if type(start) is int:
        parts.append(torch.full((batch, 1), start, dtype=placeholders.dtype))
    parts.append(placeholders)
    if type(end) is int:
        parts.append(torch.full((batch, 1), end, dtype=placeholders.dtype))
    return torch.cat(parts, dim=1)


def _image_token_id(config: Any, params: set[str]) -> int | None:
    if config is None or "pixel_values" not in params or "input_ids" not in params:
        return None
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if type(value) is int:
            return value
    return None


_MISMATCH = re.compile(r"tokens:?\s*(\d+),?\s*features:?\s*(\d+)", re.IGNORECASE)


def _match_placeholders(model: torch.nn.Module, inputs: dict[str, torch.Tensor], image_token: int) -> None:
    """When the vision tower fills another number of placeholders than the config said, transformers
    names both counts in its error: the placeholders are resized to the features it reported."""
    try:
        with torch.no_grad():
            model(**inputs)
        return
    except Exception as error:
        found = _MISMATCH.search(str(error))
        if not found:
            return
        features = int(found.group(2))
    ids = inputs["input_ids"]
    batch = ids.shape[0]
    per_row = features // batch if features % batch == 0 else features
    rows = []
    for row in ids:
        text = row[row != image_token]
        first = int((row == image_token).nonzero()[0]) if (row == image_token).any() else 0
        rows.append(torch.cat([text[:first], torch.full((per_row,), image_token, dtype=ids.dtype), text[first:]]))
    inputs["input_ids"] = torch.stack(rows)
    if "attention_mask" in inputs:
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in inputs:
            inputs[key] = (inputs["input_ids"] == image_token).long()


# ---------------------------------------------------------------- audio


def _first_conv(model: torch.nn.Module) -> torch.nn.Module | None:
    for module in model.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)):
            return module
    return None


def _audio_inputs(
    model: torch.nn.Module, config: Any, params: set[str], batch: int, seq: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    if "input_features" in params:
        mel = (
            _side(_find(config, "num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels", prefer="audio"))
            or 80
        )
        channels = getattr(config, "input_channels", 1) if type(getattr(config, "input_channels", 1)) is int else 1
        source = _find(config, "max_source_positions", prefer="audio")
        conv = _first_conv(model)
        mel_first = isinstance(conv, torch.nn.Conv1d) and conv.in_channels == mel
        if mel_first and type(source) is int:
            frames = source * math.prod(_conv_strides(model, 2))  # a fixed frame count (Whisper)
        else:
            frames = 8 * seq
        shape = (batch, mel * channels, frames) if mel_first else (batch, frames, mel * channels)
        features = torch.randn(*shape, generator=generator)
        found = {"input_features": features}
        if "attention_mask" in params and "input_ids" not in params:
            found["attention_mask"] = torch.ones(batch, frames, dtype=torch.long)
        return found
    strides = getattr(config, "conv_stride", None)
    kernels = getattr(config, "conv_kernel", None)
    ratios = getattr(config, "upsampling_ratios", None) or getattr(config, "downsampling_ratios", None)
    if isinstance(strides, (list, tuple)) and strides:
        hop = math.prod(strides)
        samples = hop * seq + (sum(kernels) if isinstance(kernels, (list, tuple)) else 0)
    elif isinstance(ratios, (list, tuple)) and ratios:
        samples = math.prod(ratios) * seq
    else:
        samples = 400 * seq
    channels = getattr(config, "audio_channels", None)
    shape = (batch, channels, samples) if type(channels) is int else (batch, samples)
    found = {"input_values": torch.randn(*shape, generator=generator)}
    if "attention_mask" in params and "input_ids" not in params and type(channels) is not int:
        found["attention_mask"] = torch.ones(batch, samples, dtype=torch.long)
    return found


def _conv_strides(model: torch.nn.Module, count: int) -> list[int]:
    strides = []
    for module in model.modules():
        if isinstance(module, torch.nn.Conv1d):
            strides.append(module.stride[0])
            if len(strides) == count:
                break
    return strides or [1]
