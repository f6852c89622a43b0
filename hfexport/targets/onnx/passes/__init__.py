"""The ONNX target's passes and its default pass list. ``fx_passes`` rewrite the captured program
into forms ONNX Runtime runs fast; ``onnx_passes`` (:mod:`.graph`, :mod:`.attention`,
:mod:`.quantize`) rewrite the ONNX model after ``torch.onnx`` translated it. Importing this package
registers them (no ONNX package is imported until one runs)."""

from typing import Any

from hfexport.passes import CLEANUP_PASSES
from hfexport.targets.onnx.passes import attention, graph, quantize  # noqa: F401

DEFAULT_PASSES: tuple[str, ...] = (
    *CLEANUP_PASSES,
    "complex_as_real",
    "cache_writes_as_scatter",
    "grouped_mm_to_batched_mm",
    "whole_input_convolutions_as_linear",
    "grouped_query_attention",
    "attention_as_matmuls",
    "explicit_contiguous_copies",
    "zero_fully_masked_attention_rows",
    "dead_code_elimination",
    # onnx_passes
    "onnx_optimizer",
    "onnx_ort_fusions",
    "onnx_group_query_attention",
    "onnx_packed_projections",
    "onnx_packed_attention_inputs",
)
# what OnnxConfig(optimize=False) leaves out of the default list
OPTIMIZATIONS = (
    "onnx_optimizer",
    "onnx_ort_fusions",
    "onnx_group_query_attention",
    "onnx_packed_projections",
    "onnx_packed_attention_inputs",
)


def pass_list(config: Any) -> list[Any]:
    """The passes of an ONNX export: ``config.passes`` or :data:`DEFAULT_PASSES` (without the
    :data:`OPTIMIZATIONS` when ``optimize=False``), and the quantization pass ``quantize`` asks for."""
    passes = list(DEFAULT_PASSES) if config.passes is None else list(config.passes)
    if config.passes is None and not config.optimize:
        passes = [p for p in passes if p not in OPTIMIZATIONS]
    if config.quantize:
        quantization = quantize.onnx_quantization_pass(config.quantize, config.quantize_group_size)
        if quantization.name not in {getattr(p, "name", p) for p in passes}:
            passes.append(quantization)
    return passes
