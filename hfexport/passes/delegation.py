"""Rewrites that let the XNNPACK delegate take ops it would leave to ExecuTorch's portable kernels.

Every op XNNPACK refuses splits the delegated graph in two: one more delegate call per step, and a
portable kernel between them. In a decoder layer the norms are such ops, so each pass here is
measured by the ``portable_nodes`` and delegated-subgraph counts of the ``delegate`` stage.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.pipeline.graph_edit import GraphEditor, add_constant, arguments
from hfexport.pipeline.pass_manager import PassResult, register_pass

aten = torch.ops.aten


def _last_axis_mean(node: torch.fx.Node) -> int | None:
    """The static size of the last axis when ``node`` is ``mean(x, [-1], keepdim=True)`` of float
    ``x`` with no dtype override, else ``None``."""
    if node.op != "call_function" or node.target is not aten.mean.dim:
        return None
    args = arguments(node)
    value = args["self"].meta["val"]
    dims = args.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if not value.is_floating_point() or args.get("dtype") is not None or not args.get("keepdim", False):
        return None
    if [d % value.dim() for d in dims] != [value.dim() - 1]:
        return None
    size = value.shape[-1]
    return size if isinstance(size, int) else None


@register_pass(name="last_axis_mean_as_linear")
def last_axis_mean_as_linear(program: Any) -> PassResult:
    """Rewrite ``mean(x, -1, keepdim=True)`` over a static last axis of size ``n`` (RMSNorm's
    variance) as ``linear(x, full([1, n], 1/n))``: XNNPACK only takes ``mean`` as a 4-D global
    average pool, so each norm was a portable kernel splitting the delegated layer in three;
    a one-output linear layer it takes. The same sum, in another order: results match to rounding."""
    rewritten = 0
    for node in list(program.graph.nodes):
        size = _last_axis_mean(node)
        if size is None:
            continue
        x = arguments(node)["self"]
        dtype = x.meta["val"].dtype
        # one weight per mean: ExecuTorch fails to unlift a delegate whose constant another
        # delegate also holds ("... is not a buffer")
        weight = add_constant(
            program, f"hfexport_mean_weight_{node.name}", torch.full((1, size), 1 / size, dtype=dtype)
        )
        mean = GraphEditor(program.graph, node).call(aten.linear.default, x, weight)
        node.replace_all_uses_with(mean)
        program.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return PassResult(program, modified=rewritten > 0, counts={"rewritten": rewritten})


_MASK_FORMS = "hfexport.attention_mask_forms"  # meta of a boolean mask: its (additive, visible) nodes


def _mask_forms(edit: GraphEditor, mask: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A boolean mask as an additive one (0 where visible, the dtype's minimum elsewhere) and the
    rows that see any key (1.0 / 0.0), made once per mask, at its first attention."""
    if _MASK_FORMS not in mask.meta:
        additive = edit.call(aten.where.Scalar, mask, 0.0, torch.finfo(dtype).min)
        if additive.meta["val"].dtype != dtype:
            additive = edit.call(aten._to_copy.default, additive, dtype=dtype)
        visible = edit.call(aten._to_copy.default, edit.call(aten.any.dim, mask, -1, True), dtype=dtype)
        mask.meta[_MASK_FORMS] = (additive, visible)
    return mask.meta[_MASK_FORMS]


@register_pass(name="attention_as_matmuls", runs_after=("grouped_query_attention",))
def attention_as_matmuls(program: Any) -> PassResult:
    """Rewrite SDPA with a boolean mask (or none) as ``softmax(q @ kᵀ · scale + mask) @ v``.

    ExecuTorch decomposes SDPA itself, per layer: the boolean mask to an additive one, both
    inputs scaled by ``√scale`` (``mul.Scalar``), and a "safe" softmax that zeroes fully masked
    rows (``eq``, ``logical_not``, ``any``, ``full_like``, ``where``), about ten portable kernels
    per layer that split its delegated graph. Here the mask is converted once for all layers,
    the scale multiplies the scores (``mul.Tensor``, which XNNPACK takes) and fully masked rows
    are zeroed by multiplying with the rows that see a key (1.0 / 0.0), computed once: eager's
    semantics, with the dtype's minimum instead of -inf so such rows stay finite until zeroed.
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
        forms = None if mask is None else _mask_forms(edit, mask, dtype)
        scores = edit.call(aten.matmul.default, query, edit.call(aten.transpose.int, key, -2, -1))
        scale_tensor = add_constant(program, f"hfexport_attention_scale_{node.name}", torch.tensor(scale, dtype=dtype))
        scores = edit.call(aten.mul.Tensor, scores, scale_tensor)
        if forms is not None:
            scores = edit.call(aten.add.Tensor, scores, forms[0])
        output = edit.call(aten.matmul.default, edit.call(aten._softmax.default, scores, -1, False), value)
        if forms is not None:
            output = edit.call(aten.mul.Tensor, output, forms[1])
        node.replace_all_uses_with(output)
        program.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return PassResult(program, modified=rewritten > 0, counts={"rewritten": rewritten})
