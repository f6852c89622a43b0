"""Rotary position embedding rewrites."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from hfexport.pipeline.graph_edit import SLICE_TO_END, GraphEditor, add_constant, arguments, replace_node
from hfexport.pipeline.pass_manager import PassResult, register_pass

aten = torch.ops.aten


def _last_axis_slice(node: Any, rank: int) -> tuple[Node, int, int] | None:
    """``(x, start, end)`` when ``node`` slices ``x``'s last axis with step 1 (``end`` clipped to its size)."""
    if not (isinstance(node, Node) and node.op == "call_function" and node.target is aten.slice.Tensor):
        return None
    args = arguments(node)
    x = args["self"]
    size = x.meta["val"].shape[-1]
    dim = args.get("dim", 0)
    if dim not in (-1, rank - 1) or args.get("step", 1) != 1 or not isinstance(size, int):
        return None
    start, end = args.get("start") or 0, args.get("end")
    end = size if end is None or (isinstance(end, int) and end >= SLICE_TO_END) else end
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    return x, start, min(end, size)


def _rotated_half(node: Node) -> Node | None:
    """``x`` when ``node`` is transformers' ``rotate_half(x)``: ``cat((-x[..., h:], x[..., :h]), -1)``."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = node.meta["val"].dim()
    if len(parts) != 2 or dim not in (-1, rank - 1):
        return None
    negated, second = parts
    if not (isinstance(negated, Node) and negated.target is aten.neg.default):
        return None
    upper, lower = _last_axis_slice(negated.args[0], rank), _last_axis_slice(second, rank)
    if upper is None or lower is None or upper[0] is not lower[0]:
        return None
    size = upper[0].meta["val"].shape[-1]
    half = size // 2
    if size % 2 or upper[1:] != (half, size) or lower[1:] != (0, half):
        return None
    return upper[0]


def rotate_half_matrix(size: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[size, size]`` linear weight with ``linear(x, w) == rotate_half(x)``: -1 and 1 on two
    half diagonals, so each output is one input (negated or not) plus zeros: exact."""
    half = size // 2
    weight = torch.zeros(size, size, dtype=dtype)
    rows = torch.arange(half)
    weight[rows, rows + half] = -1.0
    weight[rows + half, rows] = 1.0
    return weight


@register_pass(name="rotate_half_as_linear")
def rotate_half_as_linear(program: Any) -> PassResult:
    """Rewrite rotary embedding's ``rotate_half(x)`` (two slices of the last axis, a negation and a
    concatenation) as ``linear(x, w)`` with a constant -1/1 matrix: the same values, exactly.

    XNNPACK does not take slices of a tensor with a dynamic axis (a decode graph's query length),
    so on ExecuTorch each rotary embedding left four portable kernels between delegated graphs
    (two per query and key rotation) and split the layer's delegated work in two; the linear
    is delegated with the rest.
    """
    rewritten = 0
    for node in list(program.graph.nodes):
        x = _rotated_half(node)
        if x is None:
            continue
        value = x.meta["val"]
        edit = GraphEditor(program.graph, node)
        weight = add_constant(
            program, f"hfexport_rotate_half_{node.name}", rotate_half_matrix(value.shape[-1], value.dtype)
        )
        negated, lower = node.args[0]
        replace_node(program, node, edit.call(aten.linear.default, x, weight))
        for dead in (negated, negated.args[0], lower):
            if not dead.users:
                program.graph.erase_node(dead)
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return PassResult(program, modified=rewritten > 0, counts={"rewritten": rewritten})
