"""Capture: model + sample inputs → ``ExportedProgram``, and the dynamic-shape policy.

Capture never changes the user's model or inputs: inputs are copied, the training flags are
restored, and the ``"capture"`` patches are applied only around ``torch.export`` and restored on
every path. It knows no model library: a :class:`Frontend` (``hfexport.models`` for transformers)
prepares the inputs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.export.dynamic_shapes import _DimHint, _DimHintType
from torch.utils._sympy.numbers import int_oo

from hfexport.errors import CaptureError, ConfigError
from hfexport.pipeline.patches import patches_applied

logger = logging.getLogger("hfexport")


def as_input_dict(inputs: Any) -> dict[str, Any]:
    """The keyword inputs as a new plain dict (a tokenizer's ``BatchEncoding`` included), ``None``
    values dropped; anything but a mapping raises :class:`ConfigError`."""
    if not isinstance(inputs, Mapping):
        raise ConfigError(
            f"inputs must be a mapping of the model's keyword arguments (e.g. a tokenizer's "
            f"BatchEncoding or {{'input_ids': ...}}), got {type(inputs).__name__}"
        )
    return {str(k): v for k, v in inputs.items() if v is not None}


def copy_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of the inputs, so running or tracing never changes the caller's tensors or
    cache objects. A tensor given as a view with other strides (``mask.expand(batch, -1)``, whose
    rows share memory) is copied into its own dense memory: a traced program keeps its inputs'
    strides, and ExecuTorch cannot plan a stride of 0."""
    copied = copy.deepcopy(inputs)
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in copied.items()}


class Frontend:
    """What capture asks of the model library it captures. This base knows none: inputs are taken
    as given and carry no attention windows; :mod:`hfexport.models` fills it in for transformers."""

    def prepare(self, model: torch.nn.Module, inputs: Any) -> dict[str, Any]:
        """Check ``model`` can be captured and return its keyword inputs as a new dict."""
        return as_input_dict(inputs)

    def static_axes(self, model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, set[int]]:
        """``{input: axes}`` the model's configuration fixes (a patch vector's width), left static
        by ``dynamic=True``; default none."""
        return {}

    def attention_windows(self, inputs: dict[str, Any]) -> dict[str, int]:
        """``{attention mask key: sliding window}`` of the caches in ``inputs``."""
        return {}


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run with every module in eval mode and gradients off; restore each module's flag after."""
    flags = [(m, m.training) for m in model.modules()]
    if model.training:
        logger.warning(
            "%s is in training mode; exporting it in eval mode (dropout off). Call model.eval() to silence this.",
            type(model).__name__,
        )
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, flag in flags:
            module.training = flag


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
    from hfexport.pipeline.io_names import path_name, program_io_names

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
    from hfexport.pipeline.io_names import user_input_names

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


def _check_no_var_keyword_inputs(model: torch.nn.Module, inputs: dict[str, Any]) -> None:
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


@dataclass(frozen=True)
class Captured:
    """What capture produced, as a value every target lowers from: the ``ExportedProgram``, the
    table of its input axes (dynamic with their ranges, or static), the bounds applied to unbounded
    dynamic axes (``None``: none), and the sliding windows of windowed static caches in the inputs."""

    program: torch.export.ExportedProgram
    input_axes: list[InputAxis]
    bounds: AxisBounds | None = None
    attention_windows: dict[str, int] = field(default_factory=dict)
    shared_by: tuple[str, ...] = ()  # the targets lowering this one capture, when there are several
    batch_widened: bool = False  # traced from the one-row sample widened to two rows (batch stays dynamic)

    @property
    def sample_shapes(self) -> dict[str, list[int]]:
        """``{input name: sample shape}``, from the input-axes table."""
        shapes: dict[str, list[int]] = {}
        for axis in self.input_axes:
            shapes.setdefault(axis.input, []).append(axis.size)
        return shapes

    def copy(self) -> Captured:
        """The same capture with its own graph (weights shared), for one more target to rewrite."""
        from hfexport.pipeline.artifacts import snapshot_program

        return dataclasses.replace(self, program=snapshot_program(self.program))


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


def capture(
    model: torch.nn.Module,
    inputs: Any,
    config: Any,
    bounds: AxisBounds | None = None,
    frontend: Frontend | None = None,
) -> Captured:
    """Trace ``model(**inputs)`` with ``torch.export`` under the ``"capture"`` patches.

    ``bounds`` give unbounded dynamic axes an upper bound (targets that plan memory for the
    largest shape need one). ``frontend`` knows the model library (default: nothing). Axes the user
    asked to be dynamic that torch.export specialised (typically a size-1 sample axis) are logged
    once each. The model and the inputs are not changed.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model must be a torch.nn.Module (a transformers PreTrainedModel), got {type(model).__name__}"
        )
    frontend = frontend or Frontend()
    inputs = frontend.prepare(model, inputs)
    if bounds is not None:
        bounds = widened_for_sample(inputs, bounds)
        check_sample_within(inputs, bounds)
    if config.dynamic:
        dynamic_shapes = auto_dynamic_shapes(inputs, bounds, frontend.static_axes(model, inputs))
    else:
        dynamic_shapes = config.dynamic_shapes
        if isinstance(dynamic_shapes, Mapping):
            unknown = sorted(set(dynamic_shapes) - set(inputs))
            if unknown:
                raise ConfigError(
                    f"dynamic_shapes names input(s) {unknown} that are not in the inputs; "
                    f"inputs are: {', '.join(inputs)}"
                )
            dynamic_shapes = {name: dynamic_shapes.get(name) for name in inputs}
            check_dims_fit_sample(dynamic_shapes, inputs)
        if bounds is not None and dynamic_shapes is not None:
            dynamic_shapes = bound_dynamic_shapes(dynamic_shapes, bounds)
    check_input_names(model, inputs)
    if dynamic_shapes is not None:
        _check_no_var_keyword_inputs(model, inputs)
    if bounds is not None:
        logger.info("capture bounds: %s", bounds.describe())
    # torch.export specialises a size-1 axis, so a one-row sample would freeze the batch axis: trace
    # a copy widened to two rows instead, and keep it only if it matches eager on the caller's rows
    widened = widen_batch(inputs) if config.dynamic and (bounds is None or bounds.batch > 1) else None
    program = _trace(model, widened, dynamic_shapes, config) if widened is not None else None
    from hfexport.pipeline.numerics import default_tolerance

    expected = _eager_outputs(model, inputs)
    difference = _program_difference(program, inputs, expected) if program is not None else None
    if difference is not None and difference[0] > default_tolerance(model):
        logger.warning(
            "the capture of %s from its sample widened to batch 2 differs from eager on the sample itself; "
            "capturing the sample as given (its batch axis stays 1)",
            type(model).__name__,
        )
        program, widened, difference = None, None, None
    if program is None:
        program = _trace(model, inputs, dynamic_shapes, config)
    elif widened is not None:
        # the program carries the caller's sample, not the widened copy (a decode loop reuses its cache)
        program.example_inputs = ((), copy_inputs(inputs))
    check_kwargs_inputs_used(model, program, inputs)
    if difference is None:
        difference = _program_difference(program, inputs, expected)
    _check_follows_eager(model, difference, expected)
    table = input_axes(program, inputs, dynamic_shapes)
    _warn_fixed_axes(table)
    return Captured(program, table, bounds, frontend.attention_windows(inputs), batch_widened=widened is not None)


def _warn_fixed_axes(table: list[Any]) -> None:
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


class _DropSpecialisationLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "0/1 specialized" not in record.getMessage()


@contextlib.contextmanager
def _without_torch_specialisation_lines() -> Iterator[None]:
    """torch.export logs a warning per 0/1-specialised axis; capture reports each such axis itself,
    once, saying what to do (see :func:`capture`), so torch's lines are dropped while tracing."""
    torch_logger = logging.getLogger("torch._export.non_strict_utils")
    dropped = _DropSpecialisationLines()
    torch_logger.addFilter(dropped)
    try:
        yield
    finally:
        torch_logger.removeFilter(dropped)


def _trace(model: torch.nn.Module, inputs: dict[str, Any], dynamic_shapes: Any, config: Any) -> Any:
    traced_inputs = copy_inputs(inputs)
    try:
        with eval_mode(model), patches_applied(scope="capture"), _without_torch_specialisation_lines():
            return torch.export.export(
                model,
                (),
                kwargs=traced_inputs,
                dynamic_shapes=dynamic_shapes,
                strict=config.strict,
                prefer_deferred_runtime_asserts_over_guards=config.prefer_deferred_runtime_asserts_over_guards,
            )
    except Exception as error:  # torch raises many unrelated types; all mean "capture failed"
        # torch's first lines say what failed and, for shape constraints, what it suggests.
        detail = "\n".join(str(error).strip().split("\n")[:12])[:2000]
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(error).__name__}: {detail}\n"
            "If an axis is the problem, try dynamic=True or Dim bounds within the model's limits "
            "(e.g. max_position_embeddings), and with explicit Dims "
            "prefer_deferred_runtime_asserts_over_guards=True. The chained exception has the full trace."
        ) from error


def widen_batch(inputs: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of ``inputs`` with two rows where the sample has one: every tensor of two or more
    dimensions repeated along axis 0. ``None`` unless all of them have one row (then axis 0 is
    unambiguously the batch: a position-ids tensor led by 3 rope sections is not)."""
    leaves = [leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2]
    if not leaves or any(leaf.shape[0] != 1 for leaf in leaves):
        return None
    return pytree.tree_map(
        lambda leaf: torch.cat([leaf, leaf]) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 else leaf,
        copy_inputs(inputs),
    )


def _eager_outputs(model: torch.nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
    """Eager's output tensors on ``inputs`` (flattened), the reference the capture is checked with."""
    from hfexport.pipeline.artifacts import flat_tensors

    with eval_mode(model), torch.no_grad():
        return flat_tensors(model(**copy_inputs(inputs)))


def _program_difference(
    program: torch.export.ExportedProgram, inputs: dict[str, Any], expected: list[torch.Tensor]
) -> tuple[float, str | None]:
    """The max abs difference between ``program`` on ``inputs`` and eager's ``expected``, and
    ``None``; infinite, with why, when the program cannot run them (a guard of a widened trace that
    the caller's sample does not meet, other shapes or another count of outputs)."""
    from hfexport.pipeline.artifacts import outputs_in_program_order
    from hfexport.pipeline.numerics import max_abs_diff

    with torch.no_grad():
        try:
            got = outputs_in_program_order(program.call_spec.out_spec, program.module()(**copy_inputs(inputs)))
        except Exception as error:
            return float("inf"), f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
    difference = max_abs_diff(expected, got)
    return difference, _unlike_outputs(expected, got) if difference == float("inf") else None


def _unlike_outputs(expected: list[torch.Tensor], got: list[Any]) -> str | None:
    """How the program's outputs differ from eager's in structure (count, shape) or in an integer
    output, or ``None``."""
    if len(expected) != len(got):
        return f"{len(got)} outputs where eager returns {len(expected)}"
    for index, (e, g) in enumerate(zip(expected, got, strict=True)):
        g = torch.as_tensor(g)
        if tuple(e.shape) != tuple(g.shape):
            return f"output {index} has shape {list(g.shape)} where eager's has {list(e.shape)}"
        if not e.is_floating_point() and not torch.equal(e, g.to(e.dtype)):
            return f"integer output {index} differs from eager's"
    return None


def _check_follows_eager(
    model: torch.nn.Module, difference: tuple[float, str | None], expected: list[torch.Tensor]
) -> None:
    """Raise :class:`CaptureError` when the captured program gives other numbers than eager on the
    sample itself (``difference`` from :func:`_program_difference`): the model's code took another
    path under torch.export (AIMv2's text tower: 2.3 on its states), and every target would carry
    the wrong graph. Rounding is not flagged: the allowance is the dtype's tolerance plus 1e-3 of
    the outputs' largest magnitude."""
    from hfexport.pipeline.numerics import default_tolerance

    difference, failure = difference
    if failure is not None:
        raise CaptureError(
            f"the program torch.export captured from {type(model).__name__} does not follow eager on its own sample "
            f"({failure}): the model's code takes another path under torch.export than in eager; the model needs a "
            "fix upstream (or a patch in hfexport.models.patches)"
        )
    scale = max((t.abs().max().item() for t in expected if t.is_floating_point() and t.numel()), default=0.0)
    allowed = default_tolerance(model) + 1e-3 * scale
    if difference > allowed:
        raise CaptureError(
            f"the program torch.export captured from {type(model).__name__} differs from eager on the sample "
            f"itself (max abs diff {difference:.3g}, allowed {allowed:.3g}): the model's code takes another path "
            "under torch.export than in eager, so no target's program would be right; the model needs a fix "
            "upstream (or a patch in hfexport.models.patches)"
        )
