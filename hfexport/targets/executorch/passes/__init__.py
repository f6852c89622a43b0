"""The ExecuTorch target's passes and its default pass list: ``fx_passes`` that let XNNPACK take
what it would leave to portable kernels (:mod:`.attention`, :mod:`.delegation`,
:mod:`.portable_kernels`), and the ``edge_passes`` on the edge-dialect program (:mod:`.edge`).
Importing this package registers them (ExecuTorch is imported only when one runs)."""

from typing import Any

from hfexport.errors import ConfigError
from hfexport.passes import CLEANUP_PASSES
from hfexport.passes.quantize import Int4WeightsInt8Activations, Int8WeightsInt8Activations
from hfexport.pipeline.pass_manager import Pass
from hfexport.targets.executorch.passes import attention, delegation, portable_kernels  # noqa: F401
from hfexport.targets.executorch.passes.edge import DEFAULT_EDGE_PASSES

DEFAULT_PASSES: tuple[str, ...] = (
    *CLEANUP_PASSES,
    "stored_weights_as_float32",
    "complex_as_real",
    "grouped_mm_to_batched_mm",
    "whole_input_convolutions_as_linear",
    "dynamic_conv1d_as_conv2d",
    "attention_as_custom_sdpa",
    "grouped_query_attention",
    "attention_as_matmuls",
    "last_axis_mean_as_linear",
    "rotate_half_as_linear",
    "histc_to_comparisons",
    "sort_to_topk",
    "empty_like_to_zeros_like",
    "empty_of_symbolic_size_to_zeros",
    "explicit_contiguous_copies",
    "dead_code_elimination",
    *DEFAULT_EDGE_PASSES,
)
QUANTIZATION = {"8da4w": "int4_weights_int8_activations", "8da8w": "int8_weights_int8_activations"}
# the ONNX names select the same weight widths on ExecuTorch, so one --quantize works everywhere
ALIASES = {"int4": "8da4w", "int8": "8da8w"}


def quantization_pass(mode: str, group_size: int) -> Pass:
    """The pass of ``ExecutorchConfig(quantize=mode)``."""
    mode = ALIASES.get(mode, mode)
    if mode == "8da4w":
        return Int4WeightsInt8Activations(group_size=group_size)
    if mode == "8da8w":
        return Int8WeightsInt8Activations()
    raise ConfigError(f"unknown ExecuTorch quantize mode {mode!r}; valid: {', '.join([*QUANTIZATION, *ALIASES])}")


def pass_list(config: Any) -> list[Any]:
    """The passes of an ExecuTorch export: ``config.passes`` or :data:`DEFAULT_PASSES`, and the
    quantization pass ``quantize`` asks for."""
    passes = list(DEFAULT_PASSES) if config.passes is None else list(config.passes)
    if config.quantize:
        quantization = quantization_pass(config.quantize, config.quantize_group_size)
        if quantization.name not in {getattr(p, "name", p) for p in passes}:
            passes.append(quantization)
    return passes
