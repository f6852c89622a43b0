"""Weight quantization as passes.

On the captured program (stage ``fx_passes``, for ExecuTorch's XNNPACK delegate), torchao's
quantization primitives:

- ``int4_weights_int8_activations`` ("8da4w"): each linear layer's weight in symmetric 4-bit
  groups of ``group_size`` along the input axis (scales by HQQ, ``algorithm="hqq"``, or by
  round-to-nearest, ``"affine"``), its input quantized per token to int8 at run time (XNNPACK's
  4-bit kernels take symmetric groups only);
- ``int8_weights_int8_activations`` ("8da8w"): int8 weights per output channel, the same
  activations.

The 4-bit mode keeps the output projection and the MLP down projections at 8 bits
(:func:`output_and_down_linears`; ``int8_output=False`` quantizes them to 4 too), except an output
projection tied to the embedding: that one goes to 4 bits, its top logits recomputed from the
fp32 table the embedding keeps (:mod:`hfexport.passes.top_logits`; ``rescore_top=0`` keeps it at
8 bits). With
``minimums=True`` its 4-bit groups carry a float minimum each (:func:`minimum_groups`) and only the
output projection stays at 8 bits (or is rescored): SmolLM2's top-1 81% → 92%, but the extra
linears make a decode step 1.4× slower (8.8 against 6.3 ms), so it is not the default.

Both rewrite ``aten.linear`` into the torchao pattern XNNPACK delegates as one dynamically
quantized linear (``choose_qparams_affine`` → ``quantize_affine`` → ``dequantize_affine`` on the
input, ``dequantize_affine`` of the int8 weight constant), and drop the fp32 weights nothing else
uses (an embedding tied to the output projection keeps its fp32 table).

On the ONNX model (stage ``onnx_passes``), ONNX Runtime's own quantizers, after the onnxscript
optimizer has folded each linear layer's weight into one constant ``MatMul`` input:

- ``onnx_int4_weights``: 4-bit weights in blocks of ``group_size`` along the input axis, each
  with a scale and a float minimum (llama.cpp's Q4_1 form, :mod:`hfexport.passes.onnx_blocks`),
  as ``com.microsoft::MatMulNBits`` plus the minimums' term; the output projection in symmetric
  8-bit blocks (ONNX Runtime's ``MatMulNBitsQuantizer``), or, tied to the embedding, in symmetric
  4-bit blocks with its top logits recomputed from the fp32 table. With ``accuracy_level=4`` the kernel
  quantizes activations to int8 on the fly, ONNX Runtime's fast CPU path.
- ``onnx_int8_dynamic``: int8 weights and dynamically quantized int8 activations
  (``quantize_dynamic``: ``DynamicQuantizeLinear`` + ``MatMulInteger``).

All report ``quantized_weights`` (the linear layers changed) and the weight bytes before and after; the
numerics instrument checks a program after a pass that reports ``quantized_weights`` by logit
cosine similarity and top-1 agreement instead of max abs difference (see
:class:`~hfexport.pipeline.instruments.NumericsInstrument`).
"""

from __future__ import annotations

import operator
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hfexport.errors import ConfigError
from hfexport.passes.top_logits import TOP, rescore_fx
from hfexport.pipeline.graph_edit import GraphEditor, add_constant, redirect_users, remove_unused_parameter
from hfexport.pipeline.instruments import QUANTIZED_WEIGHTS
from hfexport.pipeline.pass_manager import Pass, PassResult, register_pass
from hfexport.versions import TORCHAO_LOGGERS, quiet_loggers

ONNX_QUANTIZATION = {"int4": "onnx_int4_weights", "int8": "onnx_int8_dynamic"}
EXECUTORCH_QUANTIZATION = {"8da4w": "int4_weights_int8_activations", "8da8w": "int8_weights_int8_activations"}
# the ONNX names select the same weight widths on ExecuTorch, so one --quantize works everywhere
EXECUTORCH_ALIASES = {"int4": "8da4w", "int8": "8da8w"}


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _top(rescore_top: int) -> int:
    if not isinstance(rescore_top, int) or rescore_top < 0:
        raise ConfigError(f"rescore_top must be a whole number of logits to recompute (0: none), got {rescore_top!r}")
    return rescore_top


class _DynamicallyQuantizedLinears(Pass):
    """``aten.linear`` with a parameter weight → torchao's dynamically quantized linear pattern."""

    stage = "fx_passes"
    weight_dtype: torch.dtype = torch.int8
    weight_bits = 8
    rescore_top = 0

    def __init__(self, group_size: int | None = None, algorithm: str = "affine") -> None:
        if group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
            raise ConfigError(f"quantization group_size must be a power of two of at least 16, got {group_size}")
        if algorithm not in ("affine", "hqq"):
            raise ConfigError(f"quantization algorithm must be 'affine' or 'hqq', got {algorithm!r}")
        self.group_size = group_size
        self.algorithm = algorithm

    def _quantized(
        self, weight: torch.Tensor, dtype: torch.dtype, group_size: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        from torchao.quantization import IntxUnpackedToInt8Tensor
        from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
            IntxChooseQParamsAlgorithm,
        )

        block = [1, group_size or weight.shape[1]]
        algorithm = {"affine": IntxChooseQParamsAlgorithm.AFFINE, "hqq": IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY}
        with torch.no_grad():
            q = IntxUnpackedToInt8Tensor.from_hp(
                weight.detach().float(), block, dtype, intx_choose_qparams_algorithm=algorithm[self.algorithm]
            )
        return q.qdata, q.scale, q.zero_point, block, None

    def _kept_at_int8(self, linears: list[tuple[Any, torch.Tensor]]) -> set[str]:
        """The weights a 4-bit pass keeps at int8 per channel (none here; see
        :class:`Int4WeightsInt8Activations`)."""
        return set()

    def _rescored(self, linears: list[tuple[Any, torch.Tensor]]) -> set[str]:
        """The output projections whose top logits are recomputed from their fp32 weight
        (:mod:`hfexport.passes.top_logits`): with ``rescore_top``, those tied to an embedding,
        which keeps the fp32 table anyway."""
        if not self.rescore_top:
            return set()
        heads = output_linears(linears)
        embedding = torch.ops.aten.embedding.default
        return {
            node.args[1].name
            for node, _ in linears
            if node.args[1].name in heads and any(user.target is embedding for user in node.args[1].users)
        }

    def __call__(self, program: Any) -> PassResult:
        with quiet_loggers(*TORCHAO_LOGGERS):
            return self._rewrite(program)

    def _rewrite(self, program: Any) -> PassResult:
        from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

        ops = torch.ops.torchao
        parameters = program.graph_signature.inputs_to_parameters
        quantized: dict[str, tuple[Any, ...]] = {}  # weight placeholder → (qdata, scale, zero point, block)
        uses: dict[str, int] = {}
        before = _tensor_bytes(program.state_dict.values())
        stored = 0  # the quantized weights' bytes as the delegate stores them (4-bit values packed)
        count = 0
        linears = []
        block_sums: dict[Any, Any] = {}  # linear input → its sums over each weight block
        for node in program.graph.nodes:
            if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
                continue
            weight = node.args[1]
            if not (isinstance(weight, torch.fx.Node) and weight.name in parameters):
                continue
            value = program.state_dict[parameters[weight.name]]
            if value.dim() != 2 or not value.is_floating_point():
                continue
            if self.group_size and value.shape[1] % self.group_size:
                continue
            linears.append((node, value))
        rescored = self._rescored(linears)
        kept = self._kept_at_int8(linears) - rescored
        for node, value in linears:
            x, weight = node.args[0], node.args[1]
            dtype, group_size = (torch.int8, None) if weight.name in kept else (self.weight_dtype, self.group_size)
            if weight.name not in quantized:
                quantized[weight.name] = self._quantized(value, dtype, group_size)
            *tensors, block, minimums = quantized[weight.name]
            qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[dtype]
            bits = 8 if dtype == torch.int8 else self.weight_bits
            stored += tensors[0].numel() * bits // 8 + _tensor_bytes(tensors[1:])
            # "<weight>_qdata", not "<weight>.qdata": a tied weight stays (the embedding reads it),
            # and unlifting would read a dotted name as an attribute of that tensor. One set of
            # constants per linear layer, even for a weight several layers share: ExecuTorch fails
            # to unlift a delegate whose constant another delegate also holds ("... is not a buffer")
            use = uses[weight.name] = uses.get(weight.name, -1) + 1
            suffix = f"_{use}" if use else ""
            target = parameters[weight.name]
            qdata, scale, zero_point = (
                add_constant(program, f"{target}_{part}{suffix}", t)
                for part, t in zip(("qdata", "scale", "zero_point"), tensors, strict=True)
            )
            edit = GraphEditor(program.graph, node)
            rank = x.meta["val"].dim()
            token_block = [1] * (rank - 1) + [value.shape[1]]
            qparams = edit.call(
                ops.choose_qparams_affine.default,
                x,
                "ASYMMETRIC",
                token_block,
                torch.int8,
                -128,
                127,
                None,
                None,
                torch.int8,
            )
            x_scale = edit.call(operator.getitem, qparams, 0)
            x_zero = edit.call(operator.getitem, qparams, 1)
            x_q = edit.call(ops.quantize_affine.default, x, token_block, x_scale, x_zero, torch.int8, -128, 127)
            x_dq = edit.call(ops.dequantize_affine.default, x_q, token_block, x_scale, x_zero, torch.int8, -128, 127)
            w_dq = edit.call(ops.dequantize_affine.default, qdata, block, scale, zero_point, torch.int8, qmin, qmax)
            node.args = (x_dq, w_dq, *node.args[2:])
            result = node
            if minimums is not None:
                sums = block_sums.get(x)
                if sums is None:
                    ones = _block_ones(value.shape[1], block[1])
                    ones_node = add_constant(program, f"{target}_block_ones{suffix}", ones)
                    sums = block_sums[x] = edit.call(torch.ops.aten.linear.default, x, ones_node)
                minimums_node = add_constant(program, f"{target}_minimums{suffix}", minimums)
                offset = edit.call(torch.ops.aten.linear.default, sums, minimums_node)
                result = _add_after(program, node, offset)
            if weight.name in rescored:
                rescore_fx(program, result, x, weight, self.rescore_top)
            count += 1
        for name in quantized:
            remove_unused_parameter(program, next(n for n in program.graph.nodes if n.name == name))
        program.graph.lint()
        program.graph_module.recompile()
        after = _tensor_bytes(program.state_dict.values()) + stored
        counts = {
            QUANTIZED_WEIGHTS: len(quantized),
            "quantized_linears": count,
            **({"int8_weights_kept": len(kept)} if self.weight_bits < 8 else {}),
            **({"rescored_outputs": len(rescored)} if rescored else {}),
            "weight_kib_before": round(before / 2**10),
            "weight_kib_after": round(after / 2**10),
        }
        return PassResult(program, modified=count > 0, counts=counts)


def _block_ones(width: int, block_size: int) -> torch.Tensor:
    """[blocks, width], ones over each block: ``linear(x, ones)`` sums ``x`` over each block."""
    return (torch.arange(width)[None, :] // block_size == torch.arange(width // block_size)[:, None]).float()


def _add_after(program: Any, node: Any, offset: Any) -> Any:
    """``node + offset`` in place of ``node`` for all its users (a program output too)."""
    users = set(node.users)
    total = GraphEditor(program.graph, node.next).call(torch.ops.aten.add.Tensor, node, offset)
    redirect_users(program, node, total, users)
    return total


def minimum_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] → (int8 values in -8..7, scale [N, groups], minimums [N, groups]) with
    ``weight ≈ scale * values + minimums`` per group of ``group_size`` inputs: 4-bit groups with a
    float minimum (llama.cpp's Q4_1; see :mod:`hfexport.passes.onnx_blocks`), written as the
    symmetric groups XNNPACK takes plus a per-group offset, ``minimum + 8 * scale``."""
    groups = weight.detach().double().reshape(weight.shape[0], -1, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = (high - low) / 15
    scale[scale == 0] = 1.0
    q = torch.clamp(torch.round((groups - low[..., None]) / scale[..., None]), 0, 15)
    values = (q - 8).to(torch.int8).reshape(weight.shape)
    return values, scale.float(), (low + 8 * scale).float()


def output_linears(linears: list[tuple[Any, torch.Tensor]]) -> set[str]:
    """The weight placeholders of the linears a 4-bit mode keeps at 8 bits: the output projection
    (a linear whose result is a program output: the logits), as llama.cpp keeps its output weights
    wider. SmolLM2-135M-Instruct, 4-bit groups of 32 with float minimums, teacher-forced top-1
    agreement with fp32 over 64 positions (torchao's reference kernels): 95% with the output
    projection at 8 bits, 89% with the MLP down projections at 8 bits too (per channel, which
    holds the checkpoint's Q4_1 groups less exactly than 4 bits with minimums do)."""
    return {node.args[1].name for node, _ in linears if any(user.op == "output" for user in node.users)}


def output_and_down_linears(linears: list[tuple[Any, torch.Tensor]]) -> set[str]:
    """:func:`output_linears` and the linears with the widest input (the MLP down projections),
    as llama.cpp's Q4_K_M keeps its feed-forward-down weights wider: what 8da4w keeps at 8 bits
    without float minimums. SmolLM2-135M, symmetric groups of 32 (fake-quantized, four chat
    prompts): top-1 74% all 4-bit, 76% with the output projection at 8, 82% with the down
    projections too."""
    if not linears:
        return set()
    widest = max(value.shape[1] for _, value in linears)
    narrowest = min(value.shape[1] for _, value in linears)
    down = {node.args[1].name for node, value in linears if widest > narrowest and value.shape[1] == widest}
    return output_linears(linears) | down


class Int4WeightsInt8Activations(_DynamicallyQuantizedLinears):
    """8da4w: 4-bit weight groups and int8 per-token activations (torchao, XNNPACK)."""

    name = "int4_weights_int8_activations"
    description = "linear weights to symmetric 4-bit groups of group_size, inputs to int8 per token at run time (8da4w)"
    weight_dtype = torch.int4
    weight_bits = 4

    def __init__(
        self,
        group_size: int = 32,
        algorithm: str = "hqq",
        int8_output: bool = True,
        minimums: bool = False,
        rescore_top: int = TOP,
    ) -> None:
        # HQQ's scales measured better than round-to-nearest on SmolLM2-135M (mean logit cosine
        # 0.85 against 0.81 over 64 teacher-forced positions, the same top-1 agreement)
        if group_size % 32:
            # executorch/backends/xnnpack/operators/node_visitor.py asserts it at delegation
            raise ConfigError(f"XNNPACK's 4-bit kernels take groups of a multiple of 32, got group_size {group_size}")
        super().__init__(group_size, algorithm)
        self.int8_output = int8_output
        self.minimums = minimums
        self.rescore_top = _top(rescore_top)

    def _quantized(
        self, weight: torch.Tensor, dtype: torch.dtype, group_size: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
        """With ``minimums``, 4-bit groups with a float minimum each
        (:func:`minimum_groups`; ``algorithm`` then chooses nothing)."""
        if not self.minimums or dtype != self.weight_dtype or group_size is None:
            return super()._quantized(weight, dtype, group_size)
        values, scale, minimums = minimum_groups(weight, group_size)
        return values, scale, torch.zeros_like(scale, dtype=torch.int8), [1, group_size], minimums

    def _kept_at_int8(self, linears: list[tuple[Any, torch.Tensor]]) -> set[str]:
        """With ``int8_output`` (the default), the output projection stays int8 per channel (unless
        it is rescored), and without ``minimums`` the MLP down projections too: see
        :func:`output_and_down_linears`."""
        if not self.int8_output:
            return set()
        return output_linears(linears) if self.minimums else output_and_down_linears(linears)


class Int8WeightsInt8Activations(_DynamicallyQuantizedLinears):
    """8da8w: int8 per-channel weights and int8 per-token activations (torchao, XNNPACK)."""

    name = "int8_weights_int8_activations"
    description = "linear weights to int8 per output channel, inputs to int8 per token at run time (8da8w)"

    def __init__(self, algorithm: str = "affine") -> None:
        super().__init__(None, algorithm)


# onnxruntime.quantization.matmul_nbits_quantizer calls logging.basicConfig(level=INFO) at import,
# which would print every quantizer and user INFO line from then on, and the quantizers log their
# progress and advice (pre-processing for static quantization) on the root logger: each runs
# under quiet_loggers()


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


def _before(model: Any) -> dict[str, int]:
    """The figures of a model about to be quantized that :func:`_counts` reports beside its own."""
    return {
        "matmuls_before": sum(1 for node in model.graph.node if node.op_type == "MatMul"),
        "weight_kib_before": round(_weight_kib(model)),
    }


def _counts(before: dict[str, int], after: Any, op_types: tuple[str, ...]) -> dict[str, int]:
    quantized = sum(1 for node in after.graph.node if node.op_type in op_types)
    return {QUANTIZED_WEIGHTS: quantized, **before, "weight_kib_after": round(_weight_kib(after))}


class OnnxInt4Weights(Pass):
    """MatMul weights to 4-bit blocks with a scale and a float minimum each (ONNX Runtime
    ``MatMulNBits`` plus the minimums: :mod:`hfexport.passes.onnx_blocks`). An output projection
    tied to the embedding table goes to symmetric 4-bit blocks with its ``rescore_top`` highest
    logits recomputed from the fp32 table (:mod:`hfexport.passes.top_logits`); any other stays in
    symmetric 8-bit blocks.

    With ``accuracy_level=4`` each ``MatMulNBits`` quantizes its input to int8 per block on the
    fly, except two kinds of 4-bit linear layers, which keep their input in fp32
    (``accuracy_level=1``):

    - the last ``float_tail`` of them in graph order (those nearest the logits): the error an int8
      input puts there reaches the logits undamped (llama.cpp's Q4_K_M likewise gives the last
      eighth of the layers more bits, its ``use_more_bits``);
    - with ``float_attention``, the attention modules' own projections (q, k, v, o: the linear
      layers torch.onnx records inside a class named ``…Attention``). Their inputs, the normed
      hidden states and the attention output, were where int8 inputs did the most harm.

    SmolLM2-135M-Instruct (a Q4_1 checkpoint, which these blocks hold exactly), teacher-forced
    top-1 agreement with fp32 over the 64 positions after "What is the capital of France?": 95.3%
    with the last eighth fp32, 100% with the attention projections too. Its first token, a
    0.08-logit near-tie in fp32 ("The" over "L"), went to "L" with only the tail (and with half the
    layers fp32), so the answer was "L'Étoile, la Cité, …"; with the attention projections the
    margin is 0.13 and the answer "The capital of France is Paris." A step costs 4% more (6.61
    against 6.86 ms in turns, fp32 17.78 ms). All fp32 inputs give the fp32 logits to 1e-3, at
    about 1.35× the step.

    ``minimums=False`` takes ONNX Runtime's own asymmetric blocks instead (an integer zero point:
    one node per weight, less exact); ``int8_output=False`` puts an output projection that is not
    rescored in 4 bits too; ``rescore_top=0`` rescores none (a tied output projection stays at 8 bits);
    ``float_attention=False`` gives the attention projections int8 inputs too."""

    name = "onnx_int4_weights"
    description = "MatMul weights to 4-bit blocks of group_size (ONNX Runtime MatMulNBits); activations int8 on the fly"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __init__(
        self,
        group_size: int = 32,
        accuracy_level: int = 4,
        minimums: bool = True,
        int8_output: bool = True,
        rescore_top: int = TOP,
        float_tail: float = 1 / 8,
        float_attention: bool = True,
    ) -> None:
        if group_size < 16 or group_size & (group_size - 1):
            raise ConfigError(f"int4 group_size must be a power of two of at least 16, got {group_size}")
        if not 0 <= float_tail <= 1:
            raise ConfigError(f"float_tail must be a fraction of the linear layers from 0 to 1, got {float_tail!r}")
        self.float_tail = float_tail
        self.float_attention = float_attention
        self.group_size = group_size
        self.accuracy_level = accuracy_level
        self.minimums = minimums
        self.int8_output = int8_output
        self.rescore_top = _top(rescore_top)

    def __call__(self, program: Any) -> PassResult:
        from hfexport.passes.onnx_blocks import rewrite_with_minimum_blocks
        from hfexport.passes.top_logits import rescore_onnx

        model = _proto(program)
        before = _before(model)
        untied = _untie_transposed_weights(model)
        matmuls = _weight_matmuls(model)
        attention = _attention_projections(model, set(matmuls)) if self.float_attention else set()
        outputs = _output_matmuls(model, matmuls)
        heads = {node.name: node.output[0] for node in model.graph.node if node.name in outputs}
        # an output projection tied to an embedding table the model keeps in fp32 goes to 4 bits,
        # its top logits recomputed from the table (hfexport.passes.top_logits)
        rescored = _embedding_tables(model, set(heads)) if self.rescore_top else {}
        kept = set(heads) - set(rescored) if self.int8_output else set()
        # symmetric 8 bits for the output projection: a tied table from a GGUF file is Q8_0, which
        # symmetric blocks hold exactly; SmolLM2 int4, teacher-forced top-1: 87% asymmetric, 95% symmetric
        if kept:
            model = self._ort_blocks(model, 8, True, set(matmuls) - kept)
        if rescored:
            model = self._ort_blocks(model, 4, True, set(matmuls) - set(rescored))
        rest = set(matmuls) - kept - set(rescored)
        floats = set()
        if self.accuracy_level != 1:
            floats = _last_in_graph_order(model, rest, self.float_tail) | (attention & rest)
        if self.minimums:
            packed = rewrite_with_minimum_blocks(model, rest, self.group_size, self.accuracy_level, frozenset(floats))
        elif rest:
            model = self._ort_blocks(model, 4, False, kept | set(rescored) | floats)
            if floats:
                model = self._ort_blocks(model, 4, False, set(matmuls) - floats, accuracy_level=1)
        for name, table in rescored.items():
            head = next(node for node in model.graph.node if heads[name] in node.output)
            rescore_onnx(model, head, table, self.rescore_top)
        counts = _counts(before, model, ("MatMulNBits",))
        if self.minimums:  # weights packed side by side share a MatMulNBits node: count the weights
            counts["matmulnbits_nodes"] = counts[QUANTIZED_WEIGHTS]
            counts[QUANTIZED_WEIGHTS] = packed + len(kept) + len(rescored)
        if self.int8_output:
            counts["int8_weights_kept"] = len(kept)
        if floats:
            counts["float_input_weights"] = len(floats)
        if rescored:
            counts["rescored_outputs"] = len(rescored)
        if untied:
            counts["untied_weights"] = untied
        return PassResult(_program(model, program), modified=counts[QUANTIZED_WEIGHTS] > 0, counts=counts)

    def _ort_blocks(
        self, model: Any, bits: int, symmetric: bool, excluded: set[str], accuracy_level: int | None = None
    ) -> Any:
        with quiet_loggers():
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            model,
            bits=bits,
            block_size=self.group_size,
            is_symmetric=symmetric,
            accuracy_level=accuracy_level or self.accuracy_level,
            nodes_to_exclude=sorted(excluded),
        )
        with quiet_loggers():
            quantizer.process()
        return quantizer.model.model


def _last_in_graph_order(model: Any, names: set[str], fraction: float) -> set[str]:
    """The last ``fraction`` (rounded down) of the top graph's nodes named in ``names``, in graph
    order: a packed group (q, k, v) counts whole once any of it is in."""
    order = [node.name for node in model.graph.node if node.name in names]
    count = int(len(order) * fraction)
    return set(order[len(order) - count :]) if count else set()


def _attention_projections(model: Any, names: set[str]) -> set[str]:
    """The top graph's nodes named in ``names`` that torch.onnx recorded inside an attention module:
    a class whose name ends in ``Attention`` in the node's ``pkg.torch.onnx.class_hierarchy``
    (``LlamaAttention``, ``GPT2Attention``, ``BertSelfAttention``, …)."""
    import ast

    found = set()
    for node in model.graph.node:
        if node.name not in names:
            continue
        recorded = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.class_hierarchy"), "[]")
        try:
            hierarchy = ast.literal_eval(recorded)
        except (ValueError, SyntaxError):
            continue
        if any(isinstance(cls, str) and cls.rsplit(".", 1)[-1].endswith("Attention") for cls in hierarchy):
            found.add(node.name)
    return found


def _untie_transposed_weights(model: Any) -> int:
    """Give each ``MatMul`` whose weight is ``Transpose(initializer)`` its own transposed
    initializer, and return how many. A tied output projection reads the embedding table that
    way (the optimizer does not fold a transposed copy of a constant that large), as does every
    linear layer when the optimizer is off, and the quantizers only take a ``MatMul`` whose weight
    is an initializer: SmolLM2's 113 MB output projection stayed fp32 in the 4-bit model."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    graph_outputs = {o.name for o in model.graph.output}
    untied = 0
    unused = []
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        perm = [list(a.ints) for a in transpose.attribute if a.name == "perm"]
        weight = numpy_helper.to_array(initializers[transpose.input[0]])
        if weight.ndim != 2 or (perm and perm[0] != [1, 0]):
            continue
        name = f"{transpose.input[0]}_transposed_{untied}"
        model.graph.initializer.append(numpy_helper.from_array(weight.T.copy(), name))
        readers[node.input[1]] -= 1
        node.input[1] = name
        untied += 1
        if readers[transpose.output[0]] == 0 and transpose.output[0] not in graph_outputs:
            unused.append(transpose)
    for transpose in unused:
        model.graph.node.remove(transpose)
    return untied


def _embedding_tables(model: Any, names: set[str]) -> dict[str, str]:
    """``{MatMul name: table}`` for the MatMuls in ``names`` whose constant weight [K, N] is the
    transpose of a table [N, K] a ``Gather`` reads (an output projection tied to the embedding)."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in model.graph.initializer}
    tables = {node.input[0] for node in model.graph.node if node.op_type == "Gather" and node.input[0] in initializers}
    found = {}
    for node in model.graph.node:
        if node.name not in names or node.input[1] not in initializers:
            continue
        weight = initializers[node.input[1]]
        for table in sorted(tables):
            if list(initializers[table].dims) != list(weight.dims)[::-1]:
                continue
            if np.array_equal(numpy_helper.to_array(initializers[table]).T, numpy_helper.to_array(weight)):
                found[node.name] = table
                break
    return found


def _weight_matmuls(model: Any) -> dict[str, list[int]]:
    """``{node name: weight shape [in, out]}`` of the top graph's MatMuls with a constant weight."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    return {
        node.name: shapes[node.input[1]]
        for node in model.graph.node
        if node.op_type == "MatMul" and len(node.input) == 2 and len(shapes.get(node.input[1], ())) == 2
    }


def _output_matmuls(model: Any, matmuls: dict[str, list[int]]) -> set[str]:
    """The weight MatMuls producing a graph output (the logits: the output projection)."""
    outputs = {o.name for o in model.graph.output}
    return {node.name for node in model.graph.node if node.name in matmuls and node.output[0] in outputs}


class OnnxInt8Dynamic(Pass):
    """int8 MatMul weights and dynamically quantized int8 activations (ONNX Runtime quantize_dynamic)."""

    name = "onnx_int8_dynamic"
    description = "int8 MatMul weights, activations quantized to int8 at run time (ONNX Runtime quantize_dynamic)"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __call__(self, program: Any) -> PassResult:
        import onnx

        with quiet_loggers():
            from onnxruntime.quantization import QuantType, quantize_dynamic

        model = _proto(program)
        before = _before(model)
        untied = _untie_transposed_weights(model)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "quantized.onnx"
            with quiet_loggers():
                # per-tensor weights: per_channel=True measured worse on SmolLM2 (logit cosine 0.75 vs 0.96)
                quantize_dynamic(model, path, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
            after = onnx.load(path)
        counts = _counts(before, after, ("MatMulInteger", "DynamicQuantizeMatMul"))
        if untied:
            counts["untied_weights"] = untied
        return PassResult(_program(after, program), modified=counts[QUANTIZED_WEIGHTS] > 0, counts=counts)


register_pass(Int4WeightsInt8Activations)
register_pass(Int8WeightsInt8Activations)
register_pass(OnnxInt4Weights)
register_pass(OnnxInt8Dynamic)


def onnx_quantization_pass(mode: str, group_size: int) -> Pass:
    """The pass of ``OnnxConfig(quantize=mode)``."""
    if mode == "int4":
        return OnnxInt4Weights(group_size=group_size)
    if mode == "int8":
        return OnnxInt8Dynamic()
    raise ConfigError(f"unknown ONNX quantize mode {mode!r}; valid: {', '.join(ONNX_QUANTIZATION)}")


def executorch_quantization_pass(mode: str, group_size: int) -> Pass:
    """The pass of ``ExecutorchConfig(quantize=mode)``."""
    mode = EXECUTORCH_ALIASES.get(mode, mode)
    if mode == "8da4w":
        return Int4WeightsInt8Activations(group_size=group_size)
    if mode == "8da8w":
        return Int8WeightsInt8Activations()
    valid = ", ".join([*EXECUTORCH_QUANTIZATION, *EXECUTORCH_ALIASES])
    raise ConfigError(f"unknown ExecuTorch quantize mode {mode!r}; valid: {valid}")
