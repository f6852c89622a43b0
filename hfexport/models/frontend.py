"""The transformers frontend: what capture needs to know about a transformers model and its inputs.

The pipeline knows no model; the exporters hand it :data:`TRANSFORMERS`, which checks the model's
attention implementation, registers the cache classes as pytree nodes, renames deprecated input
names, and reads the sliding windows of windowed static caches in the inputs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hfexport.errors import ConfigError, UnsupportedModelError
from hfexport.models.caches import register_cache_pytrees
from hfexport.models.static_layers import attention_windows
from hfexport.pipeline.capture import Frontend
from hfexport.pipeline.inputs import as_input_dict

SUPPORTED_ATTENTION = ("sdpa", "eager")

# transformers 5.24 renamed forward's ``past_key_values`` to ``cache`` and takes the old name
# through ``**kwargs``; torch.export cannot match dynamic shapes given for a ``**kwargs`` entry, so
# the old name is passed under the new one.
_RENAMED_INPUTS = {"past_key_values": "cache"}


def normalize_inputs(inputs: Any, model: torch.nn.Module | None = None, renames: bool = False) -> dict[str, Any]:
    """The model's keyword inputs as a new plain dict (``BatchEncoding`` included), ``None``
    dropped, and deprecated names renamed when ``forward`` (of ``model``) spells them
    differently, or always with ``renames=True`` (for programs, whose inputs use the new names)."""
    normalized = as_input_dict(inputs)
    parameters = inspect.signature(model.forward).parameters if model is not None else {}
    for old, new in _RENAMED_INPUTS.items():
        if old in normalized and new not in normalized and (renames or (old not in parameters and new in parameters)):
            normalized[new] = normalized.pop(old)
    return normalized


def check_attention_implementation(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` if any (sub)model uses an attention implementation
    that no exporter can trace (FlashAttention, FlexAttention, paged, kernels from the Hub)."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation is None or implementation in SUPPORTED_ATTENTION:
            continue
        where = f"submodule {name!r} ({type(module).__name__})" if name else type(module).__name__
        raise UnsupportedModelError(
            f"{where} uses attn_implementation={implementation!r}, which cannot be exported "
            f"(FlashAttention and FlexAttention are not traceable). Load the model with "
            f"attn_implementation='sdpa' (preferred) or 'eager', or call "
            f"model.set_attn_implementation('sdpa') before exporting."
        )


# inputs holding token ids: looked up in an embedding table
_ID_INPUTS = ("input_ids", "decoder_input_ids")


def check_sample_tensors(model: torch.nn.Module, inputs: dict[str, Any]) -> None:
    """Refuse, naming the input, a sample the model could not run: a top-level input that is a
    NumPy array or a list instead of a tensor; token ids that are not integers, are empty, or lie
    outside the embedding table (a tracer does not look at values, so such a sample would be
    captured and give a program that fails or reads garbage on the same ids)."""
    for name, value in inputs.items():
        if type(value).__module__ == "numpy" or (isinstance(value, (list, tuple)) and name in _ID_INPUTS):
            raise ConfigError(
                f"input {name!r} is a {type(value).__name__}; pass a torch tensor (torch.as_tensor(value))"
            )
    table = getattr(input_embeddings(model), "num_embeddings", None)
    config = getattr(model, "config", None)
    special = {
        value
        for key, value in (vars(config).items() if config is not None else ())
        if key.endswith(("_token_id", "_token_index")) and isinstance(value, int)
    }  # multimodal placeholders (image_token_id) replaced before the lookup
    for name in _ID_INPUTS:
        value = inputs.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ConfigError(
                f"input {name!r} holds token ids but has dtype {str(value.dtype).removeprefix('torch.')}; "
                "pass integer ids (tensor.long())"
            )
        if value.numel() == 0:
            raise ConfigError(f"input {name!r} is empty (shape {tuple(value.shape)}); export from a non-empty sample")
        if table is None or name != "input_ids":
            continue
        outside = value[(value < 0) | (value >= table)]
        outside = sorted({int(v) for v in outside.unique().tolist()} - special)
        if outside:
            raise ConfigError(
                f"input {name!r} holds id(s) {outside[:5]} outside the embedding table (0 to {table - 1}); "
                "a sample must hold ids the model can look up"
            )


def input_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's token embedding table, or ``None`` for a model without one (vision, audio,
    CLIP-style dual encoders: transformers raises ``NotImplementedError`` for those)."""
    try:
        return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):
        return None


class TransformersFrontend(Frontend):
    """:class:`~hfexport.pipeline.capture.Frontend` for transformers models."""

    def prepare(self, model: torch.nn.Module, inputs: Any) -> dict[str, Any]:
        check_attention_implementation(model)
        # before anything flattens a model input or output (the eager reference included)
        register_cache_pytrees()
        normalized = normalize_inputs(inputs, model)
        check_sample_tensors(model, normalized)
        return normalized

    def static_axes(self, model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, set[int]]:
        """Axes the model or its cache fixes:

        - the width of flattened patch vectors (``[patches, channels x temporal x patch x patch]``):
          Qwen2-VL-style ``pixel_values`` and the ``hidden_states`` its vision encoder takes. The
          vision config fixes it, and left symbolic it reaches ONNX as a symbolic convolution width
          (ONNX Runtime then rejects the Conv's bias);
        - a 4-D attention mask's head axis (1, broadcast) and, with a static cache in the inputs,
          its key axis (the cache length);
        - every axis but the batch of a static cache's tensors (heads, length, head size). Left
          ``Dim.AUTO``, each is a symbol until the trace meets the weights, and the symbolic
          arithmetic costs: SmolLM2-135M's decode capture took 12.7 s instead of 9.1;
        - the height and width of images at the size the config names (``image_size``, which the
          image processor resizes every image to). Symbolic, a windowed vision transformer's
          padding and window reshapes grow expressions that sympy's simplification takes
          minutes on (Swin, Swin2SR, MaskFormer, Donut: no capture within 5 minutes;
          pytorch/pytorch#141675); a model that takes other sizes is exported for them with
          ``dynamic_shapes``.
        """
        patch_inputs = ["pixel_values", "pixel_values_videos"]
        if _is_vision_encoder(model):
            patch_inputs.append("hidden_states")
        fixed = {
            name: {1} for name in patch_inputs if isinstance(inputs.get(name), torch.Tensor) and inputs[name].dim() == 2
        }
        for name in ("pixel_values", "pixel_values_videos"):
            if _at_configured_image_size(model, inputs.get(name)):
                fixed[name] = {inputs[name].dim() - 2, inputs[name].dim() - 1}
        key_axis = {3} if _has_static_cache(inputs) else set()
        for name, value in inputs.items():
            masks = list(value.values()) if isinstance(value, dict) else [value]
            if name.endswith("attention_mask") and all(isinstance(m, torch.Tensor) and m.dim() == 4 for m in masks):
                fixed[name] = {1, *key_axis}
            if is_static_cache(value):
                fixed[name] = {1, 2, 3}
        return fixed

    def attention_windows(self, inputs: dict[str, Any]) -> dict[str, int]:
        return attention_windows(inputs)


def _at_configured_image_size(model: torch.nn.Module, value: Any) -> bool:
    """Whether ``value`` is images (``[..., channels, height, width]``) of the size the model's
    config (or one of its sub-configs) names as ``image_size``."""
    from hfexport.models.samples import config_image_sizes

    if not isinstance(value, torch.Tensor) or value.dim() < 4:
        return False
    return tuple(value.shape[-2:]) in config_image_sizes(getattr(model, "config", None))


def _has_static_cache(inputs: dict[str, Any]) -> bool:
    from transformers import cache_utils

    for value in inputs.values():
        for cache in (value, getattr(value, "self_attention_cache", None)):
            if any(isinstance(layer, cache_utils.StaticLayer) for layer in getattr(cache, "layers", ())):
                return True
    return False


def is_static_cache(value: Any) -> bool:
    """A cache whose every layer is static: its tensors are ``[batch, heads, length, head size]``."""
    from transformers import cache_utils

    layers = getattr(value, "layers", None)
    return bool(layers) and all(isinstance(layer, cache_utils.StaticLayer) for layer in layers)


def _is_vision_encoder(model: torch.nn.Module) -> bool:
    encoder = getattr(model, "encoder", model)  # VisionEncoderWithIndices wraps one
    return getattr(getattr(encoder, "config", None), "patch_size", None) is not None


TRANSFORMERS = TransformersFrontend()
