"""Instruments: hooks around every stage and pass (dump, timing and memory, numerics, progress).

Each instrument sees ``start(run)`` once, then ``before`` / ``after`` / ``on_error`` around every
step (a stage, or a pass inside a pass stage), then ``finish(run, error)``. Instruments that are
off are simply not in the list, so they cost nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from hfexport.errors import PassError, VerificationError
from hfexport.pipeline.artifacts import artifact_kind, flat_tensors, named_tensors, node_count
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


def _reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM, so each step gets its own peak.
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
        self._close(step)
        step.error = f"{type(error).__name__}: {error}".split("\n")[0]


# --- numerics -----------------------------------------------------------------------------------


def max_abs_diff(expected: list[torch.Tensor], actual: list[Any]) -> float:
    """Max abs difference over matching output tensors; inf when the structures differ or an
    integer / bool output differs at all, NaN when one side has a NaN the other does not (compare
    with ``not diff <= tolerance``, which NaN fails)."""
    if len(expected) != len(actual):
        return float("inf")
    worst = 0.0
    for e, a in zip(expected, actual, strict=True):
        a = torch.as_tensor(a)
        if tuple(e.shape) != tuple(a.shape):
            return float("inf")
        if e.numel() == 0:
            continue
        if e.is_floating_point():
            diff = (e.double() - a.double()).abs()
            # NaN in the same places on both sides is agreement, NaN on one side is not.
            diff = torch.where(torch.isnan(e) & torch.isnan(a), torch.zeros_like(diff), diff)
            if bool(torch.isnan(diff).any()):
                return float("nan")
            worst = max(worst, float(diff.max()))
        elif not torch.equal(e, a.to(e.dtype)):
            return float("inf")
    return worst


# The count a quantization pass reports (how many weights it quantized). After such a pass, outputs
# differ from eager by design: verify compares the first output (the logits) by cosine similarity
# (at least MIN_QUANTIZED_COSINE) and reports the top-1 agreement, instead of the max abs difference.
QUANTIZED_WEIGHTS = "quantized_weights"
MIN_QUANTIZED_COSINE = 0.98


def agreement(expected: list[torch.Tensor], actual: list[Any]) -> tuple[float, float]:
    """(cosine similarity, top-1 agreement over the last axis) of the first outputs."""
    e, a = expected[0].double(), torch.as_tensor(actual[0]).double()
    cosine = float(torch.nn.functional.cosine_similarity(e.flatten(), a.flatten(), dim=0))
    top1 = float((e.argmax(-1) == a.argmax(-1)).double().mean()) if e.dim() else float(e == a)
    return cosine, top1


def default_tolerance(model: torch.nn.Module) -> float:
    """Max abs difference allowed against eager: 1e-4 for fp32 models, 1e-2 with fp16/bf16 weights."""
    dtypes = {p.dtype for p in model.parameters()}
    return 1e-2 if dtypes & {torch.float16, torch.bfloat16} else 1e-4


# verify's default for a half-precision model: each output element within this many steps of its
# dtype's resolution (machine epsilon) of eager, at the element's magnitude (at least 1). One
# rounding of a bfloat16 value near 3 is 0.0156 (eps 2**-7 at 2..4): an absolute 1e-2 failed a bf16
# BERT on ExecuTorch for one rounding step, while float16 runs differ by a few steps.
HALF_PRECISION_STEPS = 8


def half_precision(model: torch.nn.Module) -> torch.dtype | None:
    """float16 or bfloat16 when that dtype holds most of the model's floating-point weights."""
    counts: dict[torch.dtype, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    dtype = max(counts, key=counts.__getitem__) if counts else None
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def max_scaled_diff(expected: list[torch.Tensor], actual: list[Any]) -> float:
    """:func:`max_abs_diff` with each float element's difference divided by ``max(1, |eager|)``:
    how far apart the outputs are relative to their magnitude (inf / NaN as there)."""
    worst = max_abs_diff(expected, actual)
    if math.isnan(worst) or math.isinf(worst):
        return worst
    worst = 0.0
    for e, a in zip(expected, actual, strict=True):
        if e.is_floating_point() and e.numel():
            e, a = e.double(), torch.as_tensor(a).double()
            diff = torch.where(torch.isnan(e) & torch.isnan(a), torch.zeros_like(e), (e - a).abs())
            worst = max(worst, float((diff / e.abs().clamp_min(1.0)).max()))
    return worst


class NumericsInstrument(Instrument):
    """After capture and after each stage (``each_pass``: after each pass too), run the program on
    the sample inputs and compare its outputs with eager PyTorch; raise :class:`VerificationError`
    at the first stage (or pass) over the tolerance: ``tolerance`` (max abs difference) when given,
    else 1e-4 for a float32 model and, for a float16 / bfloat16 one, :data:`HALF_PRECISION_STEPS`
    steps of its dtype's resolution at each element's magnitude (``|program - eager| <= 8 · eps ·
    max(1, |eager|)``: 0.0625 at magnitude 1 in bfloat16, 0.0078 in float16).
    After a quantization pass (one reporting :data:`QUANTIZED_WEIGHTS`), the logits must have a
    cosine similarity of at least :data:`MIN_QUANTIZED_COSINE`; the figures go to the report."""

    role = "the eager reference run (verify)"

    def __init__(self, tolerance: float | None = None, each_pass: bool = False) -> None:
        self.tolerance = tolerance
        self.given = tolerance  # None: the default, set per run from the model's dtype
        self.relative: float | None = None  # the half-precision default: steps of eps, relative
        self.half: torch.dtype | None = None
        self.each_pass = each_pass
        self.reference: list[torch.Tensor] = []
        self.reference_by_name: dict[str, torch.Tensor] = {}
        self.inputs: dict[str, Any] = {}
        self.quantized = False

    def start(self, run: PipelineRun) -> None:
        from hfexport.pipeline.eval_mode import eval_mode
        from hfexport.pipeline.inputs import copy_inputs

        self.inputs = run.inputs
        self.quantized = False
        with eval_mode(run.model):
            eager = run.model(**copy_inputs(run.inputs))
        self.reference = flat_tensors(eager)
        self.reference_by_name = named_tensors(eager)
        self.half = half_precision(run.model) if self.given is None else None
        self.relative = HALF_PRECISION_STEPS * torch.finfo(self.half).eps if self.half is not None else None
        self.tolerance = self.given if self.given is not None else (None if self.half else 1e-4)

    def after(self, step: StepRecord, program: Any) -> None:
        self.quantized = self.quantized or bool(step.counts.get(QUANTIZED_WEIGHTS))
        if step.kind != "stage" and not self.each_pass:
            return
        try:
            runner = artifact_kind(program).run
        except TypeError:
            return
        if runner is None:
            return
        outputs = runner(program, self.inputs)
        reference = self.reference
        if isinstance(outputs, dict):  # by name; None for an output the program keeps as its state
            outputs = {name: value for name, value in outputs.items() if value is None or torch.is_tensor(value)}
            if set(outputs) != set(self.reference_by_name):
                reference = []  # a structure other than eager's: max_abs_diff says inf
            else:
                reference = [self.reference_by_name[name] for name, value in outputs.items() if value is not None]
            outputs = [value for value in outputs.values() if value is not None]
        step.max_abs_diff = max_abs_diff(reference, outputs)
        if self.quantized:
            self._check_quantized(step, reference, outputs)
        elif not self._within(step.max_abs_diff, reference, outputs):
            where = (
                f"pass {step.name!r} (stage {step.parent.name!r})" if step.kind == "pass" else f"stage {step.name!r}"
            )
            hint = (
                "compare its dumped graph with the previous pass's"
                if step.kind == "pass"
                else "rerun with verify='passes' to find the pass, or with dump_dir set to compare the graphs"
            )
            diff = step.max_abs_diff
            by = "NaN where eager has a number" if math.isnan(diff) else f"max abs {diff:.3g}"
            raise VerificationError(
                f"{where}: outputs differ from eager PyTorch by {by} "
                f"(tolerance {self._describe()}); this is the first {step.kind} over the tolerance. {hint}."
            )

    def _within(self, diff: float, reference: list[torch.Tensor], outputs: list[Any]) -> bool:
        if self.relative is None:
            return diff <= self.tolerance
        return diff <= self.relative or max_scaled_diff(reference, outputs) <= self.relative

    def _describe(self) -> str:
        if self.relative is None:
            return f"{self.tolerance:g}"
        name = str(self.half).removeprefix("torch.")
        return f"{HALF_PRECISION_STEPS} steps of {name}'s resolution: {self.relative:g} x max(1, |eager|)"

    def _check_quantized(self, step: StepRecord, reference: list[torch.Tensor], outputs: list[Any]) -> None:
        cosine, top1 = agreement(reference, outputs)
        figures = f"quantized: logit cosine {cosine:.4f}, top-1 agreement {top1:.0%}"
        step.note = f"{step.note}; {figures}" if step.note else figures
        if not cosine >= MIN_QUANTIZED_COSINE:
            raise VerificationError(
                f"{step.label}: the quantized program's logits have cosine similarity {cosine:.4f} with eager "
                f"PyTorch (at least {MIN_QUANTIZED_COSINE} expected; top-1 agreement {top1:.0%}); use a smaller "
                "group size or a milder quantization mode"
            )

    def finish(self, run: PipelineRun, error: BaseException | None) -> None:
        self.reference, self.reference_by_name, self.inputs = [], {}, {}


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
        if kind.save is not None and (step.kind == "stage" or kind.save_each_pass):
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
        if step.kind == "stage":
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
