"""Passes over the ONNX model of a ``torch.onnx.ONNXProgram`` (the ``onnx_passes`` stage).
onnxscript is imported when a pass runs, so registering these needs no ONNX package."""

from __future__ import annotations

from typing import Any

from hfexport.pipeline.pass_manager import PassResult, register_pass


def _node_count(program: Any) -> int:
    import onnx_ir as ir

    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(program.model.graph))


@register_pass(name="onnx_optimizer", stage="onnx_passes")
def onnx_optimizer(program: Any) -> PassResult:
    """The onnxscript optimizer: constant folding, dead code removal, function inlining, its
    default rewrite rules but one (``SlicesSplit``), common subexpressions."""
    import onnx_ir.passes.common as common
    from onnxscript import optimizer, rewriter

    before = _node_count(program)
    model = program.model
    optimizer.inline(model)
    optimizer.fold_constants(model, onnx_shape_inference=True)
    # One round of folding and rewrite rules: a second round took half the pass's time on
    # SmolLM2-135M (26 s against 14 s) for 6 nodes fewer out of 2,690. SlicesSplit (two Slices
    # of one input as a Split) is a two-output pattern, which onnxscript matches by trying the
    # graph's nodes of the second output's type for every candidate: 6 of the pass's 8 s on
    # SmolLM2's decode graph, for no match.
    rules = [rule for rule in rewriter._DEFAULT_REWRITE_RULES if rule.name != "SlicesSplit"]
    rewriter.rewrite(model, rules)
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
    after = _node_count(program)
    return PassResult(program, modified=before != after, counts={"nodes_removed": before - after})


@register_pass(name="onnx_ort_fusions", stage="onnx_passes", runs_after=["onnx_optimizer"])
def onnx_ort_fusions(program: Any) -> PassResult:
    """RMS norms as ONNX Runtime's fused kernels (onnxscript's ORT fusions), counts per fusion.

    Each RMS norm (``Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul``) becomes one
    ``SimplifiedLayerNormalization``, and with the residual ``Add`` before it one
    ``SkipSimplifiedLayerNormalization``: 13 nodes fewer per decoder layer, whose per-node cost
    is a large part of a quantized decode step. onnxscript's other ORT fusions are left out: on
    SmolLM2-135M its SDPA → ``MultiHeadAttention`` rewrite made the static-cache decode step
    slower on the CPU (it adds transposes of the cache), and its rotary fusion needs a
    cos / sin cache the graph does not have, so it is undone by the optimizer."""
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    before = _node_count(program)
    counts = {
        "rms_normalization": fuse_rms_normalization(program.model),
        "skip_rms_normalization": fuse_skip_rms_normalization(program.model),
    }
    return PassResult(program, modified=before != _node_count(program), counts=counts)
