"""Feeding a saved program by name: what every target's runner shares.

A caller passes the model's keyword inputs (tensors, caches); they are flattened to their keyword
paths (``cache.layers.0.keys``) and matched by name against the component's
:class:`~hfexport.targets.manifest.InputSpec` list, whatever the dict's order. A missing or an
unknown input, a dtype other than the exported one, a wrong rank, a size other than the exported one
on a static axis, or a size outside a dynamic axis's exported range (below its minimum, such as an
empty sequence, or above its maximum) is an :class:`~hfexport.HfExportError` naming the input and
the axis, before the runtime sees it, as is a pair of axes that share one dimension of the program
(``input_ids`` and ``attention_mask`` along the sequence) with different sizes, or sizes that break
a relation torch.export recorded between them (:mod:`hfexport.targets.shape_relations`). When the
runtime itself fails, :meth:`Runner.runtime_failure` makes its error one line that names the
inputs' shapes and, where one fails, the shape condition the program was traced with.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.errors import HfExportError
from hfexport.models.per_image import pieces_by_path
from hfexport.pipeline.io_names import path_name
from hfexport.targets.manifest import ComponentSpec, InputSpec
from hfexport.targets.shape_relations import check_shape_relations, first_broken


def flat_inputs(inputs: Any) -> dict[str, Any]:
    """``{keyword path: leaf}`` of the model's keyword inputs (caches flattened)."""
    from hfexport.models.caches import register_cache_pytrees
    from hfexport.models.frontend import normalize_inputs

    register_cache_pytrees()
    leaves = pytree.tree_flatten_with_path(normalize_inputs(inputs, renames=True))[0]
    return {path_name(path): leaf for path, leaf in leaves}


class Runner:
    """Base of the targets' runners: matches inputs by name against ``spec``."""

    def __init__(self, spec: ComponentSpec) -> None:
        self.spec = spec

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.spec.fed]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.spec.returned]

    def by_path(self, outputs: list[Any]) -> dict[str, Any]:
        """``outputs`` (the program's returned outputs, in its order) by keyword path; a write-back
        under the path of the input it updates (so it wins over another output of that path)."""
        returned = self.spec.returned
        if len(outputs) != len(returned):
            raise HfExportError(
                f"the program returned {len(outputs)} outputs but its manifest lists {len(returned)}; export again"
            )
        found = {o.path: value for o, value in zip(returned, outputs, strict=True) if o.kind != "write_back"}
        found.update({o.writes: value for o, value in zip(returned, outputs, strict=True) if o.kind == "write_back"})
        return pieces_by_path(found)

    def ordered(self, inputs: Any, state_given: bool = False) -> list[tuple[InputSpec, Any]]:
        """``(spec, value)`` for every fed input, in the program's order, each checked. An input the
        program keeps as its state is refused (the program would not read it), unless
        ``state_given``: then it is left out."""
        flat = flat_inputs(inputs)
        state = [i.path for i in self.spec.inputs if i.state and i.path in flat]
        if state and not state_given:
            raise HfExportError(
                f"the program keeps {', '.join(state[:3])}{' …' if len(state) > 3 else ''} inside as its state "
                "and does not take it as an input; pass the inputs without it (the cache object's other "
                "leaves, such as its token counters, are still fed), decode with hfexport.load(DIR), or export "
                "with ExecutorchConfig(cache_in_program=False) to pass the cache in"
            )
        known = {i.path for i in self.spec.inputs}
        unknown = [path for path in flat if path not in known]
        if unknown:
            raise HfExportError(
                f"unknown input(s) {unknown}: the program takes {', '.join(self.input_names)}. "
                "Pass the same keyword inputs (and cache structure) as the export sample."
            )
        missing = [i.path for i in self.spec.fed if i.path not in flat]
        if missing:
            raise HfExportError(
                f"missing input(s) {missing}: the program takes {', '.join(self.input_names)}. "
                "Pass the same keyword inputs (and cache structure) as the export sample."
            )
        for spec in self.spec.inputs:
            if spec.constant is not None and spec.path in flat and flat[spec.path] != spec.constant:
                raise HfExportError(
                    f"input {spec.name!r} was exported as the constant {spec.constant!r}, got {flat[spec.path]!r}; "
                    "the program cannot take another value: export again with it"
                )
        ordered = []
        for spec in self.spec.fed:
            value = flat[spec.path]
            check_input(spec, value)
            ordered.append((spec, value))
        check_shared_dims(ordered)
        shapes = {spec.path: tuple(getattr(value, "shape", ())) for spec, value in ordered}
        check_shape_relations(self.spec.shape_relations, shapes)
        return ordered

    def runtime_failure(self, runtime: str, detail: str, values: list[Any]) -> HfExportError:
        """The error for ``runtime`` failing on ``values`` (the fed inputs, in the program's order)
        with ``detail``: the shape condition of the trace they fail, if one does, else their shapes."""
        shapes = {
            spec.path: tuple(getattr(value, "shape", ())) for spec, value in zip(self.spec.fed, values, strict=False)
        }
        broken = first_broken(self.spec.shape_conditions, shapes)
        if broken:
            return HfExportError(
                f"{runtime} failed running the program ({detail[:200]}): the inputs' shapes fail a condition the "
                f"program was traced with, {broken}; the model's code fixed it from the export sample: give sizes "
                "that hold it, or export again from a sample of these shapes"
            )
        listed = ", ".join(f"{spec.name} {shape}" for spec, shape in zip(self.spec.fed, shapes.values(), strict=False))
        return HfExportError(
            f"{runtime} failed running the program ({detail[:200]}) on inputs {listed}; they passed the checks "
            "against the manifest, so the program may need other sizes than its sample's: export again from a "
            "sample of this shape, or rerun with --debug"
        )


def check_input(spec: InputSpec, value: Any) -> None:
    """Raise :class:`HfExportError` if ``value`` does not fit ``spec`` (dtype, rank, static sizes,
    bounds)."""
    if isinstance(value, torch.Tensor) and spec.dtype and str(value.dtype).removeprefix("torch.") != spec.dtype:
        wanted = str(spec.dtype)
        raise HfExportError(
            f"input {spec.name!r} has dtype {str(value.dtype).removeprefix('torch.')}, the program takes {wanted}; "
            f"convert it first (tensor.to(torch.{wanted}))"
        )
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(getattr(value, "shape", ()))
    if not spec.shape and not spec.dynamic:
        return  # a scalar, or nothing recorded about its shape
    if len(shape) != len(spec.shape):
        raise HfExportError(f"input {spec.name!r} has rank {len(shape)}, the program expects {len(spec.shape)}")
    for axis, (size, sample) in enumerate(zip(shape, spec.shape, strict=True)):
        if axis not in spec.dynamic:
            if size != sample:
                raise HfExportError(
                    f"input {spec.name!r} axis {axis} has size {size}, but the program was exported with a static "
                    f"size {sample} on this axis (a static export, or the model's code or configuration fixed it); "
                    "where the model takes other sizes, export with dynamic=True or dynamic_shapes covering it"
                )
            continue
        low, high = spec.dynamic[axis]
        if low == 2:
            # torch.export records 2 for an axis it traced as "not 0 or 1" (its 0/1 specialisation);
            # the programs still take 1 (a batch of one prompt)
            low = 1
        if low is not None and size < low:
            raise HfExportError(
                f"input {spec.name!r} axis {axis} has size {size}, below the exported minimum {low}"
                + (" (an empty input)" if size == 0 else "")
            )
        if high is not None and size > high:
            raise HfExportError(
                f"input {spec.name!r} axis {axis} has size {size}, above the exported upper bound {high} "
                "(raise the bound (Dim max, or ExecutorchConfig max_seq_len / max_batch_size) and export again)"
            )


def check_shared_dims(inputs: list[tuple[InputSpec, Any]]) -> None:
    """Raise :class:`HfExportError` if two axes the program sizes by one expression (the sequence
    length of ``input_ids`` and ``attention_mask``) have different sizes."""
    seen: dict[str, tuple[str, int, int]] = {}
    for spec, value in inputs:
        shape = tuple(getattr(value, "shape", ()))
        for axis, dim in spec.dims.items():
            if axis >= len(shape):
                continue
            size = int(shape[axis])
            if dim not in seen:
                seen[dim] = (spec.name, axis, size)
                continue
            first, first_axis, first_size = seen[dim]
            if size != first_size:
                raise HfExportError(
                    f"input {spec.name!r} axis {axis} has size {size}, but input {first!r} axis {first_axis} has "
                    f"size {first_size}: the program gives both axes one size (they share one dimension, {dim}); "
                    "make them agree"
                )
