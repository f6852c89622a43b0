"""Mixture-of-experts rewrites."""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule, Node

from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.pass_manager import graph_pass

logger = logging.getLogger("hfexport")
aten = torch.ops.aten


def _grouped_mm_targets() -> set:
    targets = {aten._grouped_mm.default}
    # transformers' own op, used when torch's grouped_mm cannot run (fp32 weights, tracing).
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        targets.add(fallback.default)
    return targets


def _rewrite(graph: torch.fx.Graph, node: Node) -> bool:
    args = arguments(node)
    x, weight, offs = args.get("self", args.get("input")), args.get("mat2", args.get("weight")), args.get("offs")
    if args.get("out_dtype") is not None or offs is None:
        return False
    if x.meta["val"].dim() != 2 or weight.meta["val"].dim() != 3:
        return False  # only the MoE layout: rows (S, K) sorted by expert, weights (E, K, N)
    edit = GraphEditor(graph, node)
    num_experts = weight.meta["val"].shape[0]
    # The expert of row r is the number of group ends <= r (offs holds cumulative row counts).
    rows = edit.call(aten.arange.start, 0, edit.call(aten.sym_size.int, x, 0), dtype=offs.meta["val"].dtype)
    ends_passed = edit.call(
        aten.ge.Tensor, edit.call(aten.unsqueeze.default, rows, 1), edit.call(aten.unsqueeze.default, offs, 0)
    )
    expert = edit.call(aten.sum.dim_IntList, ends_passed, [1])
    expert = edit.call(aten.clamp.default, expert, None, num_experts - 1)
    # (S, 1, K) @ (S, K, N): every row multiplies its own expert's matrix.
    per_row_weight = edit.call(aten.index.Tensor, weight, [expert])
    out = edit.call(aten.bmm.default, edit.call(aten.unsqueeze.default, x, 1), per_row_weight)
    out = edit.call(aten.squeeze.dim, out, 1)
    if args.get("bias") is not None:
        out = edit.call(aten.add.Tensor, out, edit.call(aten.index.Tensor, args["bias"], [expert]))
    # Rows past the last group end belong to no expert: grouped_mm leaves them zero.
    beyond = edit.call(aten.ge.Tensor, rows, edit.call(aten.select.int, offs, 0, -1))
    out = edit.call(aten.masked_fill.Scalar, out, edit.call(aten.unsqueeze.default, beyond, 1), 0.0)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True


@graph_pass(runs_before=("dead_code_elimination",))
def grouped_mm_to_batched_mm(graph_module: GraphModule) -> int:
    """Rewrite MoE grouped matmuls (aten._grouped_mm / transformers.grouped_mm_fallback) as
    gather + bmm, which ONNX and XNNPACK can run.

    Scaling: each routed row gathers its expert's (K, N) weight and does one (1, K) x (K, N)
    product, so compute is that of the grouped matmul and does not grow with the number of
    experts, while the gathered weights take rows x K x N memory (rows = tokens x top_k): cheap
    for decode, the largest buffer of the layer for long prefills.
    """
    targets = _grouped_mm_targets()
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target in targets:
            if _rewrite(graph_module.graph, node):
                rewritten += 1
            else:
                logger.warning("grouped_mm_to_batched_mm: left %s (unsupported layout or out_dtype)", node.name)
    return rewritten
