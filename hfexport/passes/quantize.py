"""Weight quantization as passes (stage ``onnx_passes``): ONNX Runtime's own quantizers over the
ONNX model, after the onnxscript optimizer has folded each linear layer's weight into one constant
``MatMul`` input.

- ``onnx_int4_weights``: 4-bit weights in blocks of ``group_size`` along the input axis, symmetric,
  as ``com.microsoft::MatMulNBits`` (ONNX Runtime's ``MatMulNBitsQuantizer``); with
  ``accuracy_level=4`` the kernel quantizes activations to int8 on the fly, ONNX Runtime's fast CPU
  path.
- ``onnx_int8_dynamic``: int8 weights and dynamically quantized int8 activations
  (``quantize_dynamic``: ``DynamicQuantizeLinear`` + ``MatMulInteger``).

Both report ``quantized_weights`` (the MatMuls changed) and the weight bytes before and after; the
numerics instrument checks a program after a pass that reports ``quantized_weights`` by logit
cosine similarity and top-1 agreement instead of max abs difference (see
:class:`~hfexport.pipeline.instruments.NumericsInstrument`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hfexport.errors import ConfigError
from hfexport.pipeline.instruments import QUANTIZED_WEIGHTS
from hfexport.pipeline.pass_manager import Pass, PassResult, register_pass

ONNX_QUANTIZATION = {"int4": "onnx_int4_weights", "int8": "onnx_int8_dynamic"}


@contextlib.contextmanager
def _root_logging_quiet() -> Iterator[None]:
    # onnxruntime.quantization.matmul_nbits_quantizer calls logging.basicConfig(level=INFO) at
    # import, which would print every quantizer and user INFO line from then on, and the quantizers
    # log their progress and advice (pre-processing for static quantization) on the root logger
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _proto(program: Any) -> Any:
    import onnx_ir as ir

    return ir.serde.serialize_model(program.model)


def _program(proto: Any, like: Any) -> Any:
    import onnx_ir as ir
    import torch

    return torch.onnx.ONNXProgram(ir.serde.deserialize_model(proto), like.exported_program)


def _weight_kib(proto: Any) -> float:
    from onnx import numpy_helper

    return sum(numpy_helper.to_array(t).nbytes for t in proto.graph.initializer) / 2**10


def _counts(before: Any, after: Any, op_types: tuple[str, ...]) -> dict[str, int]:
    quantized = sum(1 for node in after.graph.node if node.op_type in op_types)
    return {
        QUANTIZED_WEIGHTS: quantized,
        "matmuls_before": sum(1 for node in before.graph.node if node.op_type == "MatMul"),
        "weight_kib_before": round(_weight_kib(before)),
        "weight_kib_after": round(_weight_kib(after)),
    }


class OnnxInt4Weights(Pass):
    """MatMul weights to symmetric 4-bit blocks (ONNX Runtime MatMulNBits)."""

    name = "onnx_int4_weights"
    description = "MatMul weights to 4-bit blocks of group_size (ONNX Runtime MatMulNBits); activations int8 on the fly"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __init__(self, group_size: int = 32, accuracy_level: int = 4, symmetric: bool = False) -> None:
        if group_size < 16 or group_size & (group_size - 1):
            raise ConfigError(f"int4 group_size must be a power of two of at least 16, got {group_size}")
        self.group_size = group_size
        self.accuracy_level = accuracy_level
        self.symmetric = symmetric

    def __call__(self, program: Any) -> PassResult:
        with _root_logging_quiet():
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        before = _proto(program)
        quantizer = MatMulNBitsQuantizer(
            _proto(program),
            bits=4,
            block_size=self.group_size,
            is_symmetric=self.symmetric,
            accuracy_level=self.accuracy_level,
        )
        with _root_logging_quiet():
            quantizer.process()
        after = quantizer.model.model
        counts = _counts(before, after, ("MatMulNBits",))
        return PassResult(_program(after, program), modified=counts[QUANTIZED_WEIGHTS] > 0, counts=counts)


class OnnxInt8Dynamic(Pass):
    """int8 MatMul weights and dynamically quantized int8 activations (ONNX Runtime quantize_dynamic)."""

    name = "onnx_int8_dynamic"
    description = "int8 MatMul weights, activations quantized to int8 at run time (ONNX Runtime quantize_dynamic)"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __call__(self, program: Any) -> PassResult:
        import onnx

        with _root_logging_quiet():
            from onnxruntime.quantization import QuantType, quantize_dynamic

        before = _proto(program)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "quantized.onnx"
            with _root_logging_quiet():
                # per-tensor weights: per_channel=True measured worse on SmolLM2 (logit cosine 0.75 vs 0.96)
                quantize_dynamic(before, path, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
            after = onnx.load(path)
        counts = _counts(before, after, ("MatMulInteger", "DynamicQuantizeMatMul"))
        return PassResult(_program(after, program), modified=counts[QUANTIZED_WEIGHTS] > 0, counts=counts)


register_pass(OnnxInt4Weights)
register_pass(OnnxInt8Dynamic)


def onnx_quantization_pass(mode: str, group_size: int) -> Pass:
    """The pass of ``OnnxConfig(quantize=mode)``."""
    if mode == "int4":
        return OnnxInt4Weights(group_size=group_size)
    if mode == "int8":
        return OnnxInt8Dynamic()
    raise ConfigError(f"unknown ONNX quantize mode {mode!r}; valid: {', '.join(ONNX_QUANTIZATION)}")
