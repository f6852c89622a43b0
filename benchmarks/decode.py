"""Decode speed against the machine's memory-bandwidth bound, per target, in one run.

    python benchmarks/decode.py                                  # SmolLM2-135M and a mid-size Llama, every target
    python benchmarks/decode.py --models mid-llama --targets onnx --threads 1

For each model (SmolLM2-135M-Instruct with its real weights, and a mid-size random Llama) and each
target, the script exports the generation ``decode`` graph (static cache, multi-token decode: the
one graph serves the prompt and every step) and measures:

- the export as a user runs it, ``hfexport export … --generation`` in a child process (as the peers'
  exports run: imports, the checkpoint's load and the artifact's writing included): wall and CPU
  time, seconds per stage, peak RSS; the artifact size, the time to load it;
- time to first token, prefill tokens/s and decode tokens/s of greedy generation on a chat prompt
  (median of ``--repeats`` runs after one warm-up run), next to eager PyTorch's ``generate``
  (static cache) in the same process;
- the memory bandwidth of the machine (a 1 GiB copy, measured again just before each row's decode:
  a shared machine's bandwidth changes within a run; a peer's right after its process), the bytes
  read per decoded token (the weights, and the static KV cache, which every step attends over) and
  the fraction of the bound (bandwidth / bytes) reached;
- greedy agreement with eager fp32: the number of leading new tokens identical to
  ``model.generate(do_sample=False)`` (token-exact is all of them), and the cosine similarity of
  the prompt's last logits with eager's (what to read for quantized variants);
- the teacher-forced top-1 agreement: eager fp32's own 64 greedy tokens after the chat prompt
  "What is the capital of France?" fed to the exported graph in one call, and the fraction of
  those positions where it picks the same next token as eager; and, for real checkpoints, the
  first line of the greedy answers to both prompts (does it still say Paris?). A peer's
  teacher-forced figures come from ``peers.py --teacher`` (its program fed the same tokens).

The bound of an fp32 row counts the model's weights once (a tied embedding table once, although an
ExecuTorch .pte stores it twice: as the table and as XNNPACK's packed output projection); a
quantized row counts its artifact's bytes less the fp32 embedding table, which a step reads one row
of; both add the static KV cache.

Peers in the same run: with ``--peers-dir DIR`` (the folder holding ``venv-onnx`` and
``venv-executorch``, each with torch 2.13.0 and optimum-onnx / optimum-executorch installed, outside
the checkout: see the README), each ``--peers`` variant of a real checkpoint is exported and timed by
``benchmarks/peers.py`` under its peer's own Python, one variant per process, and gets a row of the
same table: export wall and CPU time, peak RSS, artifact, load, first token, decode tokens/s and
greedy agreement with the same eager reference, and the teacher-forced top-1 and answer (its
program fed eager's tokens: ``peers.py --teacher``). A quantized peer row's bound counts its whole
artifact (less an fp32 embedding table).

Writes ``decode.md`` (the table) and ``decode.png`` (tokens/s per target against each model's
bound) into ``--out``. Ratios are what to read: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hfexport import AutoExportConfig, ExportFolder
from hfexport.generation import greedy_decode
from hfexport.models.loading import load_model, model_folder
from hfexport.presets import PRESETS
from hfexport.targets.onnx import OnnxDecoder

sys.path.insert(0, str(Path(__file__).parent))
from peers import timed_child
from stages_and_latency import SIZES  # the mid-size Llama of the stage benchmark

QUESTION = "What is the capital of France? Answer in one sentence, then name two famous museums there."
# the teacher-forced agreement: the model's own 64 greedy tokens after this chat prompt
TEACHER_FORCED_QUESTION = "What is the capital of France?"
HFEXPORT = [sys.executable, "-c", "from hfexport.cli import main; main()"]  # this venv's command line
SHORT_ANSWER_TOKENS = 24  # the greedy answer to TEACHER_FORCED_QUESTION that the table quotes
TEACHER_FORCED_TOKENS = 64


@dataclass
class Row:
    model: str
    target: str
    export_seconds: float = 0.0
    export_cpu_seconds: float = 0.0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    artifact_mb: float = 0.0
    load_seconds: float = 0.0
    first_token_seconds: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    bandwidth_gbs: float = 0.0  # measured just before this row's decode
    bound_tps: float = 0.0
    agreement: str = ""
    top1: float | None = None  # teacher-forced top-1 agreement with eager fp32
    answer: str = ""  # the greedy answer's text (real checkpoints)
    short_answer: str = ""  # the greedy answer to the teacher-forced prompt (real checkpoints)


def memory_bandwidth_gbs(repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by the fastest of ``repeats`` 1 GiB tensor copies."""
    source = torch.ones(2**28)  # 1 GiB of float32
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best / 1e9


def bytes_per_token(model: torch.nn.Module, cache_tokens: int, weight_bytes: float | None = None) -> float:
    """What one decode step reads at least: every weight once (tied weights once; ``weight_bytes``
    when given: a quantized artifact's) and the keys and values of ``cache_tokens`` tokens."""
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = 2 * config.num_hidden_layers * heads * head_dim * cache_tokens * 4
    return (sum(weights.values()) if weight_bytes is None else weight_bytes) + cache


def embedding_bytes(model: torch.nn.Module) -> int:
    """The input embedding table's bytes (a quantized artifact keeps it fp32; a step reads one row)."""
    table = model.get_input_embeddings().weight
    return table.numel() * table.element_size()


def build_model(name: str) -> tuple[torch.nn.Module, Path | None]:
    if name == "mid-llama":
        return PRESETS["tiny-llama"].build(**SIZES["mid"]), None
    return load_model(name), model_folder(name)


def prompt_ids(folder: Path | None, vocab: int, question: str = QUESTION) -> torch.Tensor:
    if folder is None:  # a random model has no tokenizer: random ids of a chat prompt's length
        return torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


class TeacherForced:
    """Eager fp32's own greedy continuation of a prompt and its logits at each of those positions;
    :meth:`top1` feeds the same tokens to an exported decode step in one call and counts the
    positions where both pick the same next token."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> None:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            self.tokens = model.generate(ids, generation_config=config)
            self.logits = model(self.tokens).logits
        self.ids, self.prompt_len = ids, ids.shape[1]

    def answer(self, step, cache_len: int, eos) -> torch.Tensor:
        """The step's own greedy continuation of the prompt (its first ``SHORT_ANSWER_TOKENS``)."""
        return greedy_decode(step, self.ids, SHORT_ANSWER_TOKENS, cache_len, eos_token_id=eos)

    def top1(self, step, cache_len: int) -> float:
        if callable(reset := getattr(step, "reset", None)):
            reset()  # the whole continuation goes in from slot 0, as greedy_decode's prompt does
        length = self.tokens.shape[1]
        valid = torch.zeros(1, cache_len, dtype=torch.long)
        valid[:, :length] = 1
        logits = torch.as_tensor(step(self.tokens, valid, torch.arange(length), torch.arange(length)[None]))
        return self.agreement(logits.argmax(-1))

    def agreement(self, predictions: torch.Tensor) -> float:
        """The fraction of the new tokens' positions where ``predictions`` ([1, length] next-token
        argmaxes over ``tokens``) pick eager's token."""
        span = slice(self.prompt_len - 1, self.tokens.shape[1] - 1)  # the predictions of the new tokens
        return float((predictions[0, span] == self.logits[0, span].argmax(-1)).double().mean())


def timed_generation(step, ids: torch.Tensor, new_tokens: int, cache_len: int, eos, repeats: int):
    """(tokens, first-token seconds, prefill tok/s, decode tok/s), medians over ``repeats`` after a warm-up.

    One decoder serves every run (reset before each, as :func:`greedy_decode` does), so the
    warm-up run leaves it warm, as a peer's loaded model is: a fresh ONNX Runtime session's first
    steps are slower (SmolLM2 int4: about 12.3 ms per step over the first ten against 11.1 after),
    which a 16-token answer does not average away."""
    runs, first_logits = [], None
    for _ in range(repeats + 1):
        decoder = FirstLogits(step)
        stamps: list[float] = []
        start = time.perf_counter()
        tokens = greedy_decode(
            decoder,
            ids,
            new_tokens,
            cache_len,
            eos_token_id=eos,
            on_token=lambda _, s=stamps: s.append(time.perf_counter()),
        )
        runs.append(run_figures(tokens, ids.shape[1], start, stamps))
        first_logits = decoder.first
    return (*medians(runs), first_logits)


def run_figures(tokens: torch.Tensor, prompt_len: int, start: float, stamps: list[float]) -> tuple:
    """(tokens, first-token seconds, prefill tok/s, decode tok/s) of one run from its token times."""
    first = stamps[0] - start
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return tokens, first, prompt_len / first, decode


def medians(runs: list[tuple]) -> tuple:
    """The first measured run's tokens and the median figures, the warm-up run (``runs[0]``) left out."""
    measured = runs[1:]
    return (measured[0][0], *(statistics.median(r[i] for r in measured) for i in (1, 2, 3)))


class FirstLogits:
    """A decode step that keeps the logits of its first call (the prompt's)."""

    def __init__(self, step) -> None:
        self.step, self.first = step, None

    def reset(self) -> None:
        self.step.reset()

    def __call__(self, *args):
        logits = self.step(*args)
        if self.first is None:
            self.first = torch.as_tensor(logits)[:, -1].clone()
        return logits


class Stamps:
    """A ``generate`` streamer that notes when each chunk of tokens arrives."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


class EagerDecoder:
    """Eager ``generate`` timed the same way: a streamer marks each new token."""

    def __init__(self, model: torch.nn.Module, cache_len: int) -> None:
        self.model, self.cache_len = model, cache_len

    def run(self, ids: torch.Tensor, new_tokens: int, eos, repeats: int):
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=new_tokens,
            do_sample=False,
            cache_implementation="static",
            max_cache_len=self.cache_len,
            eos_token_id=eos,
            pad_token_id=0,
        )
        runs = []
        for _ in range(repeats + 1):
            streamer = Stamps()
            start = time.perf_counter()
            with torch.no_grad():
                tokens = self.model.generate(ids, generation_config=config, streamer=streamer)
            # the streamer sees the prompt first
            runs.append(run_figures(tokens, ids.shape[1], start, streamer.stamps[1:]))
        return medians(runs)


def variant_config(variant: str) -> tuple[str, object]:
    """``target[:quantize][+pass…][-pass…]``: e.g. ``onnx``, ``onnx:int4``, ``onnx+onnx_ort_fusions``
    (a pass appended to the target's default list), ``executorch-attention_as_matmuls`` (a default
    pass left out, to measure what it brings)."""
    import re

    from hfexport.auto import AutoHfExporter

    head, *changes = re.split(r"(?=[+-])", variant)
    target, _, quantize = head.partition(":")
    values: dict[str, object] = {"export_format": target, "dynamic": True}
    if quantize:
        values["quantize"] = quantize
    config = AutoExportConfig.from_dict(values)
    if changes:
        passes = AutoHfExporter.from_config(config).pass_list(config)
        for change in changes:
            name = change[1:]
            if change[0] == "+":
                passes.append(name)
            else:
                passes = [p for p in passes if getattr(p, "name", p) != name]
        config.passes = passes
    return target, config


def batch1_decoder(export: ExportFolder, threads: int) -> object:
    """The export's batch-1 decoder; an ONNX Runtime session gets ``threads`` intra-op threads
    (torch's and ExecuTorch's are process-wide, set once)."""
    if export.manifest.target == "onnx":
        spec = export.manifest.component("decode")
        return OnnxDecoder(export.folder / spec.file, 1, spec, threads=threads)
    return export.decoder(batch_size=1)


def saved_folder(model: torch.nn.Module, folder: Path) -> Path:
    """A random model written where the command line can load it (``save_pretrained``)."""
    model.save_pretrained(folder)
    return folder


STAGE_LINE = re.compile(r"^\[\d+/\d+\] (\w+) done in ([\d.]+)s")


def cli_export(config, checkpoint: Path, out: Path, args) -> tuple[float, float, float, dict[str, float]]:
    """Export a variant's ``config`` (:func:`variant_config`) as a user does, ``hfexport export …
    --generation`` in a child process, as ``peers.py`` exports a peer: (wall seconds, CPU seconds,
    peak RSS MiB, seconds per stage). Its imports, the checkpoint's load and the artifact's writing
    count, as they do for the peers. A variant that changes the pass list gives it as ``--config``."""
    command = [*HFEXPORT, "export", str(checkpoint), "--format", config.export_format, "--generation"]
    command += ["--max-cache-len", str(args.cache_len), "--out", str(out), "--overwrite"]
    if getattr(config, "quantize", None):
        command += ["--quantize", config.quantize]
    if config.passes is not None:
        (out.parent / "passes.json").write_text(json.dumps({"passes": [getattr(p, "name", p) for p in config.passes]}))
        command += ["--config", str(out.parent / "passes.json")]
    stages: dict[str, float] = {}

    def on_line(line: str) -> None:
        print(line, end="", file=sys.stderr)
        if match := STAGE_LINE.match(line):
            stages[match[1]] = stages.get(match[1], 0.0) + float(match[2])

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}  # as peers.py sets torch's threads
    wall, cpu, rss = timed_child(command, env, on_line)
    return wall, cpu, rss, stages


def folder_mb(folder: Path, names: list[str]) -> float:
    return sum((folder / name).stat().st_size for name in names) / 2**20


def leading_agreement(tokens: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> str:
    got, expected = tokens[0, prompt_len:].tolist(), reference[0, prompt_len:].tolist()
    pairs = enumerate(zip(got, expected, strict=False))
    same = next((i for i, (a, b) in pairs if a != b), min(len(got), len(expected)))
    exact = same == len(expected) == len(got)
    return f"{'exact' if exact else 'differs'} ({same}/{len(expected)})"


def answer_text(tokenizer, tokens: torch.Tensor, prompt_len: int) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(tokens[0, prompt_len:], skip_special_tokens=True).strip()


def benchmark(args: argparse.Namespace) -> list[Row]:
    torch.set_num_threads(args.threads)
    if "executorch" in args.targets:
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        _unsafe_reset_threadpool(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as work:  # a random model's folder, for the command line
        for model_name in args.models:
            model, folder = build_model(model_name)
            ids = prompt_ids(folder, model.config.vocab_size)
            forced_ids = prompt_ids(folder, model.config.vocab_size, TEACHER_FORCED_QUESTION)
            teacher = TeacherForced(model, forced_ids, TEACHER_FORCED_TOKENS)
            tokenizer = None
            if folder is not None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(folder)
            eos = None if folder is None else model.generation_config.eos_token_id
            with torch.no_grad():
                prompt_logits = model(ids).logits[:, -1]
            eager = EagerDecoder(model, args.cache_len)
            bandwidth = memory_bandwidth_gbs()
            reference, first, prefill, decode = eager.run(ids, args.new_tokens, eos, args.repeats)
            row = Row(model_name, "eager", first_token_seconds=first, prefill_tps=prefill, decode_tps=decode)
            # the static-cache decode graph attends over every slot of the cache
            bound = bandwidth * 1e9 / bytes_per_token(model, args.cache_len)
            row.bandwidth_gbs, row.bound_tps, row.agreement, row.top1 = bandwidth, bound, "reference", 1.0
            row.answer = answer_text(tokenizer, reference, ids.shape[1])
            short = teacher.tokens[:, : teacher.prompt_len + SHORT_ANSWER_TOKENS]
            row.short_answer = answer_text(tokenizer, short, teacher.prompt_len)
            rows.append(row)
            print(f"{model_name} eager: decode {decode:.1f} tok/s (bound {bound:.1f})", file=sys.stderr)
            checkpoint = folder if folder is not None else saved_folder(model, Path(work) / model_name)
            for variant in args.targets:
                _, config = variant_config(variant)
                with tempfile.TemporaryDirectory() as scratch:
                    out = Path(scratch) / "export"
                    row = Row(model_name, variant)
                    row.export_seconds, row.export_cpu_seconds, row.peak_rss_mb, row.stage_seconds = cli_export(
                        config, checkpoint, out, args
                    )
                    export = ExportFolder(out)
                    row.artifact_mb = folder_mb(out, [spec.file for spec in export.manifest.components.values()])

                    def load(export: ExportFolder = export) -> object:
                        return batch1_decoder(export, args.threads)

                    start = time.perf_counter()
                    load()
                    row.load_seconds = time.perf_counter() - start
                    row.bandwidth_gbs = memory_bandwidth_gbs()
                    tokens, first, prefill, decode, logits = timed_generation(
                        load(),
                        ids,
                        args.new_tokens,
                        args.cache_len,
                        eos,
                        args.repeats,
                    )
                    row.top1 = teacher.top1(load(), args.cache_len)
                    short = teacher.answer(load(), args.cache_len, eos)
                row.answer = answer_text(tokenizer, tokens, ids.shape[1])
                row.short_answer = answer_text(tokenizer, short, teacher.prompt_len)
                row.first_token_seconds, row.prefill_tps, row.decode_tps = first, prefill, decode
                quantized = getattr(config, "quantize", None)
                weight_bytes = row.artifact_mb * 2**20 - embedding_bytes(model) if quantized else None
                row.bound_tps = row.bandwidth_gbs * 1e9 / bytes_per_token(model, args.cache_len, weight_bytes)
                cosine = float(torch.nn.functional.cosine_similarity(logits.flatten(), prompt_logits.flatten(), dim=0))
                row.agreement = f"{leading_agreement(tokens, reference, ids.shape[1])}, logit cosine {cosine:.4f}"
                rows.append(row)
                print(
                    f"{model_name} {variant}: export {row.export_seconds:.0f} s, decode {decode:.1f} tok/s "
                    f"({decode / row.bound_tps:.0%} of the bound), {row.agreement}, teacher-forced top-1 {row.top1:.0%}"
                    + (f", answer: {row.answer!r}" if row.answer else ""),
                    file=sys.stderr,
                )
            if folder is not None:
                for variant in args.peers:
                    row = peer_row(
                        args, variant, model_name, folder, model, reference, ids.shape[1], teacher, tokenizer
                    )
                    if row is not None:
                        rows.append(row)
    return rows


PEERS_SCRIPT = Path(__file__).parent / "peers.py"


def peer_row(args, variant: str, model_name: str, folder: Path, model, reference, prompt_len: int, teacher, tokenizer):
    """One peer variant's row, measured by ``peers.py`` under the peer's own venv (``None`` if it failed)."""
    runtime = "onnx" if variant.startswith("optimum-onnx") else "executorch"
    python = Path(args.peers_dir) / f"venv-{runtime}" / "bin" / "python"
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "record.json"
        command = [str(python), str(PEERS_SCRIPT), "--folder", str(folder), "--variant", variant]
        command += ["--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
        command += ["--repeats", str(args.repeats), "--cache-len", str(args.cache_len), "--out", str(out)]
        forced = {"ids": teacher.tokens[0].tolist(), "prompt_len": teacher.prompt_len}
        (Path(work) / "teacher.json").write_text(json.dumps({**forced, "answer_tokens": SHORT_ANSWER_TOKENS}))
        command += ["--teacher", str(Path(work) / "teacher.json")]
        print(f"{model_name} {variant}: {' '.join(command)}", file=sys.stderr)
        subprocess.run(command, check=False)
        bandwidth = memory_bandwidth_gbs()
        record = json.loads(out.read_text())[0] if out.is_file() else {"error": "peers.py wrote no record"}
    if record.get("error"):
        print(f"{model_name} {variant}: failed: {record['error']}", file=sys.stderr)
        return None
    row = Row(model_name, variant, record["export_wall_seconds"], record["export_cpu_seconds"], bandwidth_gbs=bandwidth)
    row.peak_rss_mb, row.artifact_mb, row.load_seconds = (
        record["export_peak_rss_mib"],
        record["artifact_mib"],
        record["load_seconds"],
    )
    row.first_token_seconds, row.decode_tps = record["first_token_seconds"], record["decode_tokens_per_second"]
    row.prefill_tps = record["prompt_tokens"] / row.first_token_seconds
    quantized = "8da" in variant  # its bound: the whole artifact (the embedding may be quantized too)
    weight_bytes = row.artifact_mb * 2**20 if quantized else None
    if quantized and "fp32-embedding" in variant:
        weight_bytes -= embedding_bytes(model)  # a step reads one row of the fp32 table, as for hfexport's
    row.bound_tps = bandwidth * 1e9 / bytes_per_token(model, args.cache_len, weight_bytes)
    tokens = torch.cat([reference[:, :prompt_len], torch.tensor([record["token_ids"]])], dim=1)
    row.agreement = leading_agreement(tokens, reference, prompt_len)
    if record["prompt_tokens"] != prompt_len:
        row.agreement += f" (its prompt: {record['prompt_tokens']} tokens)"
    row.answer = record["text"].strip()
    if record.get("teacher_predictions"):
        row.top1 = teacher.agreement(torch.tensor([record["teacher_predictions"]]))
        row.short_answer = tokenizer.decode(record["teacher_answer_ids"], skip_special_tokens=True).strip()
    print(f"{model_name} {variant}: decode {row.decode_tps:.1f} tok/s, {row.agreement}", file=sys.stderr)
    return row


def markdown(rows: list[Row], bandwidth_note: str, threads: int) -> str:
    lines = [
        f"Decode at batch 1, {threads} thread(s); {bandwidth_note}.",
        "",
        "| model | target | export (s) | export CPU (s) | stages (s) | peak RSS (MiB) | artifact (MiB) | load (s) "
        "| first token (s) "
        "| prefill tok/s | decode tok/s | bandwidth (GB/s) | bound tok/s | of bound | greedy vs eager "
        f"| teacher-forced top-1 ({TEACHER_FORCED_TOKENS}) |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        stages = ", ".join(f"{name} {seconds:.0f}" for name, seconds in r.stage_seconds.items())
        top1 = "–" if r.top1 is None else f"{r.top1:.0%}"
        lines.append(
            f"| {r.model} | {r.target} | {r.export_seconds:.0f} | {r.export_cpu_seconds:.0f} | {stages} "
            f"| {r.peak_rss_mb:.0f} | {r.artifact_mb:.0f} "
            f"| {r.load_seconds:.2f} | {r.first_token_seconds:.3f} | {r.prefill_tps:.0f} | {r.decode_tps:.1f} "
            f"| {r.bandwidth_gbs:.1f} | {r.bound_tps:.1f} | {r.decode_tps / r.bound_tps:.0%} | {r.agreement} | {top1} |"
        )
    answers = [r for r in rows if r.answer]
    if answers:
        lines += ["", "Greedy answers (first line):", ""]
        lines += [f"- {r.model} {r.target}: {r.answer.splitlines()[0]!r}" for r in answers]
    short = [r for r in rows if r.short_answer]
    if short:
        lines += ["", f"Greedy answers to {TEACHER_FORCED_QUESTION!r} (the teacher-forced prompt, first line):", ""]
        lines += [f"- {r.model} {r.target}: {r.short_answer.splitlines()[0]!r}" for r in short]
    return "\n".join(lines) + "\n"


def chart(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    widest = max(sum(r.model == m for r in rows) for m in models)
    figure, axes = plt.subplots(1, len(models), figsize=(max(5, 0.8 * widest) * len(models), 5), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r.model == model]
        names = [r.target for r in mine]
        colors = ["tab:orange" if r.target.startswith("optimum") else "tab:blue" for r in mine]
        axis.bar(names, [r.decode_tps for r in mine], color=colors, label="decode (orange: peers)")
        axis.scatter(names, [r.bound_tps for r in mine], color="tab:red", marker="_", s=900, label="bandwidth bound")
        axis.set_xticks(range(len(names)), names, rotation=35, ha="right")
        axis.set_title(model)
        axis.set_ylabel("decode tokens/s (batch 1)")
        # headroom, so the legend covers no bar or bound
        axis.set_ylim(0, 1.4 * max(max(r.decode_tps, r.bound_tps) for r in mine))
        axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-instruct,mid-llama")
    parser.add_argument(
        "--targets",
        default="dynamo,onnx,onnx:int4,onnx:int8,executorch,executorch:8da4w,executorch:8da8w",
        help="variants: target[:quantize][+pass][-pass]",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--cache-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--peers-dir", help="the folder of the peers' venvs (venv-onnx, venv-executorch); none: no peers"
    )
    parser.add_argument(
        "--peers",
        default="optimum-onnx,optimum-executorch,optimum-executorch:custom,optimum-executorch:8da4w",
        help="peer variants (benchmarks/peers.py --list), for real checkpoints, with --peers-dir",
    )
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.targets = [t for t in args.targets.split(",") if t]
    args.peers = [p for p in args.peers.split(",") if p] if args.peers_dir else []
    rows = benchmark(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = [r.bandwidth_gbs for r in rows]
    note = (
        f"memory bandwidth {min(measured):.1f}–{max(measured):.1f} GB/s "
        "(a 1 GiB copy just before each row's decode; each row's bound uses its own)"
    )
    (out / "decode.md").write_text(markdown(rows, note, args.threads))
    chart(rows, out / "decode.png")
    print(markdown(rows, note, args.threads))
    print(f"wrote {out / 'decode.md'} and {out / 'decode.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
