"""The input-axes table of a capture: every axis of every input tensor, dynamic with its range or
static, and whether the user asked it to be dynamic; an axis asked dynamic that came out static is
reported once per input, saying why."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.utils._sympy.numbers import int_oo

from hfexport.pipeline.io_names import path_name, program_io_names

logger = logging.getLogger("hfexport")


@dataclass
class InputAxis:
    """One axis of one input tensor after capture."""

    input: str
    axis: int
    size: int
    dynamic: bool
    requested_dynamic: bool
    min: int | None = None
    max: int | None = None
    dim: str = ""  # the dynamic axis's size in the program's symbols ("s27"): axes with one dim agree

    def describe(self) -> str:
        if self.dynamic:
            upper = "inf" if self.max is None else self.max
            return f"dynamic [{self.min}, {upper}]"
        return f"static {self.size}" + (" (asked dynamic: specialised)" if self.requested_dynamic else "")


def _requested_axes(dynamic_shapes: Any, inputs: dict[str, Any]) -> dict[str, set[int]]:
    """For each top-level input name, the axes the user asked to be dynamic."""
    requested: dict[str, set[int]] = {}
    if not isinstance(dynamic_shapes, Mapping):
        return requested
    for name, spec in dynamic_shapes.items():
        if isinstance(spec, Mapping) and all(isinstance(axis, int) for axis in spec):
            items = spec.items()
        elif isinstance(spec, (list, tuple)) and isinstance(inputs.get(name), torch.Tensor):
            items = enumerate(spec)
        else:
            continue
        requested[name] = {int(axis) for axis, dim in items if dim is not None and dim is not torch.export.Dim.STATIC}
    return requested


def input_axes(program: torch.export.ExportedProgram, inputs: dict[str, Any], dynamic_shapes: Any) -> list[InputAxis]:
    """Every axis of every input tensor: dynamic with its range, or static; and whether the user
    asked it to be dynamic."""
    requested = _requested_axes(dynamic_shapes, inputs)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    by_name = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    user_placeholders = [
        n for n in placeholders if by_name[n.name].kind == torch.export.graph_signature.InputKind.USER_INPUT
    ]
    # torch.export orders user inputs by forward's signature, not by the inputs dict: match by name.
    leaves = {path_name(path): (path, leaf) for path, leaf in pytree.tree_flatten_with_path(inputs)[0]}
    table = []
    for name, placeholder in zip(program_io_names(program)[0], user_placeholders, strict=False):
        path, leaf = leaves.get(name, ((), None))
        if not isinstance(leaf, torch.Tensor):
            continue
        fake = placeholder.meta.get("val")
        for axis, size in enumerate(fake.shape if isinstance(fake, torch.Tensor) else leaf.shape):
            # a SymInt the shape solver reduced to a constant is static
            dynamic = isinstance(size, torch.SymInt) and not size.node.expr.is_number
            row = InputAxis(
                input=name,
                axis=axis,
                size=int(leaf.shape[axis]),
                dynamic=dynamic,
                requested_dynamic=len(path) == 1 and axis in requested.get(name, ()),
            )
            if dynamic:
                bounds = program.range_constraints.get(size.node.expr)
                row.dim = str(size.node.expr)
                if bounds is not None:
                    row.min = int(bounds.lower)
                    row.max = None if bounds.upper in (int_oo, sympy.oo) else int(bounds.upper)
            table.append(row)
    return table


def warn_fixed_axes(table: list[Any]) -> None:
    """One warning per input whose axes were asked to be dynamic and came out fixed, saying why."""
    fixed: dict[str, list[Any]] = {}
    for row in table:
        if row.requested_dynamic and not row.dynamic:
            fixed.setdefault(row.input, []).append(row)
    for name, rows in fixed.items():
        why = (
            "torch.export fixes axes of size 0 and 1: export from a sample where each is larger than 1"
            if all(row.size <= 1 for row in rows)
            else "the model's code fixed them while tracing (a size it checks or a Python loop over a size, such "
            "as Mamba's sequential scan); TORCH_LOGS=+dynamic shows where"
        )
        axes = ", ".join(str(row.axis) for row in rows)
        sizes = ", ".join(str(row.size) for row in rows)
        logger.warning(
            "input %r: axes %s were asked to be dynamic, but the program takes only the sample's sizes %s: %s",
            name,
            axes,
            sizes,
            why,
        )
