"""Pipeline = capture → stages (pass lists, lowerings), run under instruments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.errors import HfExportError, PassError, StageError
from hfexport.pipeline.capture import AxisBound, InputAxis, capture, normalize_inputs
from hfexport.pipeline.instruments import (
    DumpInstrument,
    Instrument,
    NumericsInstrument,
    StepRecord,
    TimingInstrument,
)
from hfexport.pipeline.pass_manager import PassManager, PassResult, check_signature, signature_of
from hfexport.pipeline.pytree import register_cache_pytrees


class Stage:
    """A named step of the pipeline: ``run(program, run) -> program``."""

    name: str = ""

    def run(self, program: Any, run: PipelineRun) -> Any:
        raise NotImplementedError


class CaptureStage(Stage):
    """model + sample inputs → ``ExportedProgram`` (ignores its program argument)."""

    name = "capture"

    def axis_bound(self, run: PipelineRun) -> AxisBound | None:
        """Upper bounds for unbounded dynamic axes (none here; backends that plan memory for the
        largest shape override this)."""
        return None

    def run(self, program: Any, run: PipelineRun) -> torch.export.ExportedProgram:
        captured, run.input_axes = capture(run.model, run.inputs, run.config, self.axis_bound(run))
        return captured


class TransformStage(Stage):
    """A stage made from a function ``fn(program, run) -> program`` (e.g. a lowering)."""

    def __init__(self, name: str, fn: Callable[[Any, PipelineRun], Any]) -> None:
        self.name = name
        self.fn = fn

    def run(self, program: Any, run: PipelineRun) -> Any:
        return self.fn(program, run)


class PassStage(Stage):
    """Run a :class:`PassManager`'s passes in order, each one an instrumented step."""

    def __init__(self, name: str, manager: PassManager) -> None:
        self.name = name
        self.manager = manager

    def run(self, program: Any, run: PipelineRun) -> Any:
        self.manager.check()
        done: list[str] = []
        for index, pass_ in enumerate(self.manager.passes):
            step = StepRecord(pass_.name, "pass", index, parent=run.current)
            run.current.children.append(step)
            program = run.step(step, program, lambda p, pass_=pass_, step=step: _apply(pass_, p, step, done))
            done.append(pass_.name)
        return program


def _apply(pass_: Any, program: Any, step: StepRecord, done: list[str]) -> Any:
    signature = signature_of(program)
    try:
        result = pass_(program)
        if not isinstance(result, PassResult):
            raise TypeError(f"returned {type(result).__name__}, expected PassResult")
        if signature is not None:
            check_signature(result.program, signature, pass_.name)
    except Exception as error:
        if isinstance(error, PassError):
            raise
        before = ", ".join(done) or "none"
        raise PassError(
            f"pass {pass_.name!r} failed ({type(error).__name__}: {error}); passes before it: {before}"
        ) from error
    step.modified = result.modified
    step.counts = dict(result.counts)
    step.files.update(result.files)
    return result.program


@dataclass
class PipelineRun:
    """The state of one pipeline run, shared by stages and instruments."""

    pipeline: Pipeline
    model: torch.nn.Module
    inputs: dict[str, Any]
    config: Any
    instruments: list[Instrument]
    records: list[StepRecord] = field(default_factory=list)
    input_axes: list[InputAxis] = field(default_factory=list)
    current: StepRecord | None = None

    def step(self, step: StepRecord, program: Any, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(program)`` as one instrumented step."""
        parent, self.current = self.current, step
        try:
            for instrument in reversed(self.instruments):
                instrument.before(step, program)
            try:
                output = fn(program)
            except BaseException as error:
                for instrument in self.instruments:
                    instrument.on_error(step, program, error)
                raise
            for instrument in self.instruments:
                instrument.after(step, output)
            return output
        finally:
            self.current = parent

    def report(self, error: BaseException | None = None) -> str:
        """A markdown report: the stage/pass table, the input axes, and the error if any."""
        lines = [f"# hfexport report: {type(self.model).__name__}", ""]
        lines += [f"Pipeline: `{self.pipeline.describe()}`", "", stage_table(self.records), ""]
        if self.input_axes:
            lines += ["## Input axes", "", "| input | axis | sample size | after capture |", "|---|---|---|---|"]
            lines += [f"| {a.input} | {a.axis} | {a.size} | {a.describe()} |" for a in self.input_axes]
            lines.append("")
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
        notes = record.error or ", ".join(f"{k}={v}" for k, v in record.counts.items())
        if record.modified is False and not record.error:
            notes = notes or "no change"
        rows.append(
            f"| {indent}{record.name} | {fmt(record.seconds, '.3f')} | {fmt(record.peak_rss_mb, '.0f')} | "
            f"{nodes} | {fmt(record.max_abs_diff, '.2e')} | {notes} |"
        )
        for child in record.children:
            add(child, "↳ ")

    for record in records:
        add(record, "")
    return "\n".join(rows)


@dataclass
class PipelineResult:
    """The outcome of :meth:`Pipeline.run`: the final program, one :class:`StepRecord` per stage
    (passes as its children), the input-axes table and the markdown report."""

    program: Any
    records: list[StepRecord]
    input_axes: list[InputAxis]
    report: str

    def record(self, name: str) -> StepRecord:
        """The record of the stage or pass called ``name`` (``"stage/pass"`` also accepted)."""
        for record in self.records:
            for candidate in [record, *record.children]:
                if name in (candidate.name, candidate.label):
                    return candidate
        raise KeyError(name)


class Pipeline:
    """capture → ``stages`` under ``instruments``.

    ``Pipeline.passes`` is the :class:`PassManager` of the first pass stage, so the FX pass list
    can be edited in code before :meth:`run`.
    """

    def __init__(
        self, stages: Sequence[Stage], instruments: Sequence[Instrument] = (), capture: CaptureStage | None = None
    ) -> None:
        self.stages: list[Stage] = [capture or CaptureStage(), *stages]
        self.instruments: list[Instrument] = list(instruments)

    @classmethod
    def for_config(
        cls,
        stages: Sequence[Stage],
        config: Any,
        extra: Sequence[Instrument] = (),
        capture: CaptureStage | None = None,
    ) -> Pipeline:
        """A pipeline with the instruments a config asks for (timing always; dump, numerics)."""
        instruments: list[Instrument] = [TimingInstrument()]
        if config.dump_dir:
            instruments.append(DumpInstrument(config.dump_dir))
        if config.verify:
            instruments.append(NumericsInstrument(config.tolerance))
        return cls(stages, [*instruments, *extra], capture)

    @property
    def passes(self) -> PassManager:
        for stage in self.stages:
            if isinstance(stage, PassStage):
                return stage.manager
        raise HfExportError("this pipeline has no pass stage")

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r}; stages: {', '.join(s.name for s in self.stages)}")

    def describe(self) -> str:
        """The pipeline as one line: ``capture | fx_passes(a,b) | lower_onnx | …``."""
        parts = [f"{s.name}({s.manager})" if isinstance(s, PassStage) else s.name for s in self.stages]
        return " | ".join(parts)

    def run(self, model: torch.nn.Module, inputs: Any, config: Any) -> PipelineResult:
        """Capture ``model(**inputs)`` and run every stage; see :class:`PipelineResult`."""
        for stage in self.stages:
            if isinstance(stage, PassStage):
                stage.manager.check()  # reject a bad order before spending time on capture
        register_cache_pytrees()  # before anything flattens a model output (eager reference included)
        run = PipelineRun(self, model, normalize_inputs(inputs, model), config, self.instruments)
        error: BaseException | None = None
        program = None
        try:
            for instrument in self.instruments:
                instrument.start(run)
            for index, stage in enumerate(self.stages):
                record = StepRecord(stage.name, "stage", index)
                run.records.append(record)
                program = run.step(record, program, lambda p, stage=stage: stage.run(p, run))
        except HfExportError as caught:
            error = caught
            raise
        except Exception as caught:
            error = caught
            stage_name = run.records[-1].name if run.records else "setup"
            raise StageError(f"stage {stage_name!r} failed: {type(caught).__name__}: {caught}") from caught
        finally:
            for instrument in self.instruments:
                instrument.finish(run, error)
        return PipelineResult(program, run.records, run.input_axes, run.report())
