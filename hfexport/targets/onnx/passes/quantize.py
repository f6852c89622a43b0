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

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hfexport.errors import ConfigError
from hfexport.passes.quantize import checked_rescore_top
from hfexport.passes.top_logits import TOP
from hfexport.pipeline.numerics import QUANTIZED_WEIGHTS
from hfexport.pipeline.pass_manager import Pass, PassResult, register_pass
from hfexport.versions import quiet_loggers

ONNX_QUANTIZATION = {"int4": "onnx_int4_weights", "int8": "onnx_int8_dynamic"}


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
    """MatMul weights to asymmetric 4-bit blocks (ONNX Runtime's ``MatMulNBits``, integer zero
    points), their inputs quantized to int8 per block on the fly (``accuracy_level=4``). An output
    projection tied to the embedding table goes to symmetric 4-bit blocks with its ``rescore_top``
    highest logits recomputed from the fp32 table (:mod:`hfexport.passes.top_logits`); any other
    stays in symmetric 8-bit blocks. Weights that read one input are packed into one ``MatMul``
    before (``onnx_packed_projections``), so q, k and v (gate and up) share a node and quantize their
    input once.

    The defaults are ONNX Runtime GenAI's model builder's form and speed (it takes symmetric blocks),
    which its runtime and users compare against. SmolLM2-135M-Instruct in ``og.Generator``
    (``benchmarks/results/onnx-int4-fast/README.md``): 7.3 ms a step against the builder's 7.4,
    teacher-forced top-1 against fp32 78.1% (the builder's folder 73.4%), "The capital of France is
    Paris, France.". Three options trade speed for exactness:

    - ``minimums=True``: a float minimum per block (llama.cpp's Q4_1 form,
      :mod:`hfexport.targets.onnx.passes.blocks`) instead of an integer zero point, which rounds the
      minimum up to half a step off; a Q4_1 checkpoint (a GGUF file, like SmolLM2's) is then held
      exactly. It adds a ``MatMul`` of the input's block sums per weight.
    - ``float_attention=True``: the attention modules' own projections (q, k, v, o: the linear
      layers torch.onnx records inside a class named ``…Attention``) keep fp32 inputs
      (``accuracy_level=1``), where int8 inputs did the most harm.
    - ``float_tail``: the last fraction of the 4-bit layers in graph order (those nearest the
      logits) keep fp32 inputs (llama.cpp's Q4_K_M likewise gives the last layers more bits).

    All three (``minimums=True, float_attention=True, float_tail=1/8``, the default until
    2026-12-06) gave SmolLM2 96.9% top-1 (fp32's own prefill against its decode: 96.9%) at 11.2 ms a
    step (``benchmarks/results/onnx-int4-attention-inputs/README.md``).
    ``int8_output=False`` puts an output projection that is not rescored in 4 bits too;
    ``rescore_top=0`` rescores none (a tied output projection stays at 8 bits)."""

    name = "onnx_int4_weights"
    remove_when = "Appended by quantize='int4'; leave it out for fp32 weights."
    description = "MatMul weights to 4-bit blocks of group_size (ONNX Runtime MatMulNBits); inputs int8 on the fly"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __init__(
        self,
        group_size: int = 32,
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
        from hfexport.targets.onnx.passes.blocks import rewrite_with_minimum_blocks

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
    remove_when = "Appended by quantize='int8'; leave it out for fp32 weights."
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


def rescore_onnx(model: Any, head: Any, table: str, top: int = TOP) -> None:
    """Add the exact rescoring after ``head`` (an ``onnx.NodeProto`` of ``model``'s top graph whose
    first output is the logits, first input the hidden state) from the [vocab, hidden] initializer
    ``table``, in place: the logits keep their name."""
    import numpy as np
    from onnx import helper, numpy_helper

    vocab = next(list(t.dims) for t in model.graph.initializer if t.name == table)[0]
    logits, x = head.output[0], head.input[0]
    approx, base = f"{logits}_approx", f"{head.name}_top"
    head.output[0] = approx
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([min(top, vocab)], np.int64), f"{base}_k"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{base}_axis"),
        ]
    )
    nodes = [
        helper.make_node("TopK", [approx, f"{base}_k"], [f"{base}_values", f"{base}_index"], axis=-1, name=base),
        helper.make_node("Gather", [table, f"{base}_index"], [f"{base}_rows"], name=f"{base}_rows"),
        helper.make_node("Unsqueeze", [x, f"{base}_axis"], [f"{base}_column"], name=f"{base}_column"),
        helper.make_node("MatMul", [f"{base}_rows", f"{base}_column"], [f"{base}_products"], name=f"{base}_exact"),
        helper.make_node("Squeeze", [f"{base}_products", f"{base}_axis"], [f"{base}_exact"], name=f"{base}_drop"),
        helper.make_node(
            "ScatterElements", [approx, f"{base}_index", f"{base}_exact"], [logits], axis=-1, name=f"{base}_scatter"
        ),
    ]
    position = list(model.graph.node).index(head) + 1
    for offset, node in enumerate(nodes):
        model.graph.node.insert(position + offset, node)


register_pass(OnnxInt4Weights)
register_pass(OnnxInt8Dynamic)


def onnx_quantization_pass(mode: str, group_size: int) -> Pass:
    """The pass of ``OnnxConfig(quantize=mode)``."""
    if mode == "int4":
        return OnnxInt4Weights(group_size=group_size)
    if mode == "int8":
        return OnnxInt8Dynamic()
    raise ConfigError(f"unknown ONNX quantize mode {mode!r}; valid: {', '.join(ONNX_QUANTIZATION)}")
