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


@register_pass(
    name="rotate_half_as_linear",
    remove_when=(
        "Without it, rotary embedding's slices of a dynamic axis stay out of XNNPACK, splitting each "
        "layer's delegated graph."
    ),
)
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


def _is_complex(value: Any) -> bool:
    value = value.meta.get("val") if isinstance(value, Node) else None
    return isinstance(value, torch.Tensor) and value.is_complex()


def _real_axis(dim: int) -> int:
    """A complex tensor's axis in its real form (a trailing axis of 2 added): negative axes shift."""
    return dim if dim >= 0 else dim - 1


class _ComplexAsReal:
    """Each complex node of a graph as a real node with a trailing axis of (real, imaginary), the
    layout of ``view_as_real``."""

    OPS = (
        aten.polar.default,
        aten.view_as_complex.default,
        aten.view_as_real.default,
        aten.mul.Tensor,
        aten.slice.Tensor,
        aten.unsqueeze.default,
    )

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph
        self.real: dict[Node, Node] = {}

    def parts(self, edit: GraphEditor, node: Node) -> tuple[Node, Node]:
        pair = self.real[node]
        return edit.call(aten.select.int, pair, -1, 0), edit.call(aten.select.int, pair, -1, 1)

    def rewrite(self, node: Node) -> Node | None:
        """The real form of ``node``'s result (``None`` for ``view_as_real``, whose users get its input's)."""
        edit = GraphEditor(self.graph, node)
        args = arguments(node)
        if node.target is aten.view_as_complex.default:
            return args["self"]
        if node.target is aten.view_as_real.default:
            node.replace_all_uses_with(self.real[args["self"]])
            return None
        if node.target is aten.polar.default:
            magnitude, angle = args["abs"], args["angle"]
            real = edit.call(aten.mul.Tensor, magnitude, edit.call(aten.cos.default, angle))
            imaginary = edit.call(aten.mul.Tensor, magnitude, edit.call(aten.sin.default, angle))
            return edit.call(aten.stack.default, [real, imaginary], -1)
        if node.target is aten.slice.Tensor:
            rest = [args.get("start"), args.get("end"), args.get("step", 1)]
            return edit.call(aten.slice.Tensor, self.real[args["self"]], _real_axis(args.get("dim", 0)), *rest)
        if node.target is aten.unsqueeze.default:
            return edit.call(aten.unsqueeze.default, self.real[args["self"]], _real_axis(args["dim"]))
        a, b = args["self"], args["other"]
        if _is_complex(a) and _is_complex(b):
            (ar, ai), (br, bi) = self.parts(edit, a), self.parts(edit, b)

            def product(x: Node, y: Node) -> Node:
                return edit.call(aten.mul.Tensor, x, y)

            real = edit.call(aten.sub.Tensor, product(ar, br), product(ai, bi))
            imaginary = edit.call(aten.add.Tensor, product(ar, bi), product(ai, br))
            return edit.call(aten.stack.default, [real, imaginary], -1)
        pair, scale = (self.real[a], b) if _is_complex(a) else (self.real[b], a)
        if isinstance(scale, Node):  # a real tensor scales both parts
            scale = edit.call(aten.unsqueeze.default, scale, -1)
        return edit.call(aten.mul.Tensor, pair, scale)


@register_pass(
    name="complex_as_real",
    remove_when=(
        "Only for Dynamo: ONNX has no complex tensors and ExecuTorch's edge dialect takes no "
        "view_as_complex, so a complex op left in fails the lowering."
    ),
)
def complex_as_real(program: Any) -> PassResult:
    """Rewrite complex arithmetic (Llama 4's rotary embedding: ``polar``, ``view_as_complex``, a
    complex product, ``view_as_real``) as the same arithmetic on (real, imaginary) pairs in a
    trailing axis. ONNX has no complex tensors (torch.onnx: "No decompositions registered for the
    complex-valued input") and ExecuTorch's edge dialect cannot take ``view_as_complex``. A graph
    with a complex op this pass does not know is left as it is."""
    graph = program.graph
    touched = [
        n
        for n in graph.nodes
        if n.op == "call_function" and (_is_complex(n) or any(_is_complex(a) for a in n.all_input_nodes))
    ]
    if not touched or any(n.target not in _ComplexAsReal.OPS for n in touched):
        return PassResult(program, modified=False, counts={"rewritten": 0})
    rewriter = _ComplexAsReal(graph)
    for node in touched:
        real = rewriter.rewrite(node)
        if real is not None:
            rewriter.real[node] = real
    for node in reversed(touched):
        if not node.users:
            graph.erase_node(node)
    program.graph_module.recompile()
    return PassResult(program, modified=True, counts={"rewritten": len(touched)})
