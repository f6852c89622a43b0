"""Rewrites of ops that ExecuTorch's portable kernel library cannot run.

The ExecuTorch runtime fails to load a method that uses an operator without a kernel
(``error 0x14``, OperatorMissing). In executorch 1.4.1 the portable library has no kernel for
``histc``, ``sort`` or ``empty_permuted`` (what ``empty_like`` becomes in edge dialect), all of
which transformers' MoE routing uses. Each pass rewrites one into ops that have kernels.
ExecuTorch's own edge passes also fix an ``empty`` of symbolic size to the sample's
(:func:`empty_of_symbolic_size_to_zeros`).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.pass_manager import graph_pass

aten = torch.ops.aten


@graph_pass(
    remove_when=(
        "Without it, histc has no ExecuTorch kernel and the lowering fails; its memory grows as values x bins."
    )
)
def histc_to_comparisons(graph_module: GraphModule) -> int:
    """Rewrite ``histc(x, bins, min, max)`` (with min < max) as a one-hot comparison of each
    value's bin against ``arange(bins)``, summed: memory grows as len(x) x bins."""
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target is not aten.histc.default:
            continue
        args = arguments(node)
        x, bins = args["self"], args.get("bins", 100)
        low, high = float(args.get("min", 0)), float(args.get("max", 0))
        if not low < high:
            continue  # min == max means "use the data's range": left as is
        edit = GraphEditor(graph_module.graph, node)
        dtype = x.meta["val"].dtype
        scaled = edit.call(aten.mul.Tensor, edit.call(aten.sub.Tensor, x, low), bins / (high - low))
        index = edit.call(aten.floor.default, scaled)
        # histc puts x == max in the last bin
        index = edit.call(aten.clamp.default, index, None, float(bins - 1))
        inside = edit.call(
            aten.logical_and.default, edit.call(aten.ge.Scalar, x, low), edit.call(aten.le.Scalar, x, high)
        )
        bin_ids = edit.call(aten.arange.default, bins, dtype=dtype)
        hits = edit.call(
            aten.eq.Tensor, edit.call(aten.unsqueeze.default, index, -1), edit.call(aten.unsqueeze.default, bin_ids, 0)
        )
        hits = edit.call(aten.logical_and.default, hits, edit.call(aten.unsqueeze.default, inside, -1))
        counts = edit.call(aten.sum.dim_IntList, hits, [0], dtype=dtype)
        node.replace_all_uses_with(counts)
        graph_module.graph.erase_node(node)
        rewritten += 1
    return rewritten


@graph_pass(remove_when="Without it, sort has no ExecuTorch kernel and the lowering fails.")
def sort_to_topk(graph_module: GraphModule) -> int:
    """Rewrite ``sort`` as ``topk`` over the whole axis (same values and indices; among equal
    values the order may differ, which every consumer of a stable-sort permutation in
    transformers undoes with the same permutation)."""
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.sort.default, aten.sort.stable):
            continue
        args = arguments(node)
        x, dim, descending = args["self"], args.get("dim", -1), bool(args.get("descending", False))
        edit = GraphEditor(graph_module.graph, node)
        length = edit.call(aten.sym_size.int, x, dim)
        replacement = edit.call(aten.topk.default, x, length, dim, descending, True)
        node.replace_all_uses_with(replacement)
        graph_module.graph.erase_node(node)
        rewritten += 1
    return rewritten


@graph_pass(remove_when="Without it, empty_like has no portable kernel once in edge dialect and the lowering fails.")
def empty_like_to_zeros_like(graph_module: GraphModule) -> int:
    """Rewrite ``empty_like`` (uninitialised memory, no portable kernel once in edge dialect) as
    ``zeros_like``, which has one; code that reads empty memory before writing it is a bug anyway."""
    rewritten = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is aten.empty_like.default:
            node.target = aten.zeros_like.default
            rewritten += 1
    return rewritten


_EMPTY_TO_ZEROS = {aten.new_empty.default: aten.new_zeros.default, aten.empty.memory_format: aten.zeros.default}


@graph_pass(
    remove_when=(
        "Without it, an empty of a symbolic size fixes its axes to the sample's for the whole ExecuTorch program."
    )
)
def empty_of_symbolic_size_to_zeros(graph_module: GraphModule) -> int:
    """Rewrite ``new_empty`` / ``empty`` of a symbolic size as ``new_zeros`` / ``zeros``. to_edge
    turns an ``empty`` into ExecuTorch's ``_empty_dim_order``, whose size is ``int[]``: reading the
    symbolic size as an int fixed the axes to the sample's for the whole program (multi-head latent
    attention's keys, ``new_empty`` then two slice copies: GLM-4-MoE-Lite and HunYuan V4 took the
    sample's batch and length only). ``zeros`` takes a symbolic size; the values are overwritten."""
    rewritten = 0
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in _EMPTY_TO_ZEROS:
            continue
        args = arguments(node)
        if not any(isinstance(size, torch.fx.Node) for size in args["size"]):
            continue
        memory_format = args.get("memory_format")
        if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
            continue
        node.target = _EMPTY_TO_ZEROS[node.target]
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "memory_format"}
        if node.target is aten.zeros.default and len(node.args) > 5:
            node.args = node.args[:5]
        rewritten += 1
    return rewritten
