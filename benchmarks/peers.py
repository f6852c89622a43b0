"""Peers' export and greedy decode, measured like ``benchmarks/decode.py`` measures hfexport's targets.

Runs under a peer's own venv (it does not import hfexport), one or more variants per call:

    /work/peers/venv-onnx/bin/python benchmarks/peers.py --folder CHECKPOINT --variant optimum-onnx --out onnx.json
    /work/peers/venv-executorch/bin/python benchmarks/peers.py --folder CHECKPOINT \\
        --variant optimum-executorch --variant optimum-executorch:custom --variant optimum-executorch:8da4w \\
        --threads 1 --out executorch.json

Variants (``--list`` prints them with the exact options each passes):

- ``optimum-onnx``: optimum-onnx's fp32 ONNX export with past key values (``optimum.exporters.onnx.main_export``
  with the arguments ``ORTModelForCausalLM.from_pretrained(export=True)`` uses), run by ONNX Runtime through
  ``ORTModelForCausalLM.generate``.
- ``optimum-executorch``: optimum-executorch's plain XNNPACK recipe, static cache of ``--cache-len`` slots.
- ``optimum-executorch:custom``: the same with its custom SDPA op and custom KV cache.
- ``optimum-executorch:8da4w``: custom SDPA and KV cache, linears in 8da4w and the embedding in 8w, as its README's
  quick start does; ``optimum-executorch:8da4w-fp32-embedding`` leaves the embedding fp32 (as hfexport's 8da4w does).

The ExecuTorch program is run through ``ExecuTorchModelForCausalLM.generate`` (its Python greedy loop over the
pybindings module). optimum-onnx has no weight-only int4 (MatMulNBits) path, so there is no ``optimum-onnx:int4``.

Per variant the JSON record holds:

- the export, run in a child process: wall seconds, CPU seconds (user + system) and peak RSS in MiB (``ru_maxrss``),
  both from the child's own rusage (``os.wait4``); the artifact's size in MiB (the program files:
  ``.onnx``/``.onnx_data`` or ``.pte``/``.ptd``);
- the time to load the artifact (the runtime class's ``from_pretrained`` on the exported folder: the ONNX Runtime
  session's creation / the ``.pte``'s load, and their metadata; the imports left out. The ``.pte``'s load takes
  milliseconds and the first ``forward`` call pays for what it left, so the warm-up run's
  ``runs[0]["first_token_seconds"]`` is the figure to read with it) and the measuring process's peak RSS after
  generation (a maximum over the process's life: one variant per call for a clean figure);
- greedy generation of ``--new-tokens`` tokens after the chat prompt that the checkpoint's chat template builds
  from the one user message ``QUESTION`` (``add_generation_prompt=True``): time to first token and decode tokens/s
  (``(new tokens - 1) / (time from the first to the last token)``), each the median of ``--repeats`` runs after
  one warm-up run, every run's figures, the first measured run's token ids and their decoded text;
- with ``--teacher FILE`` (JSON: ``ids``, ``prompt_len``, ``answer_tokens``; ``decode.py`` writes it): the
  variant's next-token argmax at every position of ``ids`` (eager's greedy continuation of a prompt, fed as
  given: teacher forcing) in ``teacher_predictions``, and its own greedy answer to ``ids[:prompt_len]`` in
  ``teacher_answer_ids``.

Threads: ``torch.set_num_threads(threads)`` everywhere (the export child too); ONNX Runtime's session gets
``intra_op_num_threads=threads`` and ``inter_op_num_threads=1``; ExecuTorch's shared threadpool (the one XNNPACK
and the custom ops use) is reset to ``threads`` with the pybindings' ``_unsafe_reset_threadpool`` before the program
is loaded, and the record gives what ``_threadpool_get_thread_count`` then reports.

Only local files are read: ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` are set before anything is imported.
Under transformers 4.x (optimum-onnx pins ``<4.58``) a checkpoint written by transformers 5 is read through a view
whose ``config.json`` also has a top-level ``rope_theta`` (see :func:`compatible_folder`), and its tokenizer through
``PreTrainedTokenizerFast`` (4.x does not know the ``TokenizersBackend`` class); the record says so. A variant that
fails keeps its exception in ``error`` (the others still run; the exit status is then 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

# every transformers / hub import below is inside a function, so this comes first
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

QUESTION = "What is the capital of France? Answer in one sentence, then name two famous museums there."
PROGRAM_SUFFIXES = (".onnx", ".onnx_data", ".pte", ".ptd")


@dataclass(frozen=True)
class Variant:
    """A peer's export recipe: which runtime runs it and the keyword arguments its export function gets."""

    name: str
    runtime: str  # "onnx" or "executorch"
    options: dict[str, Any]
    note: str


def variants(cache_len: int) -> dict[str, Variant]:
    """Every variant this script knows, by name; ``cache_len`` is ExecuTorch's static cache length."""
    xnnpack = {"task": "text-generation", "recipe": "xnnpack", "max_seq_len": cache_len}
    custom = {**xnnpack, "use_custom_sdpa": True, "use_custom_kv_cache": True}
    return {
        v.name: v
        for v in (
            Variant(
                "optimum-onnx",
                "onnx",
                {"task": "text-generation-with-past", "do_validation": False, "no_post_process": False},
                "fp32 ONNX with past key values (dynamic cache), ONNX Runtime CPU, ORTModelForCausalLM.generate",
            ),
            Variant("optimum-executorch", "executorch", xnnpack, "XNNPACK, fp32, static cache, sdpa attention"),
            Variant(
                "optimum-executorch:custom",
                "executorch",
                custom,
                "XNNPACK, fp32, custom SDPA op (custom_sdpa attention) and custom KV cache",
            ),
            Variant(
                "optimum-executorch:8da4w",
                "executorch",
                {**custom, "qlinear": "8da4w", "qembedding": "8w"},
                "custom SDPA and KV cache; linears 8da4w (group 32), embedding 8w, as optimum-executorch's README",
            ),
            Variant(
                "optimum-executorch:8da4w-fp32-embedding",
                "executorch",
                {**custom, "qlinear": "8da4w"},
                "custom SDPA and KV cache; linears 8da4w (group 32), embedding left fp32",
            ),
        )
    }


SKIPPED = {
    "optimum-onnx:int4": "optimum-onnx 0.1.0 has no weight-only int4 (MatMulNBits) quantization; its ORTQuantizer "
    "offers int8 dynamic/static quantization only",
}


@dataclass
class Record:
    """What one variant measured; written as one JSON object."""

    variant: str
    note: str
    options: dict[str, Any]
    folder: str
    threads: int
    thread_control: str = ""
    checkpoint_adapted: str = ""  # what compatible_folder changed, if anything
    versions: dict[str, str] = field(default_factory=dict)
    export_wall_seconds: float = 0.0
    export_cpu_seconds: float = 0.0
    export_peak_rss_mib: float = 0.0
    artifact_mib: float = 0.0
    artifact_files: dict[str, float] = field(default_factory=dict)
    load_seconds: float = 0.0
    runtime_peak_rss_mib: float = 0.0  # the measuring process's peak so far: one variant per call for a clean figure
    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_seconds: float = 0.0
    decode_tokens_per_second: float = 0.0
    runs: list[dict[str, float]] = field(default_factory=list)
    runs_agree: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    teacher_predictions: list[int] = field(default_factory=list)
    teacher_answer_ids: list[int] = field(default_factory=list)
    error: str = ""  # the exception that stopped this variant, if any


# --- export (in a child process) -------------------------------------------------------------------------------


def export_variant(variant: Variant, folder: Path, out: Path) -> None:
    """Export ``folder`` with the peer's own Python export API into ``out`` (runs in the child process)."""
    options = dict(variant.options)
    if variant.runtime == "onnx":
        from optimum.exporters.onnx import main_export

        task = options.pop("task")
        main_export(str(folder), output=out, task=task, local_files_only=True, **options)
    else:
        from optimum.exporters.executorch import main_export

        task, recipe = options.pop("task"), options.pop("recipe")
        main_export(str(folder), task=task, recipe=recipe, output_dir=out, local_files_only=True, **options)


def timed_export(variant: Variant, folder: Path, out: Path, threads: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of the export, run as ``--export-only`` in a child process."""
    command = [sys.executable, __file__, "--export-only", str(out), "--variant", variant.name]
    command += ["--folder", str(folder), "--threads", str(threads), "--cache-len", str(variant_cache_len(variant))]
    return timed_child(command)


# Linux keeps a process's peak RSS across exec, and a forked child starts from its parent's: a
# command started from this process (or from the benchmark's, which holds the eager model) would
# report at least this process's peak. The launcher, a small Python, starts the command and reports
# that child's own usage, as GNU time does.
_LAUNCHER = """
import json, os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as out:
    json.dump({"cpu": usage.ru_utime + usage.ru_stime, "maxrss_kib": usage.ru_maxrss}, out)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def timed_child(
    command: list[str], env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None
) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of ``command`` run as a child process (started by
    a small launcher, so that its peak RSS is its own). With ``on_line``, its stderr goes through
    ``on_line`` line by line (``benchmarks/decode.py`` reads hfexport's stage lines from it)
    instead of straight to this process's stderr."""
    with tempfile.TemporaryDirectory() as scratch:
        usage_file = Path(scratch) / "usage.json"
        start = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(usage_file), *command],
            env=env,
            stderr=subprocess.PIPE if on_line else None,
            text=True,
        )
        if on_line is not None:
            for line in child.stderr:  # read to the end before waiting: a full pipe would block the child
                on_line(line)
        child.wait()
        wall = time.perf_counter() - start
        if child.returncode != 0:
            raise subprocess.CalledProcessError(child.returncode, command)
        usage = json.loads(usage_file.read_text())
    return wall, usage["cpu"], usage["maxrss_kib"] / 1024  # Linux reports ru_maxrss in KiB


def variant_cache_len(variant: Variant) -> int:
    return int(variant.options.get("max_seq_len", 128))


def artifact_files(out: Path) -> dict[str, float]:
    """The program files under ``out`` and their sizes in MiB."""
    return {
        str(path.relative_to(out)): path.stat().st_size / 2**20
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.name.endswith(PROGRAM_SUFFIXES)
    }


# --- runtimes ----------------------------------------------------------------------------------------------------

# generate(prompt ids, new tokens) -> (new token ids, start time, the time each new token was known)
Generate = Callable[[list[int], int], tuple[list[int], float, list[float]]]
Predict = Callable[[list[int]], list[int]]  # the next-token argmax at each position of the ids, teacher-forced


def load_onnx(out: Path, threads: int) -> tuple[Generate, Predict, float, str]:
    """An ``ORTModelForCausalLM`` on the exported folder (a streamer notes when each new token arrives), the
    seconds ``from_pretrained`` took (the imports left out) and how the threads were set."""
    import onnxruntime
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    start = time.perf_counter()
    model = ORTModelForCausalLM.from_pretrained(out, session_options=options, local_files_only=True)
    load_seconds = time.perf_counter() - start
    eos = model.generation_config.eos_token_id

    class Stamps:
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def put(self, value: Any) -> None:
            self.stamps.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(ids: list[int], new_tokens: int) -> tuple[list[int], float, list[float]]:
        input_ids = torch.tensor([ids])
        streamer = Stamps()
        start = time.perf_counter()
        tokens = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos if isinstance(eos, int) else eos[0],
            streamer=streamer,
        )
        return tokens[0, len(ids) :].tolist(), start, streamer.stamps[1:]  # the streamer sees the prompt first

    def predict(ids: list[int]) -> list[int]:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        return logits[0].argmax(-1).tolist()

    control = f"onnxruntime SessionOptions intra_op_num_threads={threads}, inter_op_num_threads=1"
    return generate, predict, load_seconds, control


def load_executorch(out: Path, threads: int) -> tuple[Generate, Predict, float, str]:
    """An ``ExecuTorchModelForCausalLM`` on the exported ``.pte`` (its forward wrapped to note each call's end), the
    seconds ``from_pretrained`` took (the imports left out) and how the threads were set."""
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count, _unsafe_reset_threadpool

    _unsafe_reset_threadpool(threads)
    from optimum.executorch import ExecuTorchModelForCausalLM

    start = time.perf_counter()
    model = ExecuTorchModelForCausalLM.from_pretrained(out, local_files_only=True)
    load_seconds = time.perf_counter() - start
    forward = model.forward
    stamps: list[float] = []

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        logits = forward(*args, **kwargs)
        stamps.append(time.perf_counter())
        return logits

    model.forward = timed_forward  # generate() calls self.forward: the instance attribute wins

    def generate(ids: list[int], new_tokens: int) -> tuple[list[int], float, list[float]]:
        stamps.clear()
        start = time.perf_counter()
        tokens = model.generate(prompt_tokens=list(ids), max_seq_len=len(ids) + new_tokens)
        # each new token is the argmax of one forward call's logits: the last len(tokens) calls
        return tokens, start, stamps[-len(tokens) :]

    def predict(ids: list[int]) -> list[int]:
        import torch

        # one token per call at its cache position, as generate feeds the program
        return [int(forward(torch.tensor([[t]]), torch.tensor([i]))[0, -1].argmax()) for i, t in enumerate(ids)]

    control = (
        f"executorch pybindings _unsafe_reset_threadpool({threads}) before loading; "
        f"_threadpool_get_thread_count()={_threadpool_get_thread_count()}"
    )
    return generate, predict, load_seconds, control


# --- measurement -------------------------------------------------------------------------------------------------


def compatible_folder(folder: Path, work: Path) -> tuple[Path, str]:
    """``folder`` itself, or, under a transformers 4.x that cannot read it faithfully, a view of it in ``work``
    (every file symlinked, ``config.json`` rewritten) and what was changed.

    A config written by transformers 5 keeps the RoPE base in ``rope_parameters``; 4.x reads only a top-level
    ``rope_theta`` and silently falls back to its default (10000 instead of SmolLM2's 100000), which changes the
    greedy text. The view copies ``rope_parameters["rope_theta"]`` (and a non-default rope type as
    ``rope_scaling``) to the top level."""
    import transformers

    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters")
    if int(transformers.__version__.split(".")[0]) >= 5 or not rope or "rope_theta" in config:
        return folder, ""
    config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    view = work / "checkpoint"
    view.mkdir()
    for path in folder.iterdir():
        if path.name != "config.json":
            (view / path.name).symlink_to(path)
    (view / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return view, f"transformers {transformers.__version__}: rope_theta={rope['rope_theta']} copied to the top level"


def chat_prompt(folder: Path) -> tuple[Any, list[int]]:
    """The tokenizer and the ids of the chat prompt for ``QUESTION`` (``add_generation_prompt=True``), the rendered
    template tokenized without added special tokens (as ``apply_chat_template(tokenize=True)`` does)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except ValueError as error:  # transformers 4.x does not know v5's "TokenizersBackend" tokenizer_class
        if "TokenizersBackend" not in str(error):
            raise
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)  # same tokenizer.json
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"]


def run_figures(tokens: list[int], start: float, stamps: list[float]) -> dict[str, float]:
    """One run's time to first token and decode rate from the times its new tokens were known."""
    first = stamps[0] - start
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return {"new_tokens": len(tokens), "first_token_seconds": first, "decode_tokens_per_second": decode}


def measure(
    variant: Variant,
    folder: Path,
    threads: int,
    new_tokens: int,
    repeats: int,
    keep: Path | None,
    teacher: dict[str, Any] | None = None,
) -> Record:
    """Export, load and time greedy generation of one variant; a failure is kept in ``Record.error``."""
    import torch

    torch.set_num_threads(threads)
    record = Record(variant.name, variant.note, variant.options, str(folder), threads, versions=versions())
    work = Path(tempfile.mkdtemp(prefix=f"peers-{variant.runtime}-"))
    out = work / "artifact"
    try:
        folder, record.checkpoint_adapted = compatible_folder(folder, work)
        tokenizer, ids = chat_prompt(folder)
        record.prompt_tokens = len(ids)
        wall, cpu, rss = timed_export(variant, folder, out, threads)
        record.export_wall_seconds, record.export_cpu_seconds, record.export_peak_rss_mib = wall, cpu, rss
        record.artifact_files = artifact_files(out)
        record.artifact_mib = sum(record.artifact_files.values())
        loader = load_onnx if variant.runtime == "onnx" else load_executorch
        generate, predict, record.load_seconds, record.thread_control = loader(out, threads)
        record.thread_control += f"; torch.set_num_threads({threads})"
        outputs = []
        for _ in range(repeats + 1):  # the first run warms up
            tokens, begin, stamps = generate(ids, new_tokens)
            outputs.append(tokens)
            record.runs.append(run_figures(tokens, begin, stamps))
        measured = record.runs[1:]
        record.first_token_seconds = statistics.median(r["first_token_seconds"] for r in measured)
        record.decode_tokens_per_second = statistics.median(r["decode_tokens_per_second"] for r in measured)
        record.token_ids = outputs[1]
        record.new_tokens = len(outputs[1])
        record.runs_agree = all(tokens == outputs[1] for tokens in outputs)
        record.text = tokenizer.decode(outputs[1], skip_special_tokens=True)
        if teacher is not None:
            record.teacher_predictions = predict(teacher["ids"])
            prompt = teacher["ids"][: teacher["prompt_len"]]
            record.teacher_answer_ids = generate(prompt, teacher["answer_tokens"])[0]
        record.runtime_peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if keep is not None:
            shutil.copytree(out, keep / variant.name.replace(":", "-"), dirs_exist_ok=True)
    except Exception as error:  # one variant's failure is recorded; the others still run
        traceback.print_exc()
        record.error = f"{type(error).__name__}: {error}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return record


def versions() -> dict[str, str]:
    """The installed versions of the stack that matters here (absent packages left out)."""
    names = ["torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime"]
    names += ["optimum-executorch", "executorch", "torchao", "tokenizers", "accelerate"]
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="a local transformers checkpoint (config, weights, tokenizer)")
    parser.add_argument("--variant", action="append", default=[], help="repeat for several; see --list")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="measured runs after one warm-up run")
    parser.add_argument("--cache-len", type=int, default=128, help="ExecuTorch's static cache length (max_seq_len)")
    parser.add_argument("--out", type=Path, help="the JSON file to write (a list of records, one per variant)")
    parser.add_argument("--keep", type=Path, help="copy each variant's exported folder under this directory")
    parser.add_argument("--list", action="store_true", help="print the variants and their options, and exit")
    parser.add_argument("--teacher", type=Path, help="JSON {ids, prompt_len, answer_tokens}: teacher-forced argmaxes")
    parser.add_argument("--export-only", type=Path, help=argparse.SUPPRESS)  # the child process's export
    args = parser.parse_args()
    known = variants(args.cache_len)
    if args.list:
        for variant in known.values():
            print(f"{variant.name}: {variant.note}\n    options: {variant.options}")
        for name, reason in SKIPPED.items():
            print(f"{name}: not offered ({reason})")
        return
    if args.folder is None or not args.variant:
        parser.error("--folder and at least one --variant are needed")
    for name in args.variant:
        if name in SKIPPED:
            parser.error(f"{name}: {SKIPPED[name]}")
        if name not in known:
            parser.error(f"unknown variant {name!r}; known: {', '.join(known)}")
    folder = args.folder.expanduser().resolve()
    if args.export_only is not None:
        import torch

        torch.set_num_threads(args.threads)
        export_variant(known[args.variant[0]], folder, args.export_only)
        return
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    records = []
    for name in args.variant:
        teacher = json.loads(args.teacher.read_text()) if args.teacher else None
        record = measure(known[name], folder, args.threads, args.new_tokens, args.repeats, args.keep, teacher)
        records.append(asdict(record))
        if record.error:
            print(f"{name}: failed: {record.error}", file=sys.stderr)
            continue
        print(
            f"{name}: export {record.export_wall_seconds:.1f} s wall / {record.export_cpu_seconds:.1f} s CPU, "
            f"peak RSS {record.export_peak_rss_mib:.0f} MiB, artifact {record.artifact_mib:.1f} MiB, "
            f"load {record.load_seconds:.2f} s, first token {record.first_token_seconds:.3f} s, "
            f"decode {record.decode_tokens_per_second:.1f} tok/s; {record.text!r}",
            file=sys.stderr,
        )
    text = json.dumps(records, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)
    if any(record["error"] for record in records):
        sys.exit(1)


if __name__ == "__main__":
    main()
