"""The dynamic-shape policy of a capture: the ``dynamic_shapes`` of ``dynamic=True`` (every axis
``Dim.AUTO``), and the upper bounds (:class:`AxisBounds`) that targets planning memory for the largest
shape need on axes a capture would leave unbounded."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.dynamic_shapes import _DimHint, _DimHintType
from torch.utils._sympy.numbers import int_oo

logger = logging.getLogger("hfexport")


@dataclass(frozen=True)
class AxisBounds:
    """Upper bounds for the dynamic axes a capture would leave unbounded: ``batch`` for axis 0,
    ``other`` for every other axis; ``source`` says who asked for them and why (logs, reports).
    Targets that plan memory for the largest shape (ExecuTorch) need them."""

    batch: int
    other: int
    source: str
    widenable: bool = False  # a default nobody asked for: capture widens ``other`` for a longer sample

    def __call__(self, axis: int) -> int:
        return self.batch if axis == 0 else self.other

    def tightest(self, other: AxisBounds | None) -> AxisBounds:
        """The bounds that satisfy both (the smaller of each)."""
        if other is None:
            return self
        return AxisBounds(
            min(self.batch, other.batch),
            min(self.other, other.other),
            f"{self.source}; {other.source}",
            self.widenable and other.widenable,
        )

    def counts(self) -> dict[str, int]:
        return {"max_batch_size": self.batch, "max_seq_len": self.other}

    def describe(self) -> str:
        return f"unbounded batch axes <= {self.batch}, other unbounded dynamic axes <= {self.other} ({self.source})"


AxisBound = Callable[[int], int | None]  # axis index -> upper bound (None: unbounded)


def auto_dynamic_shapes(
    inputs: dict[str, Any], axis_bound: AxisBound | None = None, static_axes: Mapping[str, set[int]] | None = None
) -> Any:
    """``dynamic_shapes`` marking every axis of every input tensor ``Dim.AUTO`` (bounded above by
    ``axis_bound(axis)`` when given), except the ``static_axes`` of top-level inputs (a tensor, or
    each tensor of a dict or of a cache).

    torch.export expects a registered custom pytree node (a cache) to be described by the list of
    its children's specs, so those are expanded one level at a time.
    """

    def hint(axis: int, size: int) -> Any:
        upper = axis_bound(axis) if axis_bound else None
        if upper is not None and upper <= size == 1:
            return torch.export.Dim.STATIC  # one size left (torch.export refuses Dim.AUTO(max=1))
        # never below the sample: an axis the model fixes (a channel count) may exceed the bound
        return torch.export.Dim.AUTO if upper is None else torch.export.Dim.AUTO(max=max(upper, size))

    def axes(value: Any, in_node: bool = False) -> Any:
        if isinstance(value, torch.Tensor):
            return {axis: hint(axis, size) for axis, size in enumerate(value.shape)}
        if type(value) is int and in_node:
            # an int inside a custom node (a dynamic cache layer's token counter) grows with the
            # sequence: symbolic, or the program only takes the sample's count
            return torch.export.Dim.AUTO
        if type(value) is dict:  # ModelOutput subclasses dict but is a custom node: see below
            return {key: axes(item, in_node) for key, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(axes(item, in_node) for item in value)
        node = pytree.SUPPORTED_NODES.get(type(value))
        if node is not None:
            children, _ = node.flatten_fn(value)
            return [axes(child, True) for child in children]
        return None

    def without(spec: Any, fixed: set[int]) -> Any:
        if isinstance(spec, dict) and not any(isinstance(item, (dict, list, tuple)) for item in spec.values()):
            return {axis: dim for axis, dim in spec.items() if axis not in fixed}  # one tensor's axes
        if isinstance(spec, dict):  # a dict of tensors (per-layer-type masks, an SSM layer's {state: tensor})
            return {key: without(item, fixed) for key, item in spec.items()}
        if isinstance(spec, list):  # a cache's children
            return [without(item, fixed) for item in spec]
        return spec

    shapes = {name: axes(value) for name, value in inputs.items()}
    for name, fixed in (static_axes or {}).items():
        if name in shapes:
            shapes[name] = without(shapes[name], fixed)
    return shapes


def bound_dynamic_shapes(dynamic_shapes: Any, axis_bound: AxisBound) -> Any:
    """Explicit ``dynamic_shapes`` with every ``Dim`` / ``Dim.AUTO`` lacking an upper bound given
    ``axis_bound(axis)``; bounded and derived dims are kept. Dims are rebuilt once per name so
    shared dims stay shared."""
    rebuilt: dict[str, Any] = {}

    def bound(axis: int, dim: Any) -> Any:
        upper = axis_bound(axis)
        if upper is None or dim is None:
            return dim
        if isinstance(dim, _DimHint):
            if dim.type is _DimHintType.STATIC or dim.max is not None:
                return dim
            return getattr(torch.export.Dim, dim.type.name)(min=dim.min, max=upper)
        if type(dim) is torch.export.Dim and dim.max == int_oo:  # derived dims are other types
            if dim.__name__ not in rebuilt:
                rebuilt[dim.__name__] = torch.export.Dim(dim.__name__, min=dim.min, max=max(upper, dim.min + 1))
            return rebuilt[dim.__name__]
        return dim

    def walk(spec: Any) -> Any:
        if isinstance(spec, Mapping) and all(isinstance(k, int) for k in spec):
            return {axis: bound(axis, dim) for axis, dim in spec.items()}
        if isinstance(spec, Mapping):
            return {key: walk(value) for key, value in spec.items()}
        if isinstance(spec, (list, tuple)) and any(isinstance(s, (_DimHint, torch.export.Dim)) for s in spec):
            return type(spec)(bound(axis, dim) for axis, dim in enumerate(spec))
        if isinstance(spec, (list, tuple)):
            return type(spec)(walk(s) for s in spec)
        return spec

    return walk(dynamic_shapes)


# 2-D [batch, tokens] inputs (position ids are not always: rope sections, a vision encoder's patches)
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "decoder_input_ids")


def widened_for_sample(inputs: dict[str, Any], bounds: AxisBounds) -> AxisBounds:
    """``bounds`` with ``other`` raised to twice the sample's longest token axis when that is
    longer and the bound is a default nobody asked for (an audio model's samples outnumber a text
    model's tokens); said in one warning."""
    longest = max(
        (v.shape[1] for n, v in inputs.items() if n in TOKEN_INPUTS and isinstance(v, torch.Tensor) and v.dim() == 2),
        default=0,
    )
    if not bounds.widenable or longest <= bounds.other:
        return bounds
    widened = dataclasses.replace(
        bounds, other=2 * longest, source=f"twice the sample's {longest} (over {bounds.source})"
    )
    logger.warning(
        "the sample is %d long, above the default bound %d (%s): the program takes up to %d; set max_seq_len for "
        "longer inputs",
        longest,
        bounds.other,
        bounds.source,
        widened.other,
    )
    return widened
