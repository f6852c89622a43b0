"""Attention rewrites."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

from hfexport.pipeline.graph_edit import SLICE_TO_END, GraphEditor, add_constant, arguments, replace_node
from hfexport.pipeline.pass_manager import PassResult, register_pass
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
    remove_when=(
        "Without it, a query row whose mask hides every key gets the runtime kernel's values (NaN or "
        "an average) instead of eager's zeros."
    ),
)


def _strip_full_slices(node: Any) -> Any:
    while (
        isinstance(node, Node)
        and node.op == "call_function"
        and node.target is aten.slice.Tensor
        and _is_full_slice(node)
    ):
        node = node.args[0]
    return node


def _is_full_slice(node: Node) -> bool:
    args = arguments(node)
    start, end, step = args.get("start", 0), args.get("end"), args.get("step", 1)
    if start not in (0, None) or step != 1:
        return False
    if end is None or (isinstance(end, int) and end >= SLICE_TO_END):
        return True
    size = args["self"].meta["val"].shape[args.get("dim", 0)]
    return isinstance(end, int) and isinstance(size, int) and end >= size


def _repeated_kv(node: Any) -> tuple[Node, int] | None:
    """``(kv, groups)`` when ``node`` is transformers' ``repeat_kv(kv, groups)``: a reshape to
    ``[batch, heads * groups, length, dim]`` of ``kv[:, :, None]`` expanded over the groups."""
    if not (isinstance(node, Node) and node.target in (aten.reshape.default, aten.view.default)):
        return None
    expand = node.args[0]
    if not (isinstance(expand, Node) and expand.target is aten.expand.default):
        return None
    unsqueezed = _strip_full_slices(expand.args[0])
    if not (isinstance(unsqueezed, Node) and unsqueezed.target is aten.unsqueeze.default and unsqueezed.args[1] == 2):
        return None
    kv = _strip_full_slices(unsqueezed.args[0])
    groups = expand.meta["val"].shape[2]
    if kv.meta["val"].dim() != 4 or not isinstance(groups, int) or groups < 2:
        return None
    return kv, groups


def _kv_heads(node: Node) -> tuple[tuple[Node, int] | None, tuple[Node, int] | None]:
    """The ``(kv, groups)`` of an SDPA's keys and of its values: under ``repeat_kv``, or read by
    SDPA's own ``enable_gqa`` (query heads a multiple of the key/value heads)."""
    args = arguments(node)
    if not args.get("enable_gqa"):
        return _repeated_kv(args["key"]), _repeated_kv(args["value"])
    heads = args["query"].meta["val"].shape[1]
    grouped = []
    for kv in (args["key"], args["value"]):
        kv_heads = kv.meta["val"].shape[1]
        ok = isinstance(heads, int) and isinstance(kv_heads, int) and heads > kv_heads and heads % kv_heads == 0
        grouped.append((kv, heads // kv_heads) if ok else None)
    return grouped[0], grouped[1]


def _is_grouped_sdpa(node: Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is aten.scaled_dot_product_attention.default
        and _kv_heads(node)[0] is not None
    )


def _check_grouped(node: Node) -> str | None:
    args = arguments(node)
    key, value = _kv_heads(node)
    if value is None or key[1] != value[1]:
        return "keys and values are not repeated alike"
    if args.get("is_causal") or args.get("dropout_p", 0.0):
        return "causal or dropout SDPA"
    mask = args.get("attn_mask")
    if mask is not None and (mask.meta["val"].dim() != 4 or mask.meta["val"].shape[1] != 1):
        return "the mask is not [batch, 1, queries, keys]"
    return None


def _size(edit: GraphEditor, node: Node, dim: int) -> Any:
    size = node.meta["val"].shape[dim]
    return size if isinstance(size, int) else edit.call(aten.sym_size.int, node, dim)


_GROUPED_MASK = "hfexport.grouped_mask_of"  # meta of the reshape that repeats a mask's rows


def _grouped_mask(edit: GraphEditor, mask: Node, groups: int, query: Node) -> Node:
    """Each group's rows see the mask's rows: ``[b, 1, q, k]`` → ``[b, 1, groups * q, k]``, made once
    per mask and shared by every layer that attends with it."""
    for user in mask.users:
        for grouped in _users_chain(user):
            if grouped.meta.get(_GROUPED_MASK) == groups:
                return grouped
    rows = edit.call(aten.unsqueeze.default, mask, 2)
    rows = edit.call(aten.expand.default, rows, [-1, -1, groups, _size(edit, query, 2), -1])
    grouped = edit.call(aten.reshape.default, rows, [_size(edit, mask, 0), 1, -1, _size(edit, mask, 3)])
    grouped.meta[_GROUPED_MASK] = groups
    return grouped


def _users_chain(node: Node, depth: int = 3) -> list[Node]:
    chain = [node]
    while depth and len(chain[-1].users) == 1:
        chain.append(next(iter(chain[-1].users)))
        depth -= 1
    return chain


def _rewrite_grouped(graph: Graph, node: Node) -> None:
    args = arguments(node)
    query, mask = args["query"], args.get("attn_mask")
    (key, groups), (value, _) = _kv_heads(node)
    edit = GraphEditor(graph, node)
    batch, heads, dim = _size(edit, query, 0), query.meta["val"].shape[1], query.meta["val"].shape[3]
    kv_heads = heads // groups
    # query head h reads kv head h // groups: [b, kv, groups, q, d] → [b, kv, groups * q, d]
    grouped_query = edit.call(aten.reshape.default, query, [batch, kv_heads, -1, dim])
    grouped_mask = None if mask is None else _grouped_mask(edit, mask, groups, query)
    kwargs = {"attn_mask": grouped_mask}
    if args.get("scale") is not None:
        kwargs["scale"] = args["scale"]
    attention = edit.call(aten.scaled_dot_product_attention.default, grouped_query, key, value, **kwargs)
    output = edit.call(aten.reshape.default, attention, [batch, heads, -1, dim])
    node.replace_all_uses_with(output)
    graph.erase_node(node)


grouped_query_attention = rule_pass(
    "grouped_query_attention",
    [RewriteRule("attend_per_kv_head", _is_grouped_sdpa, _check_grouped, _rewrite_grouped)],
    runs_before=("dead_code_elimination", "zero_fully_masked_attention_rows"),
    description="""Attend over each key/value head once instead of over copies of it: SDPA over
    transformers' ``repeat_kv`` keys and values (each KV head expanded to the query heads that share
    it), or SDPA with ``enable_gqa`` (how hfexport captures transformers' attention: the
    ``sdpa_grouped_query_attention`` patch), becomes plain SDPA of ``[batch, kv_heads, groups *
    queries, dim]`` queries over the KV heads themselves, with the mask's rows repeated per group
    once for all layers (the query rows are few; the cache is long).

    On targets that materialise the expansion (ExecuTorch's portable ``expand_copy`` and
    ``view_copy``, ONNX ``Expand``) this saves copying every layer's whole KV cache ``groups``
    times per decode step. The same products and sums are computed, so results match to rounding.
    """,
    remove_when=(
        "Without it, the runtimes materialise transformers' repeat_kv copies: every layer's key/value "
        "cache copied per group on every step."
    ),
)


_MASK_FORMS = "hfexport.attention_mask_forms"  # meta of a boolean mask: its (additive, visible) nodes


def mask_forms(edit: GraphEditor, mask: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A boolean mask as an additive one (0 where visible, the dtype's minimum elsewhere) and the
    rows that see any key (1.0 / 0.0), made once per mask, at its first attention."""
    if _MASK_FORMS not in mask.meta:
        additive = edit.call(aten.where.Scalar, mask, 0.0, torch.finfo(dtype).min)
        if additive.meta["val"].dtype != dtype:
            additive = edit.call(aten._to_copy.default, additive, dtype=dtype)
        visible = edit.call(aten._to_copy.default, edit.call(aten.any.dim, mask, -1, True), dtype=dtype)
        mask.meta[_MASK_FORMS] = (additive, visible)
    return mask.meta[_MASK_FORMS]


@register_pass(
    name="attention_as_matmuls",
    runs_after=("grouped_query_attention",),
    remove_when=(
        "Without it, ExecuTorch decomposes SDPA into ops XNNPACK refuses (portable kernels between "
        "delegated graphs), and each layer converts the boolean mask again."
    ),
)
def attention_as_matmuls(program: Any) -> PassResult:
    """Rewrite SDPA with a boolean mask (or none) as ``softmax(q @ kᵀ · scale + mask) @ v``.

    ExecuTorch decomposes SDPA itself, per layer: the boolean mask to an additive one, both
    inputs scaled by ``√scale`` (``mul.Scalar``), and a "safe" softmax that zeroes fully masked
    rows (``eq``, ``logical_not``, ``any``, ``full_like``, ``where``), about ten portable kernels
    per layer that split its delegated graph. Here the mask is converted once for all layers,
    the scale multiplies the scores (``mul.Tensor``, which XNNPACK takes) and fully masked rows
    are zeroed by multiplying with the rows that see a key (1.0 / 0.0), computed once: eager's
    semantics, with the dtype's minimum instead of -inf so such rows stay finite until zeroed.

    torch.onnx's SDPA scales both the queries and the keys by ``√scale`` (a pass over every
    layer's whole key cache per decode step) and reshapes the keys around their transpose; as
    matmuls, ONNX Runtime fuses the keys' transpose and the scale into one ``FusedMatMul``.
    """
    rewritten = 0
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        args = arguments(node)
        query, key, value, mask = args["query"], args["key"], args["value"], args.get("attn_mask")
        if args.get("is_causal") or args.get("dropout_p", 0.0) or args.get("enable_gqa"):
            continue
        if mask is not None and mask.meta["val"].dtype != torch.bool:
            continue
        dtype = query.meta["val"].dtype
        scale = args.get("scale") or query.meta["val"].shape[-1] ** -0.5
        edit = GraphEditor(program.graph, node)
        forms = None if mask is None else mask_forms(edit, mask, dtype)
        scores = edit.call(aten.matmul.default, query, edit.call(aten.transpose.int, key, -2, -1))
        scale_tensor = add_constant(program, f"hfexport_attention_scale_{node.name}", torch.tensor(scale, dtype=dtype))
        scores = edit.call(aten.mul.Tensor, scores, scale_tensor)
        if forms is not None:
            scores = edit.call(aten.add.Tensor, scores, forms[0])
        output = edit.call(aten.matmul.default, edit.call(aten._softmax.default, scores, -1, False), value)
        if forms is not None:
            output = edit.call(aten.mul.Tensor, output, forms[1])
        replace_node(program, node, output)
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return PassResult(program, modified=rewritten > 0, counts={"rewritten": rewritten})
