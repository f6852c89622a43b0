"""Attention on ExecuTorch's own fused kernel (``llama::custom_sdpa``, from
``executorch.extension.llm.custom_ops``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

from hfexport.passes.attention import mask_forms
from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.rewrite_rules import RewriteRule, rule_pass

aten = torch.ops.aten

_KERNEL_MASK = "hfexport.custom_sdpa_mask"  # meta of an additive [1, 1, q, k] mask: its [q, k] rows
_EXTENT = "hfexport.custom_sdpa_extent"  # meta of a boolean mask: 1 + the last key any query sees


def _custom_sdpa() -> Any:
    """The kernel's op, registered by importing ExecuTorch's LLM custom ops; None in a build
    without them."""
    try:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers the llama ops)
    except (ImportError, OSError):
        return None
    return torch.ops.llama.custom_sdpa.default


def _is_sdpa(node: Node) -> bool:
    return node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default


def _check(node: Node) -> str | None:
    args = arguments(node)
    query, key, value, mask = (args.get(name) for name in ("query", "key", "value", "attn_mask"))
    q, k, v = (n.meta["val"] for n in (query, key, value))
    if args.get("is_causal") or args.get("dropout_p", 0.0):
        return "causal or dropout SDPA"
    # executorch 1.4.1's kernel takes bfloat16 / float16 queries but returns float32 values far
    # from SDPA's (a float32 mask; a float16 one is refused): half-precision models keep matmuls
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
    if k.shape[-1] != v.shape[-1]:
        # the kernel asserts equal key and value caches (MiniCPM3's and DeepSeek's MLA differ)
        return "keys and values of different head sizes"
    if _custom_sdpa() is None:
        return "this ExecuTorch build has no LLM custom ops (executorch.extension.llm.custom_ops)"
    return None


def _kernel_mask(edit: GraphEditor, mask: Node) -> tuple[Node, Node]:
    """A ``[1, 1, q, k]`` boolean mask as the kernel's ``[q, k]`` additive one and its rows that see
    any key (1.0 / 0.0): ``attention_as_matmuls``' forms of the mask (made once per mask, shared
    with any attention that pass rewrites), the additive one's single row taken once."""
    additive, visible = mask_forms(edit, mask, torch.float32)
    if _KERNEL_MASK not in additive.meta:
        additive.meta[_KERNEL_MASK] = edit.call(aten.select.int, edit.call(aten.select.int, additive, 0, 0), 0, 0)
    return additive.meta[_KERNEL_MASK], visible


def _key_extent(edit: GraphEditor, mask: Node) -> Node:
    """How many keys, from the first, hold every key a query of ``mask`` (``[1, 1, q, k]``, boolean)
    sees: one past the last visible key, at least 1. Read from the mask at run time (a data-dependent
    size, bounded by the cache length), once per mask."""
    if _EXTENT not in mask.meta:
        keys = mask.meta["val"].shape[-1]
        seen = edit.call(aten.any.dim, edit.call(aten.reshape.default, mask, [-1, keys]), 0)
        ends = edit.call(aten.arange.start, 1, keys + 1, dtype=torch.int64)
        last = edit.call(aten.amax.default, edit.call(aten.mul.Tensor, seen, ends), [0])
        extent = edit.call(aten._local_scalar_dense.default, edit.call(aten.clamp_min.default, last, 1))
        shape_env = edit.fake_mode.shape_env
        extent.meta["unbacked_bindings"] = compute_unbacked_bindings(shape_env, extent.meta["val"])
        edit.call(aten.sym_constrain_range_for_size.default, extent, min=1, max=keys)
        mask.meta[_EXTENT] = extent
    return mask.meta[_EXTENT]


def _rewrite(graph: Graph, node: Node) -> None:
    args = arguments(node)
    query, key, value, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    edit = GraphEditor(graph, node)
    additive, visible = _kernel_mask(edit, mask)
    # the kernel takes [batch, length, heads, dim]; a cache kept as the program's state is laid out
    # that way by the lowering (state_in_attention_layout), which makes the keys' and values'
    # transposes here the buffers themselves
    slots = mask.meta["val"].shape[-1]
    if isinstance(slots, int) and slots > 2:  # a static cache's keys: read only the filled ones (a
        # size bounded by 2 or less cannot be constrained, nor is there anything to save)
        extent = _key_extent(edit, mask)
        key, value = (edit.call(aten.slice.Tensor, t, 2, 0, extent) for t in (key, value))
        if _EXTENT not in additive.meta:
            additive.meta[_EXTENT] = edit.call(aten.slice.Tensor, additive, 1, 0, extent)
        additive = additive.meta[_EXTENT]
    query, key, value = (edit.call(aten.permute.default, t, [0, 2, 1, 3]) for t in (query, key, value))
    attended = edit.call(_custom_sdpa(), query, key, value, 0, additive, 0.0, False, args.get("scale"))
    output = edit.call(aten.permute.default, attended, [0, 2, 1, 3])
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
    row and key/value heads that divide the query heads. It reads every key it is given, so it
    gets only the first keys that hold all a query sees: one past the last key the mask marks
    visible, read from the mask at run time (a size bounded by the cache length). A decode step
    then reads the cache's filled slots, not the whole static cache. The mask becomes one
    additive ``[queries, keys]`` mask (0 where visible, the float minimum elsewhere) for every
    layer; query rows that see no key are zeroed afterwards, as eager SDPA gives (the kernel
    would return the values' mean).

    The keys and values are transposed to the kernel's layout. A static cache kept as the
    program's state is laid out that way by the ExecuTorch lowering
    (``state_in_attention_layout``): the kernel then reads the buffer's first rows as they lie and
    each step's new rows are transposed once, when written. A cache passed in
    (``ExecutorchConfig(cache_in_program=False)``) is copied and transposed, its first rows only.

    Only a batch of one: the kernel's single mask cannot hold each row's padding (a program of
    several rows, ``ExecutorchConfig(max_batch_size=...)``, keeps SDPA, counted as missed).
    """,
    remove_when=(
        "For a runtime built without ExecuTorch's LLM custom ops (llama::custom_sdpa): without it, "
        "attention runs as matmuls over the whole cache."
    ),
)
