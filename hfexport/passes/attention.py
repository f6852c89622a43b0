"""Attention rewrites."""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.rewrite_rules import RewriteRule, rule_pass

aten = torch.ops.aten


def _is_masked_sdpa(node: Node) -> bool:
    # SDPA without attn_mask has no fully masked rows to guard: not matched, so not counted as missed.
    return (
        node.op == "call_function"
        and node.target is aten.scaled_dot_product_attention.default
        and arguments(node).get("attn_mask") is not None
    )


def _check(node: Node) -> str | None:
    dtype = arguments(node)["attn_mask"].meta["val"].dtype
    return None if dtype == torch.bool else f"mask is not boolean ({dtype})"


def _rewrite(graph: Graph, node: Node) -> None:
    edit = GraphEditor(graph, node.next)
    visible = edit.call(aten.any.dim, arguments(node)["attn_mask"], -1, True)
    guarded = edit.call(aten.where.ScalarOther, visible, node, 0.0)
    node.replace_all_uses_with(guarded, delete_user_cb=lambda user: user is not guarded)


zero_fully_masked_attention_rows = rule_pass(
    "zero_fully_masked_attention_rows",
    [RewriteRule("guard_fully_masked_rows", _is_masked_sdpa, _check, _rewrite)],
    runs_before=("dead_code_elimination",),
    description="""Make query rows whose boolean attention mask hides every key return zeros, as eager SDPA
    does (its safe softmax), whatever the target's attention kernel gives for them.

    Such rows are the padded positions of a left-padded batch. ONNX Runtime's translation of SDPA
    gave NaN for them (microsoft/onnxscript#2479), and the ONNX Attention op was only specified to
    return zeros later (onnx/onnx#8068); a NaN there reaches every position through the next
    layer's keys. The rewrite is ``where(mask.any(-1, keepdim=True), sdpa(...), 0)``: one
    reduction over the mask per attention call.

    An SDPA call with a float (additive) mask is left as is and counted as missed.
    """,
)
