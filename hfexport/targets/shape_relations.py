"""Conditions on input sizes that an exported program was traced with, read off torch.export's
guards at export time.

torch.export keeps these as Python source (``ExportedProgram._guards_code``) that its own
``module()`` executes; an ONNX or ExecuTorch runtime has no such check and fails deep inside a
kernel (ONNX Runtime's "GatherND ... invalid index") or returns garbage. hfexport records each
guard over input sizes as a small arithmetic expression and evaluates it with its own
interpreter, so a manifest can never make a runner execute code. Two kinds are kept:

- *relations* between the sizes of two or more inputs (``input_ids`` no longer than
  ``attention_mask``), which every runner checks before the runtime runs;
- *conditions* on one axis that its range cannot state (DeepSeek-V4's compressors need one whole
  window of 4 tokens). The trace's conditions are often narrower than what the lowered program
  takes (that program runs any length from 4 on, its guards ask for multiples of 4 from 8), so
  they are not checked up front: when the runtime fails, a failing condition is what the error
  names.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.errors import HfExportError
from hfexport.pipeline.io_names import path_name

_SIZE = re.compile(r"L((?:\['[^']*'\]|\[\d+\]|\.\w+)+)\.size\(\)\[(\d+)\]")
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CALLS = {"min": min, "max": max}
# a one-axis guard is a condition when it fails for a size in the axis's range, probed this far
_PROBED_SIZES = 64
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


def shape_relations(program: torch.export.ExportedProgram) -> list[dict[str, Any]]:
    """``[{"expr": "a0 + ((-1)*a1) <= 0", "axes": {"a0": [path, axis], …}}]``: the program's guards
    that involve the sizes of two or more inputs and nothing else."""
    return [
        {"expr": expr, "axes": axes}
        for expr, axes, _ in _size_guards(program)
        if len({path for path, _ in axes.values()}) >= 2
    ]


def shape_conditions(
    program: torch.export.ExportedProgram, ranges: dict[tuple[str, int], tuple[int | None, int | None]]
) -> list[dict[str, Any]]:
    """The program's guards over the size of one input axis that fail for a size inside that
    axis's range (``ranges``: ``{(path, axis): (min, max)}``, from the input specs); a guard that
    holds throughout only restates the range. Same form as :func:`shape_relations`."""
    return [
        {"expr": expr, "axes": axes}
        for expr, axes, tree in _size_guards(program)
        if len(axes) == 1 and _fails_in_range(tree, ranges.get(tuple(axes["a0"])))
    ]


def _size_guards(program: torch.export.ExportedProgram) -> list[tuple[str, dict[str, list[Any]], ast.AST]]:
    """``(expression, axes, parsed expression)`` for each of the program's guards over input sizes
    that hfexport's interpreter reads (not strides or values)."""
    _, kwargs = program.example_inputs or ((), {})
    keys = {"L" + pytree.keystr(path): path_name(path) for path, _ in pytree.tree_flatten_with_path(kwargs)[0]}
    found = []
    for guard in getattr(program, "_guards_code", None) or ():
        axes: dict[str, list[Any]] = {}

        def name_axis(match: re.Match[str], axes: dict[str, list[Any]] = axes) -> str:
            path = keys.get("L" + match.group(1))
            if path is None:
                return match.group(0)  # not an input the manifest knows: the guard stays unparsable
            entry = [path, int(match.group(2))]
            for name, known in axes.items():
                if known == entry:
                    return name
            axes[f"a{len(axes)}"] = entry
            return f"a{len(axes) - 1}"

        expr = _SIZE.sub(name_axis, guard)
        try:
            tree = ast.parse(expr, mode="eval").body
            _evaluate(tree, dict.fromkeys(axes, 1))
        except (SyntaxError, ValueError, ArithmeticError):
            continue
        found.append((expr, axes, tree))
    return found


def guards_hold(program: torch.export.ExportedProgram, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether every guard of ``program`` is one hfexport reads and holds for ``shapes``
    (``{path: shape}``); a guard over anything else (strides, values, another input) is False."""
    guards = list(getattr(program, "_guards_code", None) or ())
    readable = _size_guards(program)
    if len(readable) != len(guards):
        return False
    for _, axes, tree in readable:
        sizes = {}
        for name, (path, axis) in axes.items():
            shape = shapes.get(path)
            if shape is None or axis >= len(shape):
                return False
            sizes[name] = int(shape[axis])
        try:
            if not _evaluate(tree, sizes):
                return False
        except (ValueError, ArithmeticError):
            return False
    return True


def _fails_in_range(tree: ast.AST, bounds: tuple[int | None, int | None] | None) -> bool:
    if bounds is None or bounds[0] is None:
        return False
    low, high = bounds
    last = low + _PROBED_SIZES if high is None else min(high, low + _PROBED_SIZES)
    for size in range(max(low, 0), last + 1):
        try:
            if not _evaluate(tree, {"a0": size}):
                return True
        except ArithmeticError:
            return True
    return False


def check_shape_relations(relations: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise :class:`HfExportError` naming the inputs if ``shapes`` (``{path: shape}``) break one of
    ``relations``."""
    broken = first_broken(relations, shapes)
    if broken:
        raise HfExportError(
            f"the inputs break a size relation the program was exported with: {broken}; give inputs whose sizes "
            "agree as in the export sample"
        )


def first_broken(relations: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]) -> str:
    """``"<expression over input shapes> does not hold for <sizes>"`` for the first of
    ``relations`` or conditions that ``shapes`` (``{path: shape}``) break; ``""`` if none."""
    for relation in relations:
        sizes = {}
        for name, (path, axis) in relation["axes"].items():
            shape = shapes.get(path)
            if shape is None or axis >= len(shape):
                break
            sizes[name] = int(shape[axis])
        else:
            try:
                holds = _evaluate(ast.parse(relation["expr"], mode="eval").body, sizes)
            except (SyntaxError, ValueError, ArithmeticError):
                continue
            if not holds:
                readable = relation["expr"]
                for name in sorted(relation["axes"], key=len, reverse=True):
                    path, axis = relation["axes"][name]
                    readable = re.sub(rf"\b{name}\b", f"{path}.shape[{axis}]", readable)
                values = ", ".join(f"{path}.shape[{axis}] = {sizes[n]}" for n, (path, axis) in relation["axes"].items())
                return f"{readable} does not hold for {values}"
    return ""


def _evaluate(node: ast.AST, sizes: dict[str, int]) -> Any:
    """Integer arithmetic (``min``, ``max``, small powers and ``torch.sym_float`` too), comparisons
    and ``and``/``or`` over named sizes; anything else is a ValueError (the expression comes from a
    file: nothing in it is executed)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in sizes:
        return sizes[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, sizes)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left, sizes), _evaluate(node.right, sizes))
    if (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Pow)
        and isinstance(node.right, (ast.Constant, ast.UnaryOp))
        and abs(exponent := _evaluate(node.right, sizes)) <= 4
    ):
        base = _evaluate(node.left, sizes)
        if base <= 0:
            raise ValueError("a power of a size that is not positive")
        return base**exponent  # an attention scale, n ** -0.5
    if (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "torch.sym_float"
        and len(node.args) == 1
        and not node.keywords
    ):
        return float(_evaluate(node.args[0], sizes))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS and not node.keywords:
        return _CALLS[node.func.id](*(_evaluate(arg, sizes) for arg in node.args))
    if isinstance(node, ast.BoolOp):
        values = [_evaluate(value, sizes) for value in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _evaluate(node.left, sizes)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(comparator, sizes)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    raise ValueError(f"unsupported expression: {ast.dump(node)[:80]}")
