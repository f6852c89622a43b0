"""Instruments: observers around every stage and pass (dump, timing and memory, progress). They
record and never decide: the numerics check is a postcondition (:mod:`hfexport.pipeline.numerics`).

Each instrument sees ``start(run)`` once, then ``before`` / ``after`` / ``on_error`` around every
step (a stage, or a pass inside a pass stage), then ``finish(run, error)``. Instruments that are
off are simply not in the list, so they cost nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from hfexport.errors import PassError
from hfexport.pipeline.artifacts import artifact_kind, node_count
from hfexport.pipeline.pass_manager import defining_file

if TYPE_CHECKING:
    from hfexport.pipeline.pipeline import PipelineRun

logger = logging.getLogger("hfexport")


@dataclass
class StepRecord:
    """What happened in one stage or pass."""

    name: str
    kind: str  # "stage" or "pass"
    index: int
    parent: StepRecord | None = None
    seconds: float | None = None
    peak_rss_mb: float | None = None
    nodes_in: int | None = None
    nodes_out: int | None = None
    max_abs_diff: float | None = None
    checked: bool | None = None  # verify on: compared with eager (True) or not checkable (False)
    modified: bool | None = None
    counts: dict[str, int] = field(default_factory=dict)
    note: str | None = None  # one line for the report's notes column
    error: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # extra dump files: name -> text
    children: list[StepRecord] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.parent.name}/{self.name}" if self.parent else self.name

    @property
    def folder(self) -> str:
        return f"{self.index:02d}_{self.name}"


class Instrument:
    """Base class: every hook is a no-op. ``role`` names what ``start`` does, for an error there."""

    role: str = "an instrument's setup"

    def start(self, run: PipelineRun) -> None: ...

    def before(self, step: StepRecord, program: Any) -> None: ...

    def after(self, step: StepRecord, program: Any) -> None: ...

    def on_error(self, step: StepRecord, program: Any, error: BaseException) -> None: ...

    def finish(self, run: PipelineRun, error: BaseException | None) -> None: ...


def _histogram(program: Any) -> dict[str, int] | None:
    try:
        return dict(artifact_kind(program).histogram(program))
    except TypeError:
        return None


# --- timing, memory, node counts -------------------------------------------------------------


def _read_peak_rss_kb() -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# the process's peak RSS (kB) before the last reset of the kernel's high-water mark: the reset
# also lowers what getrusage reports, to the process's parent too
_PEAK_BEFORE_RESETS_KB = 0


def process_peak_rss_mb() -> float:
    """This process's peak RSS so far (MiB), the per-step resets of the kernel's high-water mark
    notwithstanding (``getrusage`` and ``/usr/bin/time`` report the peak since the last reset)."""
    return max(_PEAK_BEFORE_RESETS_KB, _read_peak_rss_kb()) / 1024


def _reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM, so each step gets its own peak.
    global _PEAK_BEFORE_RESETS_KB
    _PEAK_BEFORE_RESETS_KB = max(_PEAK_BEFORE_RESETS_KB, _read_peak_rss_kb())
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


@contextlib.contextmanager
def measured(record: StepRecord) -> Iterator[StepRecord]:
    """Time a block and record its peak RSS into ``record`` (for work outside a pipeline, such
    as serialising an artifact in a benchmark)."""
    _reset_peak_rss()
    started = time.perf_counter()
    try:
        yield record
    finally:
        record.seconds = time.perf_counter() - started
        record.peak_rss_mb = _read_peak_rss_kb() / 1024


class TimingInstrument(Instrument):
    """Wall time, peak RSS and node counts of every step. Always on (a clock read and a /proc
    read per step). Peak RSS is per step on Linux (the kernel's high-water mark is reset at each
    step start and each reading is propagated to the enclosing steps); elsewhere it is the
    process peak so far."""

    def __init__(self) -> None:
        self._open: list[tuple[StepRecord, float]] = []
        self._peaks: dict[int, int] = {}

    def _propagate(self) -> None:
        peak = _read_peak_rss_kb()
        for step, _ in self._open:
            self._peaks[id(step)] = max(self._peaks.get(id(step), 0), peak)

    def before(self, step: StepRecord, program: Any) -> None:
        self._propagate()
        _reset_peak_rss()
        self._open.append((step, time.perf_counter()))
        histogram = _histogram(program) if program is not None else None
        step.nodes_in = node_count(histogram) if histogram else None

    def _close(self, step: StepRecord) -> None:
        self._propagate()
        _, started = self._open.pop()
        step.seconds = time.perf_counter() - started
        step.peak_rss_mb = self._peaks.pop(id(step), 0) / 1024

    def after(self, step: StepRecord, program: Any) -> None:
        self._close(step)
        histogram = _histogram(program)
        step.nodes_out = node_count(histogram) if histogram else None

    def on_error(self, step: StepRecord, program: Any, error: BaseException) -> None:
        if self._open and self._open[-1][0] is step:  # not yet closed by after (a failed check)
            self._close(step)
        step.error = f"{type(error).__name__}: {error}".split("\n")[0]


# --- dumps ----------------------------------------------------------------------------------------


class DumpInstrument(Instrument):
    """Write ``dump_dir/NN_<stage>/[NN_<pass>/]`` with ``graph.txt`` and ``stats.json`` after
    every step, the artifact at every stage boundary (and after every pass for artifacts that ask
    for it, such as ONNX models), ``pipeline.txt`` and ``report.md``. When a
    pass fails, its folder gets ``input<suffix>`` (the program it received) and ``repro.txt``
    (the command replaying just that pass)."""

    role = "preparing the dump folder"

    def __init__(self, dump_dir: str | Path) -> None:
        self.root = Path(dump_dir)
        self._pass_input: Any = None

    def start(self, run: PipelineRun) -> None:
        self.clear_earlier_dump()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "pipeline.txt").write_text(run.pipeline.describe() + "\n")

    def clear_earlier_dump(self) -> None:
        """Remove what an earlier run dumped into this folder (its ``pipeline.txt`` marks one): the
        ``NN_<step>`` folders and the two files, so no stale pass folder sits beside this run's.
        Anything else in the folder is left alone."""
        if not (self.root / "pipeline.txt").is_file():
            return
        for path in self.root.iterdir():
            if path.is_dir() and re.fullmatch(r"\d\d_.+", path.name):
                shutil.rmtree(path)
            elif path.name in ("pipeline.txt", "report.md"):
                path.unlink()

    def _folder(self, step: StepRecord) -> Path:
        parts = [step.parent.folder, step.folder] if step.parent else [step.folder]
        folder = self.root.joinpath(*parts)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def before(self, step: StepRecord, program: Any) -> None:
        self._folder(step)
        if step.kind == "pass":
            self._pass_input = artifact_kind(program).snapshot(program)

    def after(self, step: StepRecord, program: Any) -> None:
        folder = self._folder(step)
        kind = artifact_kind(program)
        (folder / "graph.txt").write_text(kind.text(program))
        histogram = dict(sorted(kind.histogram(program).items(), key=lambda item: (-item[1], item[0])))
        stats = {"nodes": node_count(histogram), "op_histogram": histogram}
        if step.counts:
            stats["counts"] = step.counts
        for name, text in step.files.items():
            (folder / name).write_text(text)
        (folder / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        if kind.save is not None and kind.save_at_stages and (step.kind == "stage" or kind.save_each_pass):
            kind.save(program, folder / f"program{kind.suffix}")

    def on_error(self, step: StepRecord, program: Any, error: BaseException) -> None:
        folder = self._folder(step)
        (folder / "error.txt").write_text(f"{type(error).__name__}: {error}\n")
        if step.kind == "pass" and self._pass_input is not None and artifact_kind(self._pass_input).save:
            kind = artifact_kind(self._pass_input)
            path = folder / f"input{kind.suffix}"
            kind.save(self._pass_input, path)
            applied = [child.name for child in step.parent.children[: step.index]] if step.parent else []
            source = defining_file(step.name)
            command = (
                "hfexport replay"
                + (f" --import {source}" if source else "")
                + f" {path} --passes {step.name}"
                + (f" --applied {','.join(applied)}" if applied else "")
            )
            why = (
                f"# {step.name!r} is not one of hfexport's passes: --import loads {source}, which registers it "
                "(its top level runs; keep a script's own work under `if __name__ == '__main__':`)\n"
                if source
                else ""
            )
            (folder / "repro.txt").write_text(why + command + "\n")
            if isinstance(error, PassError):
                error.add_note(f"the pass's input is dumped at {path}; replay just this pass with: {command}")

    def finish(self, run: PipelineRun, error: BaseException | None) -> None:
        (self.root / "report.md").write_text(run.report(error))
        self._pass_input = None


class ProgressInstrument(Instrument):
    """Print one line per stage as it starts and ends (used by the command line)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = 0

    def start(self, run: PipelineRun) -> None:
        self.total = len(run.pipeline.stages)

    def before(self, step: StepRecord, program: Any) -> None:
        if step.kind == "stage":
            print(f"[{step.index + 1}/{self.total}] {step.name} ...", file=self.stream, flush=True)

    def after(self, step: StepRecord, program: Any) -> None:
        if step.kind == "stage" and not step.error:  # a failed check: on_error prints FAILED
            numerics = "" if step.max_abs_diff is None else f", max abs diff {step.max_abs_diff:.2e}"
            print(
                f"[{step.index + 1}/{self.total}] {step.name} done in {step.seconds:.2f}s, "
                f"peak RSS {step.peak_rss_mb:.0f} MiB, {step.nodes_out} nodes{numerics}",
                file=self.stream,
                flush=True,
            )

    def on_error(self, step: StepRecord, program: Any, error: BaseException) -> None:
        if step.kind == "stage":
            print(f"[{step.index + 1}/{self.total}] {step.name} FAILED", file=self.stream, flush=True)
