"""Attention on ExecuTorch's own fused kernel (``llama::custom_sdpa``, from
``executorch.extension.llm.custom_ops``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

from hfexport.passes.attention import mask_forms
from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.rewrite_rules import RewriteRule, rule_pass

aten = torch.ops.aten

_KERNEL_MASK = "hfexport.custom_sdpa_mask"  # meta of an additive [1, 1, q, k] mask: its [q, k] rows


def _custom_sdpa() -> Any:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers the llama ops)

    return torch.ops.llama.custom_sdpa.default


def _is_sdpa(node: Node) -> bool:
    return node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default


def _check(node: Node) -> str | None:
    args = arguments(node)
    query, key, value, mask = (args.get(name) for name in ("query", "key", "value", "attn_mask"))
    q, k, v = (n.meta["val"] for n in (query, key, value))
    if args.get("is_causal") or args.get("dropout_p", 0.0):
        return "causal or dropout SDPA"
    if q.dtype != torch.float32 or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"not float32 ({q.dtype})"
    if mask is None or mask.meta["val"].dtype != torch.bool:
        return "no boolean mask"
    m = mask.meta["val"]
    if q.dim() != 4 or k.dim() != 4 or m.dim() != 4:
        return "not [batch, heads, length, dim]"
    if not (q.shape[0] == k.shape[0] == v.shape[0] == m.shape[0] == 1 and m.shape[1] == 1):
        return "not a batch of one (the kernel takes one [queries, keys] mask for every row)"
    heads, kv_heads = q.shape[1], k.shape[1]
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads or v.shape[1] != kv_heads:
        return "query heads not a multiple of the key/value heads"
    if kv_heads != heads and not args.get("enable_gqa"):
        return "fewer key/value heads without enable_gqa"
    return None


def _kernel_mask(edit: GraphEditor, mask: Node) -> tuple[Node, Node]:
    """A ``[1, 1, q, k]`` boolean mask as the kernel's ``[q, k]`` additive one and its rows that see
    any key (1.0 / 0.0): ``attention_as_matmuls``' forms of the mask (made once per mask, shared
    with any attention that pass rewrites), the additive one's single row taken once."""
    additive, visible = mask_forms(edit, mask, torch.float32)
    if _KERNEL_MASK not in additive.meta:
        additive.meta[_KERNEL_MASK] = edit.call(aten.select.int, edit.call(aten.select.int, additive, 0, 0), 0, 0)
    return additive.meta[_KERNEL_MASK], visible


def _rewrite(graph: Graph, node: Node) -> None:
    args = arguments(node)
    query, key, value, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    _, heads, _, dim = query.meta["val"].shape
    kv_heads = key.meta["val"].shape[1]
    groups = heads // kv_heads
    edit = GraphEditor(graph, node)
    additive, visible = _kernel_mask(edit, mask)
    # the kernel takes [batch, length, heads, dim]: each key/value head becomes a batch row of one
    # head (a view of the cache as it lies), and the query heads it serves that row's heads
    grouped_query = edit.call(aten.reshape.default, query, [kv_heads, groups, -1, dim])
    grouped_query = edit.call(aten.permute.default, grouped_query, [0, 2, 1, 3])
    keys = edit.call(aten.reshape.default, key, [kv_heads, -1, 1, dim])
    values = edit.call(aten.reshape.default, value, [kv_heads, -1, 1, dim])
    scale = args.get("scale")
    attended = edit.call(_custom_sdpa(), grouped_query, keys, values, 0, additive, 0.0, False, scale)
    output = edit.call(aten.permute.default, attended, [0, 2, 1, 3])
    output = edit.call(aten.reshape.default, output, [1, heads, -1, dim])
    output = edit.call(aten.mul.Tensor, output, visible)
    node.replace_all_uses_with(output)
    graph.erase_node(node)


attention_as_custom_sdpa = rule_pass(
    "attention_as_custom_sdpa",
    [RewriteRule("custom_sdpa_over_kv_heads", _is_sdpa, _check, _rewrite)],
    runs_before=("grouped_query_attention", "attention_as_matmuls", "dead_code_elimination"),
    description="""Run a batch-of-one program's attention on ExecuTorch's fused CPU kernel
    (``llama::custom_sdpa``): SDPA with a boolean ``[1, 1, queries, keys]`` mask, grouped or not.

    The kernel takes ``[batch, length, heads, dim]`` tensors, one 2-D float mask for every batch
    row and key/value heads that divide the query heads. The static cache keeps transformers'
    ``[1, kv_heads, length, dim]`` layout, whose memory also reads as ``[kv_heads, length, 1,
    dim]`` in the kernel's layout; so each key/value head is a batch row of one head (the cache
    read through a reshape, which ExecuTorch makes a view: ``pass_through_reshapes`` in the
    ExecuTorch lowering), and the query heads that share it are that row's heads. The mask becomes one
    additive ``[queries, keys]`` mask (0 where visible, the float minimum elsewhere) for every
    layer; query rows that see no key are zeroed afterwards, as eager SDPA gives (the kernel
    would return the values' mean). The cache writes stay as they are: as the program's state
    they are already written in place.

    The kernel replaces the attention's matmuls and softmax that XNNPACK runs as separate
    operators. Only a batch of one: the kernel's single mask cannot hold each row's padding (a
    program of several rows, ``ExecutorchConfig(max_batch_size=...)``, keeps SDPA, counted as
    missed). Not in the default list: on SmolLM2-135M (cache 128, 1 thread, in turns) the fp32
    step went from 12.54 to 12.19 ms and the 8da4w step from 2.99 to 3.10 ms; the query's
    transposes around the kernel (its heads grouped under their key/value head) cost what the
    kernel saves. Put it before ``grouped_query_attention`` in the pass list to use it.
    """,
)
