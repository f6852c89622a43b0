"""Checks of a capture's inputs against the model, the explicit ``dynamic_shapes`` and the bounds,
each a :class:`~hfexport.ConfigError` that names the input, before torch.export fails deep in a
trace (or, for an input only ``**kwargs`` takes, after it, when the program never reads it)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.errors import ConfigError
from hfexport.pipeline.dynamic_shapes import TOKEN_INPUTS, AxisBounds
from hfexport.pipeline.io_names import user_input_names


def check_dims_fit_sample(dynamic_shapes: Mapping[str, Any], inputs: dict[str, Any]) -> None:
    """Each ``Dim`` given for a tensor input must name an axis it has, with the sample's size
    within the Dim's range (torch.export's own errors say neither the input nor the axis)."""
    for name, spec in dynamic_shapes.items():
        value = inputs.get(name)
        if not isinstance(value, torch.Tensor) or spec is None:
            continue
        if isinstance(spec, Mapping):
            items = list(spec.items())
        elif isinstance(spec, (list, tuple)):
            items = list(enumerate(spec))
        else:
            continue
        for axis, dim in items:
            if not isinstance(axis, int):
                continue
            if not -value.dim() <= axis < value.dim():
                raise ConfigError(
                    f"dynamic_shapes gives input {name!r} axis {axis}, but the sample {name} has "
                    f"{value.dim()} axes (shape {tuple(value.shape)})"
                )
            low, high = getattr(dim, "min", None), getattr(dim, "max", None)
            size = value.shape[axis]
            if (isinstance(low, int) and size < low) or (isinstance(high, int) and size > high):
                raise ConfigError(
                    f"input {name!r} axis {axis} has sample size {size}, outside its Dim "
                    f"{getattr(dim, '__name__', '')!r} range [{low}, {high}]; export from a sample within "
                    "the range or widen the Dim"
                )


def check_input_names(model: torch.nn.Module, inputs: dict[str, Any]) -> None:
    """Every input must be a parameter of ``forward``, unless ``forward`` takes ``**kwargs`` (see
    :func:`check_kwargs_inputs_used`): a misspelled name would otherwise fail deep in the trace."""
    parameters = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = [name for name in inputs if name not in parameters]
    if unknown:
        raise ConfigError(
            f"{type(model).__name__}.forward has no parameter {', '.join(map(repr, unknown))}; drop it from the "
            f"inputs or fix its name (forward takes: {', '.join(parameters)})"
        )


def check_kwargs_inputs_used(
    model: torch.nn.Module, program: torch.export.ExportedProgram, inputs: dict[str, Any]
) -> None:
    """An input that reaches ``forward`` only through ``**kwargs`` and that the traced program never
    reads is refused: it is most likely a misspelled name (``attention_masks``), and the export
    would silently run without it."""
    parameters = inspect.signature(model.forward).parameters
    extra = [name for name in inputs if name not in parameters]
    if not extra:
        return
    read = {n.name for n in program.graph.nodes if n.op == "placeholder" and n.users}
    used = {
        readable.split(".")[0] for placeholder, readable in user_input_names(program).items() if placeholder in read
    }
    unused = [name for name in extra if name not in used]
    if unused:
        named = [name for name in parameters if parameters[name].kind is not inspect.Parameter.VAR_KEYWORD]
        raise ConfigError(
            f"{type(model).__name__} does not use input {', '.join(map(repr, unused))}: forward has no such "
            f"parameter (it only reaches **kwargs) and the traced program never reads it; drop it from the "
            f"inputs or fix its name (forward's parameters: {', '.join(named)})"
        )


def check_no_var_keyword_inputs(model: torch.nn.Module, inputs: dict[str, Any]) -> None:
    parameters = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        extra = [name for name in inputs if name not in parameters]
        if extra:
            raise ConfigError(
                f"{type(model).__name__}.forward receives {extra} only through **kwargs, and torch.export "
                "cannot combine such inputs with dynamic shapes (its constraint solver fails to match them); "
                "drop them from the inputs (flags like return_dict have model-config defaults) or export "
                "without dynamic shapes"
            )


def check_sample_within(inputs: dict[str, Any], bounds: AxisBounds) -> None:
    """Raise :class:`ConfigError` when the sample's token inputs have a batch (axis 0) or a token
    count (axis 1) beyond ``bounds``: the program could not take its own sample, and the bounds
    reported would not be the ones it was built with. Other inputs' leading axes need not be a
    batch (a vision encoder's patches), and capture keeps those at least at the sample's size."""
    for name, value in inputs.items():
        if name not in TOKEN_INPUTS or not isinstance(value, torch.Tensor) or value.dim() != 2:
            continue
        if value.shape[0] > bounds.batch:
            raise ConfigError(
                f"the sample input {name!r} has batch {value.shape[0]}, above the batch bound {bounds.batch} "
                f"({bounds.source}); raise max_batch_size or export with a smaller sample"
            )
        if value.shape[1] > bounds.other:
            raise ConfigError(
                f"the sample input {name!r} has {value.shape[1]} tokens, above the sequence bound {bounds.other} "
                f"({bounds.source}); raise max_seq_len or export with a shorter sample"
            )
