"""The numerics postcondition: a program's outputs on the sample against eager PyTorch's.

The pipeline runs :class:`NumericsCheck` (``verify``) after every stage, and after every pass with
``verify="passes"``, before the instruments observe the step; a failure goes through the
instruments' error path. The comparison functions are shared with the benchmarks and the tests.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from hfexport.errors import VerificationError
from hfexport.pipeline.artifacts import artifact_kind, flat_tensors, named_tensors

if TYPE_CHECKING:
    from hfexport.pipeline.instruments import StepRecord
    from hfexport.pipeline.pipeline import PipelineRun


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


class NumericsCheck:
    """The numerics postcondition (``verify``): after capture and after each stage (``each_pass``:
    after each pass too), run the program on the sample inputs and compare its outputs with eager
    PyTorch; raise :class:`VerificationError` at the first stage (or pass) over the tolerance:
    ``tolerance`` (max abs difference) when given, else 1e-4 for a float32 model and, for a
    float16 / bfloat16 one, :data:`HALF_PRECISION_STEPS` steps of its dtype's resolution at each
    element's magnitude (``|program - eager| <= 8 · eps · max(1, |eager|)``: 0.0625 at magnitude 1
    in bfloat16, 0.0078 in float16).
    After a quantization pass (one reporting :data:`QUANTIZED_WEIGHTS`), the logits must have a
    cosine similarity of at least :data:`MIN_QUANTIZED_COSINE`; the figures go to the report.

    The pipeline runs it after each step and before the instruments observe the step; a failure
    then goes through the instruments' error path (a FAILED line, ``error.txt``). A program it
    cannot run (no runner for its kind) is recorded as not checked (``StepRecord.checked``)."""

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

    def check(self, step: StepRecord, program: Any) -> None:
        self.quantized = self.quantized or bool(step.counts.get(QUANTIZED_WEIGHTS))
        if step.kind != "stage" and not self.each_pass:
            return
        try:
            runner = artifact_kind(program).run
        except TypeError:
            runner = None
        step.checked = runner is not None
        if runner is None:
            return
        outputs = runner(program, self.inputs)
        reference = self.reference
        if isinstance(outputs, dict):  # by name; None for an output the program keeps as its state
            # a runtime's arrays are compared too (only symbolic-integer outputs are left out)
            outputs = {
                name: torch.as_tensor(value) if hasattr(value, "__array__") else value
                for name, value in outputs.items()
            }
            outputs = {name: value for name, value in outputs.items() if value is None or torch.is_tensor(value)}
            # eager's outputs the program no longer returns (kept inside, or derived in a runtime's
            # interface: a token counter) are not compared; any other name is another structure
            if not outputs or not set(outputs) <= set(self.reference_by_name):
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
