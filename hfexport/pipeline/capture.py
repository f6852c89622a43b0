"""Capture: model + sample inputs → ``ExportedProgram`` (:class:`Captured`).

Capture never changes the user's model or inputs: inputs are copied (:mod:`~hfexport.pipeline.inputs`),
the training flags are restored (:mod:`~hfexport.pipeline.eval_mode`), and the ``"capture"`` patches
are applied only around ``torch.export`` and restored on every path. It knows no model library: a
:class:`Frontend` (``hfexport.models`` for transformers) prepares the inputs. Its other jobs have their
own modules: the dynamic-shape and bound policy (:mod:`~hfexport.pipeline.dynamic_shapes`), the
checks of the inputs (:mod:`~hfexport.pipeline.input_checks`) and the table of input axes
(:mod:`~hfexport.pipeline.input_axes`). The captured program is checked to follow eager on its own
sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.computed_weights import conversions_reused
from hfexport.errors import CaptureError, ConfigError
from hfexport.pipeline.artifacts import flat_tensors, outputs_in_program_order, snapshot_program
from hfexport.pipeline.dynamic_shapes import AxisBounds, auto_dynamic_shapes, bound_dynamic_shapes, widened_for_sample
from hfexport.pipeline.eval_mode import eval_mode
from hfexport.pipeline.input_axes import InputAxis, input_axes, warn_fixed_axes
from hfexport.pipeline.input_checks import (
    check_dims_fit_sample,
    check_input_names,
    check_kwargs_inputs_used,
    check_no_var_keyword_inputs,
    check_sample_within,
)
from hfexport.pipeline.inputs import as_input_dict, copy_inputs, widen_batch
from hfexport.pipeline.patches import patches_applied

logger = logging.getLogger("hfexport")


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
        return dataclasses.replace(self, program=snapshot_program(self.program))


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
        check_no_var_keyword_inputs(model, inputs)
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
    warn_fixed_axes(table)
    return Captured(program, table, bounds, frontend.attention_windows(inputs), batch_widened=widened is not None)


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


@conversions_reused()
def _eager_outputs(model: torch.nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
    """Eager's output tensors on ``inputs`` (flattened), the reference the capture is checked with."""
    with eval_mode(model), torch.no_grad():
        return flat_tensors(model(**copy_inputs(inputs)))


def _program_difference(
    program: torch.export.ExportedProgram, inputs: dict[str, Any], expected: list[torch.Tensor]
) -> tuple[float, str | None]:
    """The max abs difference between ``program`` on ``inputs`` and eager's ``expected``, and
    ``None``; infinite, with why, when the program cannot run them (a guard of a widened trace that
    the caller's sample does not meet, other shapes or another count of outputs)."""
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
