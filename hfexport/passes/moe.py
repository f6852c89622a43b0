"""Mixture-of-experts rewrites."""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.rewrite_rules import RewriteRule, rule_pass

aten = torch.ops.aten


def _grouped_mm_targets() -> set:
    targets = {aten._grouped_mm.default}
    # transformers' own op, used when torch's grouped_mm cannot run (fp32 weights, tracing).
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        targets.add(fallback.default)
    return targets


def _is_grouped_mm(node: Node) -> bool:
    # The target set is rebuilt per node: transformers registers its op when its MoE code is imported.
    return node.op == "call_function" and node.target in _grouped_mm_targets()


def _operands(node: Node) -> tuple[Node, Node, Node | None, dict]:
    args = arguments(node)
    return args.get("self", args.get("input")), args.get("mat2", args.get("weight")), args.get("offs"), args


def _check(node: Node) -> str | None:
    x, weight, offs, args = _operands(node)
    if args.get("out_dtype") is not None:
        return "out_dtype set"
    if offs is None:
        return "no offs"
    if x.meta["val"].dim() != 2 or weight.meta["val"].dim() != 3:
        # only the MoE layout: rows (S, K) sorted by expert, weights (E, K, N)
        return f"{x.meta['val'].dim()}-D input and {weight.meta['val'].dim()}-D weight, not 2-D rows by 3-D experts"
    return None


def _rewrite(graph: Graph, node: Node) -> None:
    x, weight, offs, args = _operands(node)
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


grouped_mm_to_batched_mm = rule_pass(
    "grouped_mm_to_batched_mm",
    [RewriteRule("grouped_mm_as_gather_bmm", _is_grouped_mm, _check, _rewrite, warn_on_miss=True)],
    runs_before=("dead_code_elimination",),
    description="""Rewrite MoE grouped matmuls (aten._grouped_mm / transformers.grouped_mm_fallback) as
    gather + bmm, which ONNX and XNNPACK can run.

    Scaling: each routed row gathers its expert's (K, N) weight and does one (1, K) x (K, N)
    product, so compute is that of the grouped matmul and does not grow with the number of
    experts, while the gathered weights take rows x K x N memory (rows = tokens x top_k): cheap
    for decode, the largest buffer of the layer for long prefills.

    A grouped matmul with out_dtype, without offs, or outside the MoE layout (2-D rows sorted by
    expert, 3-D expert weights) is left as is and counted as missed, with a warning.
    """,
    remove_when=(
        "Without it, an MoE model's grouped matmuls reach ONNX and XNNPACK, which have no grouped "
        "matmul, and the lowering fails."
    ),
)
