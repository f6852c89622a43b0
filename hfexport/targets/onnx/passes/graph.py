"""Passes over the ONNX model of a ``torch.onnx.ONNXProgram`` (the ``onnx_passes`` stage).
onnxscript is imported when a pass runs, so registering these needs no ONNX package."""

from __future__ import annotations

import functools
from typing import Any

from hfexport.pipeline.pass_manager import PassResult, register_pass
from hfexport.pipeline.patches import patches_applied, register_patch

# ONNX Runtime's contrib operators (MatMulNBits, GroupQueryAttention, RotaryEmbedding, …)


def _node_count(program: Any) -> int:
    import onnx_ir as ir

    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(program.model.graph))


@register_patch(
    "onnxscript.optimizer._constant_folding:PartialEvaluatorRegistry.lookup_evaluators",
    name="onnx_split_to_sequence_of_unknown_split",
    reason=(
        "onnxscript's constant folding of SplitToSequence reads the split's value when its shape is a "
        "scalar's, and fails when that value is unknown (a size computed at run time: ProphetNet's "
        "torch.chunk of its n-gram streams) with \"'NoneType' object has no attribute 'ndim'\", which "
        "stops the whole optimizer. Such a node is left unfolded"
    ),
    upstream="https://github.com/microsoft/onnxscript/blob/v0.7.2/onnxscript/optimizer/_constant_folding.py",
    scope="onnx_passes",
)
def _split_to_sequence_of_unknown_split(original: Any) -> Any:
    def unless_split_unknown(evaluator: Any) -> Any:
        @functools.wraps(evaluator)
        def evaluate(node: Any, *args: Any, **kwargs: Any) -> Any:
            split = node.inputs[1] if len(node.inputs) > 1 else None
            if split is not None and split.const_value is None and split.shape is not None and split.shape.rank() == 0:
                return None
            return evaluator(node, *args, **kwargs)

        return evaluate

    @functools.wraps(original)
    def lookup_evaluators(self: Any, domain: str, opname: str, version: int) -> list[Any]:
        found = original(self, domain, opname, version)
        if (domain, opname) != ("", "SplitToSequence"):
            return found
        return [unless_split_unknown(evaluator) for evaluator in found]

    return lookup_evaluators


@register_pass(
    name="onnx_optimizer",
    stage="onnx_passes",
    remove_when=(
        "OnnxConfig(optimize=False) leaves it out: the model then keeps torch.onnx's graph unfolded "
        "(larger, slower), and the ORT fusions find less to fuse."
    ),
)
def onnx_optimizer(program: Any) -> PassResult:
    """The onnxscript optimizer: constant folding, dead code removal, function inlining, its
    default rewrite rules but one (``SlicesSplit``, and its no-op rules made exact: see
    :func:`_exact_no_op_rules`), common subexpressions."""
    import onnx_ir.passes.common as common
    from onnxscript import optimizer, rewriter

    before = _node_count(program)
    model = program.model
    optimizer.inline(model)
    with patches_applied(["onnx_split_to_sequence_of_unknown_split"], scope=None):
        optimizer.fold_constants(model, onnx_shape_inference=True)
    # One round of folding and rewrite rules: a second round took half the pass's time on
    # SmolLM2-135M (26 s against 14 s) for 6 nodes fewer out of 2,690. SlicesSplit (two Slices
    # of one input as a Split) is a two-output pattern, which onnxscript matches by trying the
    # graph's nodes of the second output's type for every candidate: 6 of the pass's 8 s on
    # SmolLM2's decode graph, for no match.
    rules = [rule for rule in rewriter._DEFAULT_REWRITE_RULES if rule.name != "SlicesSplit"]
    rewriter.rewrite(model, _exact_no_op_rules(rules))
    ir_passes = [
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    ]
    for ir_pass in ir_passes:
        ir_pass(model)
    _strided_folds_made_when_read(model.graph)
    after = _node_count(program)
    return PassResult(program, modified=before != after, counts={"nodes_removed": before - after})


def _strided_folds_made_when_read(graph: Any) -> None:
    """Each initializer that folding left as a strided numpy view (a linear layer's weight is the
    transpose of torch's: ``Transpose`` folds to a view of the parameter) as a tensor made when
    read, in row-major order, and written a slice of rows at a time
    (:class:`~hfexport.targets.onnx.initializers.MadeWhenWritten`). Written as they were, the
    views went out an element at a time: saving a Llama-3.2-1B-shaped model took 17.5 s in
    ``ndarray.tofile``; copied all at once, they would double the weights in memory."""
    import numpy as np
    import onnx_ir as ir
    import torch

    from hfexport.targets.onnx.initializers import MadeWhenWritten

    for value in graph.initializers.values():
        tensor = value.const_value
        array = getattr(tensor, "raw", None)
        if isinstance(tensor, ir.Tensor) and isinstance(array, np.ndarray) and not array.flags["C_CONTIGUOUS"]:
            if array.dtype.kind != "f" or array.ndim < 2:
                continue
            source = torch.from_numpy(array)
            value.const_value = MadeWhenWritten(source, source.dtype, name=tensor.name)


def _exact_no_op_rules(rules: list[Any]) -> list[Any]:
    """``rules`` with onnxscript's no-op rules (``x + 0``, ``x - 0``, ``x * 1``, ``x / 1`` → ``x``)
    matching exact constants only. Its constant patterns match within ``abs_tol=1e-8``, so
    ``mean + 1e-8`` (an RMS norm's epsilon) and ``sum + 1e-15`` (a router's guard against
    dividing by zero) were dropped as no-ops: MuseSpark's graph went from 3e-6 to 1.52 away from
    eager, with nothing said (onnxscript/rewriter/_pattern_ir.py, ``Constant``)."""
    from onnxscript.rewriter._pattern_ir import Constant
    from onnxscript.rewriter._rewrite_rule import RewriteRule
    from onnxscript.rewriter.rules.common import _no_op

    def exact(value: float) -> Any:
        return Constant(value, rel_tol=0.0, abs_tol=0.0)

    def add_0(op: Any, x: Any) -> Any:
        return op.Add(x, exact(0))

    def sub_0(op: Any, x: Any) -> Any:
        return op.Sub(x, exact(0))

    def mul_by_1(op: Any, x: Any) -> Any:
        return op.Mul(x, exact(1))

    def div_by_1(op: Any, x: Any) -> Any:
        return op.Div(x, exact(1))

    arithmetic = {
        id(rule) for rule in _no_op.rules.rules if rule not in (_no_op.dropout_zero_rule, _no_op.dropout_inference_rule)
    }
    exact_rules = [
        *RewriteRule(add_0, _no_op.identity).commute(),
        RewriteRule(sub_0, _no_op.identity),
        *RewriteRule(mul_by_1, _no_op.identity).commute(),
        RewriteRule(div_by_1, _no_op.identity),
    ]
    return [rule for rule in rules if id(rule) not in arithmetic] + exact_rules


@register_pass(
    name="onnx_ort_fusions",
    stage="onnx_passes",
    runs_after=["onnx_optimizer"],
    remove_when=(
        "For a runtime other than ONNX Runtime (its com.microsoft kernels); without it, norms and "
        "rotary embeddings run as plain ONNX ops."
    ),
)
def onnx_ort_fusions(program: Any) -> PassResult:
    """RMS norms and rotary embeddings as ONNX Runtime's fused kernels, counts per fusion.

    Each RMS norm (``Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul``) becomes one
    ``SimplifiedLayerNormalization``, and with the residual ``Add`` before it one
    ``SkipSimplifiedLayerNormalization`` (onnxscript's ORT fusions). Each rotary embedding of a
    query or key (``x * cos + rotate_half(x) * sin``: two slices, a negation, a concatenation,
    two products and a sum) becomes one ``com.microsoft::RotaryEmbedding``
    (:class:`~hfexport.targets.onnx.passes.rotary.TokenAnglesRotary`; in a float16 graph too, whose cos and
    sin are cast from float32). The per-node cost is a large part
    of a quantized decode step: SmolLM2-135M's decode graph went from 2,690 to 1,605 nodes with
    the norms fused, and to 1,242 with the rotary embeddings. onnxscript's SDPA →
    ``MultiHeadAttention`` rewrite is left out: on SmolLM2-135M it made the static-cache decode
    step slower on the CPU (it adds transposes of the cache); the static cache's attention is
    ``onnx_group_query_attention``'s."""
    import onnx_ir.passes.common as common
    from onnxscript import optimizer, rewriter
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.rotary_embedding import fuse_rotary_embedding
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    from hfexport.targets.onnx.passes.rotary import TokenAnglesRotary

    model = program.model
    before = _node_count(program)
    counts = {
        "rms_normalization": fuse_rms_normalization(model),
        "skip_rms_normalization": fuse_skip_rms_normalization(model),
    }
    _remove_inner_identities(model)
    # onnxscript's rotary fusion leaves a RotaryEmbedding function over whole cos / sin tensors,
    # which ONNX Runtime has no kernel for; the rule below turns each into the contrib op, and
    # inlining restores any it could not
    if fuse_rotary_embedding(model):
        rules = [TokenAnglesRotary.rule(), TokenAnglesRotary.rule(cast=True)]
        counts["rotary_embedding"] = rewriter.RewriteRuleSet(rules).apply_to_model(model)
        optimizer.inline(model)
        common.RemoveUnusedFunctionsPass()(model)
        common.RemoveUnusedNodesPass()(model)
    else:
        counts["rotary_embedding"] = 0
    _unused_statistics_left_out(model)  # after the rewrites: onnxscript's rewriter names every output
    return PassResult(program, modified=before != _node_count(program), counts=counts)


def _unused_statistics_left_out(model: Any) -> None:
    """The skip norms' mean and inverse standard deviation outputs (training statistics: nothing
    reads them) as absent outputs, which ONNX Runtime's kernel then does not write. onnxscript's
    fusion names all four outputs; ONNX Runtime GenAI's builder leaves them out, and each named
    one costs about 1 µs a norm on SmolLM2-135M's decode step."""
    outputs = set(model.graph.outputs)
    for node in model.graph:
        if node.op_type in ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization") and len(node.outputs) > 2:
            for value in node.outputs[1:3]:
                if value.name and value not in outputs and not list(value.uses()):
                    value.name = ""


def _remove_inner_identities(model: Any) -> None:
    """Bypass the top graph's ``Identity`` nodes whose result is not a graph output: the optimizer
    leaves ``cos * 1.0`` (the rope's attention scaling) as one, which the rotary patterns do not
    see through. (onnx_ir's ``IdentityEliminationPass`` also merges graph outputs that are
    identities of one value, renaming outputs.)"""
    outputs = set(model.graph.outputs)
    for node in [n for n in model.graph if n.op_type == "Identity" and n.domain == ""]:
        if node.outputs[0] in outputs or node.inputs[0] is None:
            continue
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        model.graph.remove(node, safe=True)


@register_pass(
    name="onnx_packed_projections",
    stage="onnx_passes",
    runs_after=["onnx_group_query_attention"],
    remove_when=(
        "To keep one MatMul per linear layer in the graph (a consumer that looks layers up by their weights' "
        "names); the values are the same either way."
    ),
)
def onnx_packed_projections(program: Any) -> PassResult:
    """The MatMuls that read one input with constant 2-D weights of one type (a layer's q, k and v
    projections) as one ``MatMul`` over the weights side by side, then a ``Split`` into their
    outputs. Each output column is computed as before, so the values are the same; a decode step
    runs one kernel instead of three, a quantization pass after it quantizes the shared input
    once, and ``GroupQueryAttention`` can read the packed projection itself
    (``onnx_packed_attention_inputs``). A gated MLP's gate and up projections (their outputs meet
    in a ``Mul``) stay apart: packed, SmolLM2-135M decoded slower in ``og.Generator`` (six
    alternating rounds: int4 190.9 against 206.9 tok/s, fp32 58.8 against 60.8). Counts:
    ``packed_matmuls`` (the MatMuls replaced), ``packs``."""
    import numpy as np
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    graph = program.model.graph
    initializers = set(graph.initializers.values())
    readers: dict[Any, list[Any]] = {}
    for node in graph:
        weight = node.inputs[1] if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2 else None
        if weight is None or weight not in initializers or weight.const_value is None:
            continue
        if weight.shape is None or weight.shape.rank() != 2 or node.inputs[0] is None:
            continue
        readers.setdefault(node.inputs[0], []).append(node)
    packed = packs = 0
    for x, group in readers.items():
        weights = [node.inputs[1] for node in group]
        if len(group) < 2 or len({w.dtype for w in weights}) != 1 or len({w.shape[0] for w in weights}) != 1:
            continue
        if _gated_pair(group):
            continue
        base = weights[0].name
        tensors = [w.const_value for w in weights]
        shape = ir.Shape([weights[0].shape[0], sum(w.shape[1] for w in weights)])
        # made when read (saved, quantized), one packed weight at a time: the parts stay in memory
        # anyway (the captured program holds them), and a copy of them all at once would add most
        # of a decoder's weights to the export's peak
        lazy = ir.LazyTensor(functools.partial(_side_by_side, tensors), tensors[0].dtype, shape)
        weight = ir.val(f"{base}_packed", const_value=lazy)
        sizes = ir.val(f"{base}_packed_split", const_value=ir.tensor(np.array([w.shape[1] for w in weights])))
        graph.register_initializer(weight)
        graph.register_initializer(sizes)
        matmul = ir.node("MatMul", [x, weight], name=f"{group[0].name}_packed")
        matmul.metadata_props.update(group[0].metadata_props)  # the module it was recorded in
        split = ir.node("Split", [matmul.outputs[0], sizes], attributes={"axis": -1}, num_outputs=len(group))
        split.name = f"{group[0].name}_packed_split"
        graph.insert_before(group[0], [matmul, split])
        matmul.outputs[0].dtype = weights[0].dtype
        if x.shape is not None:
            matmul.outputs[0].shape = ir.Shape([*x.shape[:-1], shape[1]])
        for node, output in zip(group, split.outputs, strict=True):
            take_over(node.outputs[0], output)
        packed += len(group)
        packs += 1
    if packs:
        common.RemoveUnusedNodesPass()(program.model)
    return PassResult(program, modified=packs > 0, counts={"packed_matmuls": packed, "packs": packs})


def _gated_pair(group: list[Any], depth: int = 3) -> bool:
    """Whether two MatMuls' outputs meet in a ``Mul`` within ``depth`` nodes (a gated MLP's
    ``act(gate) * up``)."""
    if len(group) != 2:
        return False
    reached = []
    for node in group:
        muls, frontier = set(), [node]
        for _ in range(depth):
            frontier = [user for n in frontier for out in n.outputs for user, _ in out.uses()]
            muls |= {id(n) for n in frontier if n.op_type == "Mul"}
        reached.append(muls)
    return bool(reached[0] & reached[1])


def take_over(old: Any, new: Any) -> None:
    """Every use of ``old`` (an onnx_ir value; a graph output too) reads ``new``, which takes its
    name, type and shape: a replaced node's output keeps the name the graph's outputs and the
    runners know."""
    name = old.name
    if old.dtype is not None:
        new.shape, new.dtype = old.shape, old.dtype
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name, new.name = None, name


def _side_by_side(tensors: list[Any]) -> Any:
    """One tensor of the 2-D ``tensors`` (onnx_ir's) side by side along the second axis."""
    import numpy as np
    import onnx_ir as ir

    return ir.tensor(np.concatenate([t.numpy() for t in tensors], axis=1))
