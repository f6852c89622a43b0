"""Attention rewrites."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.pass_manager import graph_pass

aten = torch.ops.aten


@graph_pass(runs_before=("dead_code_elimination",))
def zero_fully_masked_attention_rows(graph_module: GraphModule) -> int:
    """Make query rows whose boolean attention mask hides every key return zeros, as eager SDPA
    does (its safe softmax), whatever the target's attention kernel gives for them.

    Such rows are the padded positions of a left-padded batch. ONNX Runtime's translation of SDPA
    gave NaN for them (microsoft/onnxscript#2479), and the ONNX Attention op was only specified to
    return zeros later (onnx/onnx#8068); a NaN there reaches every position through the next
    layer's keys. The rewrite is ``where(mask.any(-1, keepdim=True), sdpa(...), 0)``: one
    reduction over the mask per attention call.
    """
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        mask = arguments(node).get("attn_mask")
        if mask is None or mask.meta["val"].dtype != torch.bool:
            continue
        edit = GraphEditor(graph_module.graph, node.next)
        visible = edit.call(aten.any.dim, mask, -1, True)
        guarded = edit.call(aten.where.ScalarOther, visible, node, 0.0)
        node.replace_all_uses_with(guarded, delete_user_cb=lambda user, guarded=guarded: user is not guarded)
        rewritten += 1
    return rewritten
