"""Weight quantization of the ONNX model (stage ``onnx_passes``): ONNX Runtime's own quantizers,
after the onnxscript optimizer has folded each linear layer's weight into one constant ``MatMul``
input.

- ``onnx_int4_weights``: 4-bit weights in asymmetric blocks of ``group_size`` along the input axis
  (ONNX Runtime's ``MatMulNBitsQuantizer``: a scale and an integer zero point per block), as
  ``com.microsoft::MatMulNBits`` with ``accuracy_level=4``: the kernel quantizes activations to int8
  on the fly, ONNX Runtime's fast CPU path. The output projection in symmetric 8-bit blocks, or, tied
  to the embedding, in symmetric 4-bit blocks with its top logits recomputed from the fp32 table.
  ``minimums=True`` gives llama.cpp's Q4_1 form instead (a float minimum per block,
  :mod:`hfexport.targets.onnx.passes.blocks`), exact for a Q4_1 checkpoint, and slower.
- ``onnx_int8_dynamic``: int8 weights and dynamically quantized int8 activations
  (``quantize_dynamic``: ``DynamicQuantizeLinear`` + ``MatMulInteger``).

Both report ``quantized_weights`` like the FX quantization passes (:mod:`hfexport.passes.quantize`).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hfexport.configs import ONNX_INT4_GROUP_SIZE
from hfexport.errors import ConfigError
from hfexport.passes.quantize import checked_rescore_top
from hfexport.passes.top_logits import TOP
from hfexport.pipeline.numerics import QUANTIZED_WEIGHTS
from hfexport.pipeline.pass_manager import Pass, PassResult, register_pass
from hfexport.targets.onnx.passes.domains import MS_DOMAIN
from hfexport.targets.onnx.passes.graph import take_over
from hfexport.versions import quiet_loggers

ONNX_QUANTIZATION = {"int4": "onnx_int4_weights", "int8": "onnx_int8_dynamic"}
Q8_0_BLOCK = 32  # GGUF's Q8_0 blocks: a tied table read from such a file is held exactly


def _proto(program: Any) -> Any:
    import onnx_ir as ir

    return ir.serde.serialize_model(program.model)


def _program(proto: Any, like: Any) -> Any:
    import onnx_ir as ir
    import torch

    return torch.onnx.ONNXProgram(ir.serde.deserialize_model(proto), like.exported_program)


def _weight_kib(graph: Any) -> float:
    """The top graph's initializers' size (an unread lazy one is not made for it)."""
    return sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None) / 2**10


def _before(graph: Any) -> dict[str, int]:
    """The figures of a model about to be quantized that :func:`_counts` reports beside its own."""
    return {
        "matmuls_before": sum(1 for node in graph if node.op_type == "MatMul" and node.domain == ""),
        "weight_kib_before": round(_weight_kib(graph)),
    }


def _counts(before: dict[str, int], after: Any, op_types: tuple[str, ...]) -> dict[str, int]:
    """``before`` and the quantized nodes and weight size of ``after`` (an onnx_ir graph)."""
    quantized = sum(1 for node in after if node.op_type in op_types)
    return {QUANTIZED_WEIGHTS: quantized, **before, "weight_kib_after": round(_weight_kib(after))}


class OnnxInt4Weights(Pass):
    """MatMul weights to asymmetric 4-bit blocks of ``group_size`` (64; ONNX Runtime's ``MatMulNBits``,
    integer zero points), their inputs quantized to int8 per block on the fly (``accuracy_level=4``). An output
    projection tied to the embedding table goes to symmetric 4-bit blocks with its ``rescore_top``
    highest logits recomputed from the fp32 table (:mod:`hfexport.passes.top_logits`); any other
    stays in symmetric 8-bit blocks. A layer's q, k and v weights are packed into one ``MatMul``
    before (``onnx_packed_projections``), so they share a node and quantize their input once.

    The defaults are close to ONNX Runtime GenAI's model builder's form (it takes symmetric blocks of
    32), which its runtime and users compare against. SmolLM2-135M-Instruct in ``og.Generator``, 64
    tokens (``benchmarks/results/runtime-loops/README.md``): 1.03× the builder's decode speed (blocks of
    32: 0.95×; the form below: 0.67× in an earlier run), teacher-forced top-1 against fp32 79.8% and KL
    0.289 over 600 tokens (the builder's folder 76.7%, 0.306), "The capital of France is Paris,
    France.". Three options trade speed for exactness:

    - ``minimums=True``: a float minimum per block (llama.cpp's Q4_1 form,
      :mod:`hfexport.targets.onnx.passes.blocks`) instead of an integer zero point, which rounds the
      minimum up to half a step off; a Q4_1 checkpoint (a GGUF file, like SmolLM2's) is then held
      exactly with ``group_size=32``, its blocks. It adds a ``MatMul`` of the input's block sums per weight.
    - ``float_attention=True``: the attention modules' own projections (q, k, v, o: the linear
      layers torch.onnx records inside a class named ``…Attention``) keep fp32 inputs
      (``accuracy_level=1``), where int8 inputs did the most harm.
    - ``float_tail``: the last fraction of the 4-bit layers in graph order (those nearest the
      logits) keep fp32 inputs (llama.cpp's Q4_K_M likewise gives the last layers more bits).

    All three (``minimums=True, float_attention=True, float_tail=1/8``, the default until
    2026-12-06) gave SmolLM2 96.9% top-1 (fp32's own prefill against its decode: 96.9%) at 1.5× the
    step (``benchmarks/results/onnx-int4-fast/README.md``).
    ``int8_output=False`` puts an output projection that is not rescored in 4 bits too;
    ``rescore_top=0`` rescores none (a tied output projection stays at 8 bits)."""

    name = "onnx_int4_weights"
    remove_when = "Appended by quantize='int4'; leave it out for fp32 weights."
    description = "MatMul weights to 4-bit blocks of group_size (ONNX Runtime MatMulNBits); inputs int8 on the fly"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __init__(
        self,
        group_size: int = ONNX_INT4_GROUP_SIZE,
        accuracy_level: int = 4,
        minimums: bool = False,
        int8_output: bool = True,
        rescore_top: int = TOP,
        float_tail: float = 0.0,
        float_attention: bool = False,
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
        self.rescore_top = checked_rescore_top(rescore_top)

    def __call__(self, program: Any) -> PassResult:
        """Quantize on the onnx_ir model, one weight at a time: the fp32 weights are read where they
        are (the captured program's tensors, or made when read), never copied as a whole model."""
        import onnx_ir.passes.common as common

        graph = program.model.graph
        before = _before(graph)
        untied = _untie_transposed_weights(graph)
        matmuls = _weight_matmuls(graph)
        attention = _attention_projections(matmuls) if self.float_attention else set()
        outputs = {name for name, node in matmuls.items() if node.outputs[0] in graph.outputs}
        # an output projection tied to an embedding table the model keeps in fp32 goes to 4 bits,
        # its top logits recomputed from the table (hfexport.passes.top_logits)
        heads = {name: matmuls[name] for name in outputs}
        rescored = _embedding_tables(graph, heads, untied) if self.rescore_top else {}
        kept = outputs - set(rescored) if self.int8_output else set()
        rest = set(matmuls) - kept - set(rescored)
        floats = set()
        if self.accuracy_level != 1:
            floats = _last_in_graph_order(graph, rest, self.float_tail) | (attention & rest)
        # symmetric 8 bits for the output projection: a tied table from a GGUF file is Q8_0, which
        # symmetric blocks hold exactly; SmolLM2 int4, teacher-forced top-1: 87% asymmetric, 95% symmetric
        replaced = {name: self._blocks(graph, matmuls[name], 8, True) for name in kept}
        replaced |= {name: self._blocks(graph, matmuls[name], 4, True) for name in rescored}
        packed = 0
        if self.minimums and rest:
            from hfexport.targets.onnx.passes.blocks import rewrite_with_minimum_blocks

            # the float minimums' rewrite works on the protobuf model: a copy of the weights, this option's cost
            model = _proto(program)
            packed = rewrite_with_minimum_blocks(model, rest, self.group_size, self.accuracy_level, frozenset(floats))
            program = _program(model, program)
            graph = program.model.graph
        else:
            for name in sorted(rest):
                level = 1 if name in floats else self.accuracy_level
                self._blocks(graph, matmuls[name], 4, False, level)
        for name, table in rescored.items():
            head = next(node for node in graph if node.name == replaced[name])
            rescore_onnx(graph, head, graph.initializers[table], self.rescore_top)
        common.RemoveUnusedNodesPass()(program.model)
        counts = _counts(before, graph, ("MatMulNBits",))
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
            counts["untied_weights"] = len(untied)
        return PassResult(program, modified=counts[QUANTIZED_WEIGHTS] > 0, counts=counts)

    def _blocks(self, graph: Any, node: Any, bits: int, symmetric: bool, accuracy_level: int | None = None) -> str:
        """Replace ``node`` (a MatMul with a constant [K, N] weight) by a ``MatMulNBits`` of its weight
        in blocks of ``group_size``, 8 bits in GGUF Q8_0's 32 (ONNX Runtime's quantizer: a scale per
        block, and an integer zero point unless ``symmetric``); the new node's name."""
        import onnx_ir as ir

        with quiet_loggers():
            from onnxruntime.quantization.matmul_nbits_quantizer import (
                DefaultWeightOnlyQuantConfig,
                DefaultWeightOnlyQuantizer,
            )

        level = accuracy_level or self.accuracy_level
        block = Q8_0_BLOCK if bits == 8 else self.group_size
        config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, accuracy_level=level, bits=bits)
        weight = node.inputs[1]
        array = np.ascontiguousarray(weight.const_value.numpy())  # the kernel reads it row-major
        kind = array.dtype
        if kind not in (np.float32, np.float16):  # bfloat16: blocks made in float32, scales back in it
            array = array.astype(np.float32)
        blocks, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(array)
        base = weight.name
        inputs = [node.inputs[0], _initializer(graph, f"{base}_Q{bits}", blocks)]
        inputs.append(_initializer(graph, f"{base}_scales", scales.astype(kind)))
        if not symmetric:
            inputs.append(_initializer(graph, f"{base}_zero_points", zero_points))
        k, n = array.shape
        attributes = {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": level}
        quantized = ir.node("MatMulNBits", inputs, attributes=attributes, domain=MS_DOMAIN, name=f"{node.name}_Q{bits}")
        quantized.metadata_props.update(node.metadata_props)
        graph.insert_before(node, quantized)
        take_over(node.outputs[0], quantized.outputs[0])
        graph.remove(node, safe=True)
        graph.opset_imports.setdefault(MS_DOMAIN, 1)
        return quantized.name


def _initializer(graph: Any, name: str, array: np.ndarray) -> Any:
    import onnx_ir as ir

    value = ir.val(name, const_value=ir.tensor(array))
    graph.register_initializer(value)
    return value


def _last_in_graph_order(graph: Any, names: set[str], fraction: float) -> set[str]:
    """The last ``fraction`` (rounded down) of the top graph's nodes named in ``names``, in graph order."""
    order = [node.name for node in graph if node.name in names]
    count = int(len(order) * fraction)
    return set(order[len(order) - count :]) if count else set()


def _attention_projections(matmuls: dict[str, Any]) -> set[str]:
    """The names of the nodes in ``matmuls`` that torch.onnx recorded inside an attention module:
    a class whose name ends in ``Attention`` in the node's ``pkg.torch.onnx.class_hierarchy``
    (``LlamaAttention``, ``GPT2Attention``, ``BertSelfAttention``, …)."""
    import ast

    found = set()
    for name, node in matmuls.items():
        recorded = node.metadata_props.get("pkg.torch.onnx.class_hierarchy", "[]")
        try:
            hierarchy = ast.literal_eval(recorded)
        except (ValueError, SyntaxError):
            continue
        if any(isinstance(cls, str) and cls.rsplit(".", 1)[-1].endswith("Attention") for cls in hierarchy):
            found.add(name)
    return found


def _untie_transposed_weights(graph: Any) -> dict[str, str]:
    """Give each ``MatMul`` whose weight is ``Transpose(initializer)`` its own transposed
    initializer (made when read); ``{its name: the initializer it is the transpose of}``. A tied
    output projection reads the embedding table that way (the optimizer does not fold a transposed
    copy of a constant that large), as does every linear layer when the optimizer is off, and the
    quantizers only take a ``MatMul`` whose weight is an initializer: SmolLM2's 113 MB output
    projection stayed fp32 in the 4-bit model."""
    import onnx_ir as ir

    initializers = set(graph.initializers.values())
    untied: dict[str, str] = {}
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2 or node.inputs[1] is None:
            continue
        transpose = node.inputs[1].producer()
        if transpose is None or transpose.op_type != "Transpose" or transpose.inputs[0] not in initializers:
            continue
        source = transpose.inputs[0]
        perm = transpose.attributes.get_ints("perm", None)
        if source.const_value is None or len(source.const_value.shape) != 2 or (perm and list(perm) != [1, 0]):
            continue
        tensor = source.const_value
        shape = ir.Shape(list(tensor.shape)[::-1])
        lazy = ir.LazyTensor(functools.partial(_transposed, tensor), tensor.dtype, shape)
        weight = ir.val(f"{source.name}_transposed_{len(untied)}", const_value=lazy)
        graph.register_initializer(weight)
        node.replace_input_with(1, weight)
        untied[weight.name] = source.name
        if not transpose.outputs[0].uses() and not transpose.outputs[0].is_graph_output():
            graph.remove(transpose, safe=True)
    return untied


def _transposed(tensor: Any) -> Any:
    import onnx_ir as ir

    return ir.tensor(np.ascontiguousarray(tensor.numpy().T))


def _embedding_tables(graph: Any, matmuls: dict[str, Any], untied: dict[str, str]) -> dict[str, str]:
    """``{MatMul name: table}`` for the MatMuls in ``matmuls`` whose constant weight [K, N] is the
    transpose of a table [N, K] a ``Gather`` reads (an output projection tied to the embedding):
    an ``untied`` one, or one equal to the table's transpose."""
    tables = {
        node.inputs[0].name
        for node in graph
        if node.op_type == "Gather" and node.inputs[0] is not None and node.inputs[0].is_initializer()
    }
    found = {}
    for name, node in matmuls.items():
        weight = node.inputs[1]
        source = untied.get(weight.name)
        if source in tables:
            found[name] = source
            continue
        for table in sorted(tables):
            value = graph.initializers[table]
            if list(value.const_value.shape) != list(weight.const_value.shape)[::-1]:
                continue
            if np.array_equal(value.const_value.numpy().T, weight.const_value.numpy()):
                found[name] = table
                break
    return found


def _weight_matmuls(graph: Any) -> dict[str, Any]:
    """``{node name: node}`` of the top graph's MatMuls with a constant 2-D weight (an initializer)."""
    found = {}
    for node in graph:
        weight = node.inputs[1] if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2 else None
        if weight is not None and weight.is_initializer() and weight.const_value is not None:
            if len(weight.const_value.shape) == 2:
                found[node.name] = node
    return found


class OnnxInt8Dynamic(Pass):
    """int8 MatMul weights and dynamically quantized int8 activations (ONNX Runtime quantize_dynamic)."""

    name = "onnx_int8_dynamic"
    remove_when = "Appended by quantize='int8'; leave it out for fp32 weights."
    description = "int8 MatMul weights, activations quantized to int8 at run time (ONNX Runtime quantize_dynamic)"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __call__(self, program: Any) -> PassResult:
        import onnx

        with quiet_loggers():
            from onnxruntime.quantization import QuantType, quantize_dynamic

        graph = program.model.graph
        before = _before(graph)
        untied = _untie_transposed_weights(graph)
        model = _proto(program)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "quantized.onnx"
            with quiet_loggers():
                # per-tensor weights: per_channel=True measured worse on SmolLM2 (logit cosine 0.75 vs 0.96)
                quantize_dynamic(model, path, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
            after = onnx.load(path)
        quantized = _program(after, program)
        counts = _counts(before, quantized.model.graph, ("MatMulInteger", "DynamicQuantizeMatMul"))
        if untied:
            counts["untied_weights"] = len(untied)
        return PassResult(quantized, modified=counts[QUANTIZED_WEIGHTS] > 0, counts=counts)


def rescore_onnx(graph: Any, head: Any, table: Any, top: int = TOP) -> None:
    """Add the exact rescoring after ``head`` (a node of ``graph``, onnx_ir's, whose first output is
    the logits, first input the hidden state) from ``table``, a [vocab, hidden] initializer, in
    place: the logits keep their name."""
    import onnx_ir as ir

    logits, x = head.outputs[0], head.inputs[0]
    base = f"{head.name}_top"
    k = _initializer(graph, f"{base}_k", np.array([min(top, table.shape[0])], np.int64))
    axis = _initializer(graph, f"{base}_axis", np.array([-1], np.int64))
    best = ir.node("TopK", [logits, k], attributes={"axis": -1}, num_outputs=2, name=base)
    rows = ir.node("Gather", [table, best.outputs[1]], name=f"{base}_rows")
    column = ir.node("Unsqueeze", [x, axis], name=f"{base}_column")
    products = ir.node("MatMul", [rows.outputs[0], column.outputs[0]], name=f"{base}_exact")
    exact = ir.node("Squeeze", [products.outputs[0], axis], name=f"{base}_drop")
    scatter = ir.node(
        "ScatterElements", [logits, best.outputs[1], exact.outputs[0]], attributes={"axis": -1}, name=f"{base}_scatter"
    )
    nodes = [best, rows, column, products, exact, scatter]
    users = [(use.node, use.idx) for use in logits.uses() if use.node not in (best, scatter)]
    for user, index in users:
        user.replace_input_with(index, scatter.outputs[0])
    for index, output in enumerate(graph.outputs):
        if output is logits:
            graph.outputs[index] = scatter.outputs[0]
    name = logits.name
    scatter.outputs[0].shape, scatter.outputs[0].dtype = logits.shape, logits.dtype
    logits.name = f"{name}_approx"
    scatter.outputs[0].name = name
    graph.insert_after(head, nodes)


register_pass(OnnxInt4Weights)
register_pass(OnnxInt8Dynamic)


def onnx_quantization_pass(mode: str, group_size: int) -> Pass:
    """The pass of ``OnnxConfig(quantize=mode)``."""
    if mode == "int4":
        return OnnxInt4Weights(group_size=group_size)
    if mode == "int8":
        return OnnxInt8Dynamic()
    raise ConfigError(f"unknown ONNX quantize mode {mode!r}; valid: {', '.join(ONNX_QUANTIZATION)}")
