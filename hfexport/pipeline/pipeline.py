"""Pipeline = capture → stages (pass lists, lowerings), run under instruments."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.errors import HfExportError, StageError
from hfexport.pipeline.capture import Captured, Frontend, capture
from hfexport.pipeline.dynamic_shapes import AxisBounds
from hfexport.pipeline.input_axes import InputAxis
from hfexport.pipeline.instruments import DumpInstrument, Instrument, StepRecord, TimingInstrument
from hfexport.pipeline.numerics import NumericsCheck
from hfexport.pipeline.pass_manager import (
    PassManager,
    PassResult,
    execute_pass,
    own_weights,
    release_dropped_weights,
)
from hfexport.pipeline.patches import EXPORT_LOCK


class Stage:
    """A named step of the pipeline: ``run(program, run) -> program``."""

    name: str = ""

    def run(self, program: Any, run: PipelineRun) -> Any:
        raise NotImplementedError


class CaptureStage(Stage):
    """model + sample inputs → :class:`~hfexport.pipeline.capture.Captured` (its program goes on
    to the next stage). Given a capture shared by several targets, it takes a copy of that one
    instead of tracing again."""

    name = "capture"

    def __init__(self, frontend: Frontend | None = None) -> None:
        self.frontend = frontend or Frontend()

    def run(self, program: Any, run: PipelineRun) -> torch.export.ExportedProgram:
        if run.shared is not None:
            run.captured = run.shared.copy()
            run.current.note = (
                f"a copy of the one capture shared by {', '.join(run.shared.shared_by) or 'several targets'}"
            )
        else:
            run.captured = capture(run.model, run.inputs, run.config, run.bounds, self.frontend)
        if run.captured.bounds is not None:
            run.current.counts.update(run.captured.bounds.counts())
        if run.captured.batch_widened:
            widened = "traced from the one-row sample widened to two rows, so the batch axis stays dynamic"
            run.current.note = f"{run.current.note}; {widened}" if run.current.note else widened
        return run.captured.program


class TransformStage(Stage):
    """A stage made from a function ``fn(program, run) -> program`` (e.g. a lowering)."""

    def __init__(self, name: str, fn: Callable[[Any, PipelineRun], Any]) -> None:
        self.name = name
        self.fn = fn

    def run(self, program: Any, run: PipelineRun) -> Any:
        return self.fn(program, run)


class PassStage(Stage):
    """Run a :class:`PassManager`'s passes in order, each one an instrumented step, each through
    :func:`~hfexport.pipeline.pass_manager.execute_pass` (as ``hfexport replay`` does)."""

    def __init__(self, name: str, manager: PassManager) -> None:
        self.name = name
        self.manager = manager

    def run(self, program: Any, run: PipelineRun) -> Any:
        done: list[str] = []
        for index, pass_ in enumerate(self.manager.passes):
            step = StepRecord(pass_.name, "pass", index, parent=run.current)
            run.current.children.append(step)

            def apply(program: Any, pass_: Any = pass_, step: StepRecord = step) -> Any:
                return _recorded(step, execute_pass(pass_, program, done))

            program = run.step(step, program, apply)
            done.append(pass_.name)
            # a capture shared by several targets shares their weights: none is freed
            freed = release_dropped_weights(program, run.captured) if run.shared is None else 0
            if freed:
                step.counts["model_weights_freed_mib"] = round(freed / 2**20, 1)
        return program


def _recorded(step: StepRecord, result: PassResult) -> Any:
    step.modified = result.modified
    step.counts = dict(result.counts)
    step.files.update(result.files)
    return result.program


@dataclass
class PipelineRun:
    """The state of one pipeline run, shared by stages and instruments. ``captured`` is set by
    the capture stage; ``bounds`` and ``shared`` are what the run was asked to capture with."""

    pipeline: Pipeline
    model: torch.nn.Module
    inputs: dict[str, Any]
    config: Any
    instruments: list[Instrument]
    checks: list[NumericsCheck] = field(default_factory=list)
    bounds: AxisBounds | None = None
    shared: Captured | None = None
    captured: Captured | None = None
    records: list[StepRecord] = field(default_factory=list)
    current: StepRecord | None = None

    def step(self, step: StepRecord, program: Any, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(program)`` as one instrumented step: the instruments observe it, then the
        checks (postconditions: numerics) judge its output; a failure of either goes through
        every instrument's ``on_error``."""
        parent, self.current = self.current, step
        try:
            for instrument in reversed(self.instruments):
                instrument.before(step, program)
            try:
                output = fn(program)
            except BaseException as error:
                self._failed(step, program, error)
                raise
            failure: BaseException | None = None
            try:
                for check in self.checks:
                    check.check(step, output)
            except Exception as error:
                failure = error
                step.error = f"{type(error).__name__}: {error}".split("\n")[0]
            for instrument in self.instruments:
                instrument.after(step, output)
            if failure is not None:
                self._failed(step, output, failure)
                raise failure
            return output
        finally:
            self.current = parent

    def reinterface(self, feed: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Say how the sample maps onto the inputs a stage gave the program (a runtime's own
        interface: ``feed(sample) -> inputs``): the checks feed the later steps' programs that."""
        for check in self.checks:
            check.inputs = feed(check.inputs)

    def _failed(self, step: StepRecord, program: Any, error: BaseException) -> None:
        for instrument in self.instruments:
            instrument.on_error(step, program, error)

    @property
    def input_axes(self) -> list[InputAxis]:
        return self.captured.input_axes if self.captured else []

    def report(self, error: BaseException | None = None) -> str:
        """A markdown report: the stage/pass table, the input axes, the bounds, and the error if any."""
        lines = [f"# hfexport report: {type(self.model).__name__}", ""]
        lines += [f"Pipeline: `{self.pipeline.describe()}`", "", stage_table(self.records), ""]
        if self.input_axes:
            lines += ["## Input axes", "", "| input | axis | sample size | after capture |", "|---|---|---|---|"]
            lines += [f"| {a.input} | {a.axis} | {a.size} | {a.describe()} |" for a in self.input_axes]
            lines.append("")
        if self.captured is not None and self.captured.bounds is not None:
            lines += ["## Bounds applied at capture", "", self.captured.bounds.describe(), ""]
        if error is not None:
            lines += ["## Error", "", "```", f"{type(error).__name__}: {error}", "```", ""]
        return "\n".join(lines)


def stage_table(records: Sequence[StepRecord]) -> str:
    """A markdown table with one row per stage and per pass."""
    rows = ["| step | time (s) | peak RSS (MiB) | nodes in → out | max abs diff vs eager | notes |"]
    rows.append("|---|---:|---:|---|---:|---|")

    def fmt(value: float | None, spec: str) -> str:
        return "" if value is None else format(value, spec)

    def add(record: StepRecord, indent: str) -> None:
        nodes = (
            ""
            if record.nodes_out is None
            else f"{record.nodes_in if record.nodes_in is not None else '–'} → {record.nodes_out}"
        )
        notes = record.error or ", ".join(
            [*(f"{k}={v}" for k, v in record.counts.items()), *([record.note] if record.note else [])]
        )
        if record.modified is False and not record.error:
            notes = notes or "no change"
        rows.append(
            f"| {indent}{record.name} | {fmt(record.seconds, '.3f')} | {fmt(record.peak_rss_mb, '.0f')} | "
            f"{nodes} | {'not checked' if record.checked is False else fmt(record.max_abs_diff, '.2e')} | {notes} |"
        )
        for child in record.children:
            add(child, "↳ ")

    for record in records:
        add(record, "")
    return "\n".join(rows)


@dataclass
class PipelineResult:
    """The outcome of :meth:`Pipeline.run`: the final program, one :class:`StepRecord` per stage
    (passes as its children), the :class:`~hfexport.pipeline.capture.Captured` record (its program
    is the one the passes went on to rewrite) and the markdown report."""

    program: Any
    records: list[StepRecord]
    captured: Captured | None
    report: str
    model_name: str = ""
    target: str = ""  # the registered target that lowered it (set by the exporters)

    @property
    def input_axes(self) -> list[InputAxis]:
        return self.captured.input_axes if self.captured else []

    def record(self, name: str) -> StepRecord:
        """The record of the stage or pass called ``name`` (``"stage/pass"`` also accepted)."""
        for record in self.records:
            for candidate in [record, *record.children]:
                if name in (candidate.name, candidate.label):
                    return candidate
        raise KeyError(name)


class Pipeline:
    """capture → ``stages`` under ``instruments``, for one ``config``.

    ``Pipeline.passes`` is the :class:`PassManager` of the first pass stage, so the FX pass list
    can be edited in code before :meth:`run`. ``checks`` are the postconditions every step's
    output must meet (the numerics check ``config.verify`` asks for). ``frontend`` knows the model
    library the pipeline captures from (the exporters give it :data:`hfexport.models.TRANSFORMERS`).
    ``convert`` (``(model, inputs, config) -> (model, inputs)``) gives the model and inputs a
    capture takes in the precision the config asks for (the exporters give it
    :mod:`hfexport.precision`'s).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        config: Any,
        instruments: Sequence[Instrument] = (),
        frontend: Frontend | None = None,
        bounds: Callable[[torch.nn.Module, Any], AxisBounds | None] | None = None,
        convert: Callable[[torch.nn.Module, Any, Any], tuple[torch.nn.Module, Any]] | None = None,
        checks: Sequence[NumericsCheck] = (),
    ) -> None:
        self.frontend = frontend or Frontend()
        self.stages: list[Stage] = [CaptureStage(self.frontend), *stages]
        self.config = config
        self.instruments: list[Instrument] = list(instruments)
        self.checks: list[NumericsCheck] = list(checks)
        self.bounds = bounds  # (model, config) -> the bounds the stages need on unbounded dynamic axes
        self.convert = convert

    @classmethod
    def for_config(
        cls,
        stages: Sequence[Stage],
        config: Any,
        extra: Sequence[Instrument] = (),
        frontend: Frontend | None = None,
        bounds: Callable[[torch.nn.Module, Any], AxisBounds | None] | None = None,
        convert: Callable[[torch.nn.Module, Any, Any], tuple[torch.nn.Module, Any]] | None = None,
    ) -> Pipeline:
        """A pipeline with the instruments a config asks for (timing always; dump) and its
        checks (numerics, with ``verify``)."""
        instruments: list[Instrument] = [TimingInstrument()]
        if config.dump_dir:
            instruments.append(DumpInstrument(config.dump_dir))
        checks = [NumericsCheck(config.tolerance, each_pass=config.verify == "passes")] if config.verify else []
        return cls(stages, config, [*instruments, *extra], frontend, bounds, convert, checks)

    @property
    def passes(self) -> PassManager:
        for stage in self.stages:
            if isinstance(stage, PassStage):
                return stage.manager
        raise HfExportError("this pipeline has no pass stage")

    def describe(self) -> str:
        """The pipeline as one line: ``capture | fx_passes(a,b) | lower_onnx | …``."""
        parts = [f"{s.name}({s.manager})" if isinstance(s, PassStage) else s.name for s in self.stages]
        return " | ".join(parts)

    def run(
        self,
        model: torch.nn.Module,
        inputs: Any,
        *,
        bounds: AxisBounds | None = None,
        shared: Captured | None = None,
    ) -> PipelineResult:
        """Capture ``model(**inputs)`` (bounding unbounded dynamic axes by ``bounds``, by default the
        pipeline's own), or take a copy of the ``shared`` capture, and run every stage; see
        :class:`PipelineResult`. One run at a time per process: a run started in another thread
        waits (:data:`~hfexport.pipeline.patches.EXPORT_LOCK`)."""
        with EXPORT_LOCK, warnings.catch_warnings():
            # torch's deepcopy of a program's tree specs (to_edge's, the ONNX lowering's) makes a
            # LeafSpec, whose class warns on every instance it makes, once per copy: noise between
            # the stage lines, about torch's own code
            warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
            return self._run(model, inputs, bounds, shared)

    def _run(
        self, model: torch.nn.Module, inputs: Any, bounds: AxisBounds | None, shared: Captured | None
    ) -> PipelineResult:
        config = self.config
        if shared is None and self.convert is not None:
            model, inputs = self.convert(model, inputs, config)
        if bounds is None and shared is None and self.bounds is not None:
            bounds = self.bounds(model, config)
        for stage in self.stages:
            if isinstance(stage, PassStage):
                stage.manager.check()  # reject a bad order before spending time on capture
        run = PipelineRun(
            self,
            model,
            self.frontend.prepare(model, inputs),
            config,
            self.instruments,
            self.checks,
            bounds=bounds,
            shared=shared,
        )
        error: BaseException | None = None
        program = None
        starting: Any = None
        try:
            for starting in [*self.instruments, *self.checks]:
                starting.start(run)
            starting = None
            for index, stage in enumerate(self.stages):
                record = StepRecord(stage.name, "stage", index)
                run.records.append(record)
                program = run.step(record, program, lambda p, stage=stage: stage.run(p, run))
        except HfExportError as caught:
            error = caught
            raise
        except Exception as caught:
            error = caught
            where = f"stage {run.records[-1].name!r}" if run.records else getattr(starting, "role", "setup")
            raise StageError(f"{where} failed: {type(caught).__name__}: {caught}") from caught
        finally:
            for instrument in [*self.instruments, *self.checks]:
                instrument.finish(run, error)
        if isinstance(program, torch.export.ExportedProgram):
            own_weights(program)  # a snapshot: later edits to the model do not reach it
        return PipelineResult(program, run.records, run.captured, run.report(), type(model).__name__)
