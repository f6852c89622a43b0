"""Weight quantization as passes.

On the captured program (stage ``fx_passes``, for ExecuTorch's XNNPACK delegate), torchao's
quantization primitives:

- ``int4_weights_int8_activations`` ("8da4w"): each linear layer's weight in symmetric 4-bit
  groups of ``group_size`` along the input axis (scales by HQQ, ``algorithm="hqq"``, or by
  round-to-nearest, ``"affine"``), its input quantized per token to int8 at run time (XNNPACK's
  4-bit kernels take symmetric groups only);
- ``int8_weights_int8_activations`` ("8da8w"): int8 weights per output channel, the same
  activations.

The 4-bit mode keeps the output projection at 8 bits (:func:`output_linears`; ``int8_output=False``
quantizes it to 4 too), except an output
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

All report ``quantized_weights`` (the linear layers changed) and the weight bytes before and after; the
numerics instrument checks a program after a pass that reports ``quantized_weights`` by logit
cosine similarity and top-1 agreement instead of max abs difference (see
:class:`~hfexport.pipeline.numerics.NumericsCheck`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from hfexport.errors import ConfigError
from hfexport.passes.top_logits import TOP, rescore_fx
from hfexport.pipeline.graph_edit import GraphEditor, add_constant, redirect_users, remove_unused_parameter
from hfexport.pipeline.numerics import QUANTIZED_WEIGHTS
from hfexport.pipeline.pass_manager import Pass, PassResult, register_pass
from hfexport.versions import TORCHAO_LOGGERS, quiet_loggers

# the weight elements quantized at once (1 MiB of float32), a slice of rows that stays in cache:
# 8da4w of a 32768 x 2048 matrix took 2.9 s of CPU instead of 17.5 s, with the same values
QUANTIZE_CHUNK_ELEMENTS = 1 << 18


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def checked_rescore_top(rescore_top: int) -> int:
    """``rescore_top`` if it is a whole number of logits to recompute, else :class:`ConfigError`."""
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
        block = [1, group_size or weight.shape[1]]
        # a few rows at a time (each group is one row's): HQQ holds several float32 copies of what
        # it quantizes (for Llama-3.2-1B's tied 128256 x 2048 table, GBs over the export's peak)
        # and iterates up to 20 times over them, at memory speed unless they stay in cache
        rows = max(1, QUANTIZE_CHUNK_ELEMENTS // weight.shape[1])
        parts: tuple[torch.Tensor, ...] = ()
        with torch.no_grad():
            for start in range(0, weight.shape[0], rows):
                chunk = self._quantized_rows(weight[start : start + rows].detach().float(), block, dtype)
                if not parts:
                    parts = tuple(t.new_empty((weight.shape[0], *t.shape[1:])) for t in chunk)
                for whole, part in zip(parts, chunk, strict=True):
                    whole[start : start + rows] = part
        return *parts, block, None

    def _quantized_rows(
        self, rows: torch.Tensor, block: list[int], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, scales, zero points) of ``rows`` (float32) in groups of ``block``."""
        from torchao.quantization import IntxUnpackedToInt8Tensor
        from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS
        from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
            IntxChooseQParamsAlgorithm,
        )

        if self.algorithm == "hqq":
            values, scale = hqq_scale_only(rows, block[1], *_DTYPE_TO_QVALUE_BOUNDS[dtype])
            return values, scale, torch.zeros_like(scale, dtype=torch.int8)
        q = IntxUnpackedToInt8Tensor.from_hp(
            rows, block, dtype, intx_choose_qparams_algorithm=IntxChooseQParamsAlgorithm.AFFINE
        )
        return q.qdata, q.scale, q.zero_point

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
        before = tensor_bytes(program.state_dict.values())
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
            stored += tensors[0].numel() * bits // 8 + tensor_bytes(tensors[1:])
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
            # dequantized in the activations' dtype (torchao's default is float32): a float16
            # program's linear takes float16 on both sides
            act = x.meta["val"].dtype
            x_dq = edit.call(
                ops.dequantize_affine.default, x_q, token_block, x_scale, x_zero, torch.int8, -128, 127, act
            )
            w_dq = edit.call(
                ops.dequantize_affine.default, qdata, block, scale, zero_point, torch.int8, qmin, qmax, act
            )
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
        after = tensor_bytes(program.state_dict.values()) + stored
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


def hqq_scale_only(
    weight: torch.Tensor, group_size: int, qmin: int, qmax: int, iterations: int = 20, tolerance: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """HQQ's symmetric, scale-only quantization of ``weight`` [N, K] (float32) in groups of
    ``group_size`` along a row: (int8 values in ``qmin..qmax``, float32 scales [N, groups]), bit
    for bit what torchao's ``_choose_qparams_and_quantize_scale_only_hqq`` gives, in under a
    third of its time (a Llama-3.2-1B-shaped 8da4w export: 17.8 CPU seconds against 62.3).

    Both start from each group's largest magnitude over ``qmax`` and alternate rounding the
    group by its scale with solving for the scale that fits the rounded values best, until the
    largest relative change of any scale is under ``tolerance``, or ``iterations`` times. torchao
    goes over every group each time. A group whose scale came out exactly as it went in is at a
    fixed point (the next pass rounds the same quotients and solves for the same scale), and here
    it leaves the loop: on a random matrix of Llama-3.2-1B's MLP shape, half the groups stay after
    the second pass, 6% after the fifth, none after the fourteenth."""
    eps = torch.finfo(torch.float32).eps
    rows, columns = weight.shape
    groups = weight.to(torch.float32).reshape(-1, group_size)
    scale = (groups.abs().amax(dim=1) / (max(abs(qmin), abs(qmax)) or 1)).clamp_min(eps)
    moving = torch.arange(len(groups))  # the groups still iterating, their values and scales
    values, previous = groups, scale.clone()
    for _ in range(max(1, iterations)):
        rounded = (values / previous.unsqueeze(-1)).round_().clamp_(qmin, qmax)
        fit = (values * rounded).sum(dim=1, dtype=torch.float32)
        norm = (rounded * rounded).sum(dim=1, dtype=torch.float32)
        solved = torch.where(norm > 0, fit / norm, previous).clamp_min(eps).abs()
        scale[moving] = solved
        if ((solved - previous).abs() / previous.clamp_min(eps)).max() < tolerance:
            break
        still = (solved != previous).nonzero().squeeze(1)
        if not len(still):
            break
        moving, values, previous = moving[still], values[still], solved[still]
    quantized = (groups / scale.unsqueeze(-1)).round_().clamp_(qmin, qmax)
    return quantized.reshape(rows, columns).to(torch.int8), scale.reshape(rows, columns // group_size)


def minimum_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] → (int8 values in -8..7, scale [N, groups], minimums [N, groups]) with
    ``weight ≈ scale * values + minimums`` per group of ``group_size`` inputs: 4-bit groups with a
    float minimum (llama.cpp's Q4_1; see :mod:`hfexport.targets.onnx.passes.blocks`), written as the
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


class Int4WeightsInt8Activations(_DynamicallyQuantizedLinears):
    """8da4w: 4-bit weight groups and int8 per-token activations (torchao, XNNPACK)."""

    name = "int4_weights_int8_activations"
    remove_when = "Appended by quantize='8da4w' (or 'int4'); leave it out for fp32 weights."
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
        self.rescore_top = checked_rescore_top(rescore_top)

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
        it is rescored). The MLP down projections are 4-bit, as optimum-executorch's 8da4w has
        them: at int8 per channel (llama.cpp's Q4_K_M keeps them wider) SmolLM2-135M's teacher-forced
        top-1 was 81% against 78%, and its step 6% slower in ExecuTorch's runner
        (benchmarks/results/custom-sdpa-prefix/README.md), which left it behind optimum's."""
        return output_linears(linears) if self.int8_output else set()


class Int8WeightsInt8Activations(_DynamicallyQuantizedLinears):
    """8da8w: int8 per-channel weights and int8 per-token activations (torchao, XNNPACK)."""

    name = "int8_weights_int8_activations"
    remove_when = "Appended by quantize='8da8w' (or 'int8'); leave it out for fp32 weights."
    description = "linear weights to int8 per output channel, inputs to int8 per token at run time (8da8w)"

    def __init__(self, algorithm: str = "affine") -> None:
        super().__init__(None, algorithm)


# onnxruntime.quantization.matmul_nbits_quantizer calls logging.basicConfig(level=INFO) at import,
# which would print every quantizer and user INFO line from then on, and the quantizers log their
# progress and advice (pre-processing for static quantization) on the root logger: each runs
# under quiet_loggers()


register_pass(Int4WeightsInt8Activations)
register_pass(Int8WeightsInt8Activations)
