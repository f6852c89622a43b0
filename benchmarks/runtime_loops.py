"""hfexport's generation exports in the runtimes' own loops, side by side with the runtimes' own exporters.

    python benchmarks/runtime_loops.py --builder-python /work/peers/venv-genai/bin/python
    python benchmarks/runtime_loops.py --variants onnx:fp32,onnx:int4 --rounds 5

Each variant is exported as a user runs it, in a child process: ``hfexport export CHECKPOINT --format onnx|executorch
--generation [--quantize …]`` (the command line writes the runtimes' own interface), and, for ONNX, ONNX Runtime GenAI's
model builder (``python …/onnxruntime_genai/models/builder.py -i CHECKPOINT -o OUT -p fp32|int4 -e cpu``) under
``--builder-python``, the Python of a venv outside the checkout with torch 2.13.0, transformers and onnxruntime-genai:

    python3 -m venv /work/peers/venv-genai
    /work/peers/venv-genai/bin/pip install torch==2.13.0          # the CPU wheel, first, from the local disk
    /work/peers/venv-genai/bin/pip install onnxruntime-genai==0.18.0 transformers onnx onnx_ir onnxscript

and, for ExecuTorch, optimum-executorch's ``optimum-cli export executorch … --recipe xnnpack --use_custom_sdpa
--use_custom_kv_cache [--qlinear 8da4w]`` under ``--optimum-python`` (its own venv: it pins transformers 5.0.0rc1):

    python3 -m venv /work/peers/venv-optimum-et
    /work/peers/venv-optimum-et/bin/pip install torch==2.13.0
    /work/peers/venv-optimum-et/bin/pip install executorch==1.4.1 torch==2.13.0 transformers==5.0.0rc1 \
        optimum==2.0.0 accelerate optimum-executorch==1.1.0
 Per export: wall seconds, CPU seconds (user + system) and peak RSS of the child (``os.wait4``).

Then every folder is run in its runtime's own loop, in alternating rounds (the machine is shared: round r of every
variant runs before round r + 1 of any), each run in a fresh process and the order rotated each round (in one process
a variant's speed depended on which folders were loaded before it): ONNX folders by ``og.Model`` / ``og.Generator``
(greedy), ``.pte`` programs by ExecuTorch's ``TextLLMRunner`` (temperature 0) with the ``tokenizer.json`` beside them.
A run first answers ``QUESTION`` (the answer column; also the warm-up), then the checkpoint's chat template around
``STORY``, which every variant answers at length (ONNX Runtime GenAI is held to the full count; ``results.json``
records how many tokens each run timed), is timed: time to first token (the prompt in, one token out) and decode
tokens/s (the later tokens over the time from the first to the last). For ONNX folders also how near they stay to
transformers' fp32 model, teacher-forced over three prompts and transformers' greedy continuations of 200 tokens
each, fed at once: how often the argmax is the next token (top-1) and the mean KL divergence from transformers'
next-token distribution. The table gives the medians over the rounds and each variant's answer; ``results.json``
every figure; ``decode.png`` the decode speeds as a chart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QUESTION = "What is the capital of France?"
# timed on a prompt every variant answers at length: an answer that stops after 9 tokens is timed on its first
# steps only, which run slower than the later ones (ONNX Runtime GenAI runs the full count: min_length)
STORY = "Write a long story about a lighthouse keeper and a storm."
HFEXPORT = {
    "onnx:fp32": ["--format", "onnx"],
    "onnx:int4": ["--format", "onnx", "--quantize", "int4"],
    "executorch:fp32": ["--format", "executorch"],
    "executorch:8da4w": ["--format", "executorch", "--quantize", "8da4w"],
    # not run by default: the int4 default's blocks of 64 against the blocks of 32 it had before 2026-12-07
    "onnx:int4-blocks32": ["--format", "onnx", "--quantize", "int4"],
}
DEFAULT_VARIANTS = ("onnx:fp32", "onnx:int4", "executorch:fp32", "executorch:8da4w")
CONFIGS = {"onnx:int4-blocks32": {"quantize_group_size": 32}}  # written to a --config file
QUALITY_TOKENS = 200  # per quality prompt; the prompt and these fit the default cache of 256
BUILDER = {"onnx:fp32": "fp32", "onnx:int4": "int4"}
# optimum-executorch's recipe for ExecuTorch's LLM runner: its custom SDPA and KV cache (and 8da4w linears)
OPTIMUM = {
    "executorch:fp32": ["--use_custom_sdpa", "--use_custom_kv_cache"],
    "executorch:8da4w": [
        "--use_custom_sdpa",
        "--use_custom_kv_cache",
        "--qlinear",
        "8da4w",
        "--qlinear_group_size",
        "32",
    ],
}


PEAK_LINE = re.compile(r"^peak RSS (\d+) MiB$", re.MULTILINE)


def timed_child(command: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``command``; its wall and CPU seconds and peak RSS (MiB) from its own rusage."""
    started = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed; see {log}")
    # hfexport resets the kernel's high-water mark at each pipeline step, which lowers the child's
    # ru_maxrss to the peak since its last step: it prints its whole peak as its last line
    printed = [int(m) for m in PEAK_LINE.findall(log.read_text(errors="replace"))]
    return {
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
        "system_seconds": round(usage.ru_stime, 1),
        "peak_rss_mib": max([round(usage.ru_maxrss / 1024), *printed]),
    }


def exported(command: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """:func:`timed_child`'s figures of the export ``command`` writing ``out``, or those recorded beside ``out`` by an
    earlier run with the same ``--work`` folder (the export is not run again: delete the folder to redo it)."""
    recorded = out.with_suffix(".json")
    if out.exists() and recorded.exists():
        return json.loads(recorded.read_text())
    figures = timed_child(command, out.with_suffix(".log"), env)
    recorded.write_text(json.dumps(figures))
    return figures


def builder_script(python: str) -> Path:
    """The builder's ``builder.py`` in ``python``'s onnxruntime-genai (0.18 runs it as a script: its imports are
    its folder's, so ``python -m onnxruntime_genai.models.builder`` fails)."""
    found = subprocess.run(
        [python, "-c", "import onnxruntime_genai, pathlib; print(pathlib.Path(onnxruntime_genai.__file__).parent)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(found.stdout.strip()) / "models" / "builder.py"


def export_all(args: argparse.Namespace, work: Path, checkpoint: Path) -> list[dict[str, Any]]:
    rows = []
    for variant in args.variants:
        out = work / f"hfexport-{variant.replace(':', '-')}"
        command = [sys.executable, "-m", "hfexport.cli", "export", str(checkpoint), *HFEXPORT[variant]]
        command += ["--generation", "--max-cache-len", str(args.cache_len), "--out", str(out), "--overwrite"]
        if variant in CONFIGS:
            config = work / f"{out.name}.config.json"
            config.write_text(json.dumps(CONFIGS[variant]))
            command += ["--config", str(config)]
        print(f"export {variant} (hfexport) ...", file=sys.stderr, flush=True)
        rows.append(
            {
                "variant": variant,
                "exporter": "hfexport",
                "folder": str(out),
                **exported(command, out),
            }
        )
        if variant in BUILDER and args.builder_python:
            out = work / f"builder-{variant.replace(':', '-')}"
            command = [args.builder_python, str(builder_script(args.builder_python)), "-i", str(checkpoint)]
            command += ["-o", str(out), "-p", BUILDER[variant], "-e", "cpu", "-c", str(work / "builder-cache")]
            print(f"export {variant} (ONNX Runtime GenAI builder) ...", file=sys.stderr, flush=True)
            rows.append(
                {
                    "variant": variant,
                    "exporter": "builder",
                    "folder": str(out),
                    **exported(command, out),
                }
            )
        if variant in OPTIMUM and args.optimum_python:
            out = work / f"optimum-{variant.replace(':', '-')}"
            command = [str(Path(args.optimum_python).parent / "optimum-cli"), "export", "executorch"]
            command += ["--model", str(checkpoint), "--task", "text-generation", "--recipe", "xnnpack"]
            command += [*OPTIMUM[variant], "--max_seq_len", str(args.cache_len), "--output_dir", str(out)]
            print(f"export {variant} (optimum-executorch) ...", file=sys.stderr, flush=True)
            rows.append(
                {
                    "variant": variant,
                    "exporter": "optimum-executorch",
                    "folder": str(out),
                    # its .pte has no get_eos_ids: the runner takes the stop token from the tokenizer, which reads
                    # it from tokenizer_config.json when given the checkpoint folder (tokenizer.json alone: none)
                    "tokenizer": str(checkpoint),
                    **exported(command, out, {"HF_HUB_OFFLINE": "1"}),
                }
            )
    return rows


class GenAiLoop:
    """``og.Generator``, greedy, over an ONNX Runtime GenAI folder."""

    def __init__(self, folder: str) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.model = og.Model(folder)
        self.tokenizer = og.Tokenizer(self.model)

    def quality(self, references: list[tuple[list[int], int, Any]]) -> dict[str, float]:
        """Teacher-forced, over each reference (a prompt and transformers' greedy fp32 continuation, fed at once):
        how often the argmax after a continuation's token is the next one (``teacher_forced_top1``), and the mean
        KL divergence from transformers' next-token distribution to this folder's (``kl_from_eager``)."""
        import numpy as np

        hits, divergences = [], []
        for ids, prompt_len, eager in references:
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=len(ids) + 1, do_sample=False)
            generator = self.og.Generator(self.model, params)
            generator.append_tokens(np.array(ids, dtype=np.int32))
            logits = np.asarray(generator.get_output("logits"))[0, prompt_len - 1 : len(ids) - 1].astype(np.float64)
            shifted = logits - logits.max(-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
            expected = eager[prompt_len - 1 : len(ids) - 1]
            hits.extend(logits.argmax(-1) == np.array(ids[prompt_len:]))
            divergences.extend((np.exp(expected) * (expected - log_probs)).sum(-1))
        return {
            "teacher_forced_top1": round(float(np.mean(hits)), 3),
            "kl_from_eager": round(float(np.mean(divergences)), 4),
        }

    def __call__(self, question: str, new_tokens: int) -> tuple[float, float, str, int]:
        og = self.og
        prompt = self.tokenizer.apply_chat_template(
            json.dumps([{"role": "user", "content": question}]), add_generation_prompt=True
        )
        ids = self.tokenizer.encode(prompt)
        params = og.GeneratorParams(self.model)
        length = len(ids) + new_tokens
        params.set_search_options(max_length=length, min_length=length if question == STORY else 0, do_sample=False)
        generator = og.Generator(self.model, params)
        started = time.perf_counter()
        generator.append_tokens(ids)
        generator.generate_next_token()
        first = time.perf_counter()
        count = 1
        while not generator.is_done() and count < new_tokens:
            generator.generate_next_token()
            count += 1
        last = time.perf_counter()
        answer = self.tokenizer.decode(generator.get_sequence(0)[len(ids) :])
        return first - started, (count - 1) / (last - first) if count > 1 else 0.0, answer, count


class RunnerLoop:
    """ExecuTorch's ``TextLLMRunner``, temperature 0, over a ``.pte`` and the tokenizer beside it."""

    def __init__(self, folder: str, tokenizer_path: str | None = None) -> None:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  the runner's build has them
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
        from transformers import AutoTokenizer

        self.config_class = GenerationConfig
        pte = next(Path(folder).glob("*.pte"))
        self.runner = TextLLMRunner(str(pte), tokenizer_path or str(Path(folder) / "tokenizer.json"))
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or folder)

    def __call__(self, question: str, new_tokens: int) -> tuple[float, float, str, int]:
        times: list[float] = []
        pieces: list[str] = []

        def on_piece(piece: str) -> None:
            times.append(time.perf_counter())
            pieces.append(piece)

        messages = [{"role": "user", "content": question}]
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        self.runner.reset()
        started = time.perf_counter()
        config = self.config_class(temperature=0.0, echo=False, max_new_tokens=new_tokens)
        self.runner.generate(prompt, config, token_callback=on_piece)
        decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return times[0] - started, decode, "".join(pieces), len(times)


QUALITY_PROMPTS = (STORY, "Explain how a refrigerator works, step by step.", "List ten facts about the Moon.")


def eager_references(checkpoint: Path, new_tokens: int) -> list[tuple[list[int], int, Any]]:
    """Per quality prompt: the prompt's ids and transformers' greedy fp32 continuation (``model.generate``), the
    prompt's length, and transformers' log-probabilities after each of those tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    references = []
    for question in QUALITY_PROMPTS:
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            ids = model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            log_probs = torch.log_softmax(model(ids).logits[0].float(), -1).numpy()
        references.append((ids[0].tolist(), prompt["input_ids"].shape[1], log_probs))
    return references


def one_run(kind: str, folder: str, tokenizer: str | None, new_tokens: int) -> dict[str, Any]:
    """In a fresh process: the loop's answer to ``QUESTION`` (its warm-up), then one timed run over ``STORY``."""
    loop = GenAiLoop(folder) if kind == "onnx" else RunnerLoop(folder, tokenizer)
    answer = loop(QUESTION, new_tokens)[2]
    first, decode, _, tokens = loop(STORY, new_tokens)
    return {
        "first_token_seconds": round(first, 4),
        "decode_tokens_per_second": round(decode, 2),
        "tokens": tokens,
        "answer": answer,
    }


def in_turns(items: list[Any], round_index: int) -> list[Any]:
    """``items`` in the order of round ``round_index``: rotated by one each round, so none is always first."""
    turn = round_index % len(items)
    return items[turn:] + items[:turn]


def decode_rounds(rows: list[dict[str, Any]], rounds: int, new_tokens: int, checkpoint: Path) -> None:
    """Each run in its own process, the variants in turns, the order rotated each round: in one process the
    variants loaded later ran up to 5% faster or slower than when loaded first (the same folders, swapped; SmolLM2
    int4 in ``og.Generator``), which favoured whichever the order did."""
    for row in rows:
        row["runs"] = []
    for index in range(rounds):
        for row in in_turns(rows, index):
            kind = "onnx" if row["variant"].startswith("onnx") else "executorch"
            command = [sys.executable, __file__, "--one", kind, row["folder"], "--new-tokens", str(new_tokens)]
            command += ["--tokenizer", row["tokenizer"]] if row.get("tokenizer") else []
            found = subprocess.run(command, capture_output=True, text=True)
            if found.returncode != 0:
                raise RuntimeError(f"{row['variant']} ({row['exporter']}) failed:\n{found.stderr[-2000:]}")
            run = json.loads(found.stdout.strip().splitlines()[-1])
            row["answer"] = run.pop("answer")
            row["runs"].append(run)
        print(f"round {index + 1}/{rounds} done", file=sys.stderr, flush=True)
    references = eager_references(checkpoint, QUALITY_TOKENS)
    for row in rows:
        if row["variant"].startswith("onnx"):
            row.update(GenAiLoop(row["folder"]).quality(references))
    for row in rows:
        row["first_token_seconds"] = statistics.median(r["first_token_seconds"] for r in row["runs"])
        row["decode_tokens_per_second"] = statistics.median(r["decode_tokens_per_second"] for r in row["runs"])


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | exporter | export wall s | export CPU s | export peak RSS MiB | runtime loop | first token ms "
        "| decode tok/s | teacher-forced top-1 | KL from eager | answer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        loop = "og.Generator" if row["variant"].startswith("onnx") else "TextLLMRunner"
        answer = " ".join(row["answer"].split())[:70].replace("|", "\\|")
        top1 = f"{row['teacher_forced_top1']:.1%}" if "teacher_forced_top1" in row else "–"
        kl = f"{row['kl_from_eager']:.3f}" if "kl_from_eager" in row else "–"
        lines.append(
            f"| {row['variant']} | {row['exporter']} | {row['wall_seconds']} | {row['cpu_seconds']} | "
            f"{row['peak_rss_mib']} | {loop} | {row['first_token_seconds'] * 1000:.0f} | "
            f"{row['decode_tokens_per_second']:.1f} | {top1} | {kl} | {answer} |"
        )
    lines += [
        "",
        "| variant | hfexport ÷ peer, decode tok/s (median over the rounds of the same round's ratio) |",
        "|---|---|",
    ]
    for row in rows:
        peer = next((p for p in rows if p["variant"] == row["variant"] and p["exporter"] != "hfexport"), None)
        if row["exporter"] == "hfexport" and peer is not None:
            ratios = [
                mine["decode_tokens_per_second"] / theirs["decode_tokens_per_second"]
                for mine, theirs in zip(row["runs"], peer["runs"], strict=True)
                if theirs["decode_tokens_per_second"]
            ]
            lines.append(f"| {row['variant']} | {statistics.median(ratios):.2f}× ({peer['exporter']}) |")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['variant']}\n{row['exporter']}" for row in rows]
    colours = [{"hfexport": "tab:blue", "builder": "tab:orange"}.get(row["exporter"], "tab:green") for row in rows]
    figure, axis = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    axis.bar(labels, [row["decode_tokens_per_second"] for row in rows], color=colours)
    axis.set_ylabel("decode tokens/s (median)")
    axis.set_title("SmolLM2-135M-Instruct in the runtimes' own loops (blue: hfexport; orange, green: the peers)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="smollm2-135m-instruct")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated, of {', '.join(HFEXPORT)}"
    )
    parser.add_argument("--builder-python", help="the Python of a venv with onnxruntime-genai's builder (torch 2.13.0)")
    parser.add_argument("--optimum-python", help="the Python of a venv with optimum-executorch (torch 2.13.0)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", help="keep the exports in this folder, and reuse those it holds")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/runtime-loops")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)  # one timed run
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(*args.one, args.tokenizer, args.new_tokens)))
        return 0
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in HFEXPORT]
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(HFEXPORT)}")
    from hfexport.checkpoints import checkpoint_folder

    checkpoint = checkpoint_folder(args.checkpoint) if "/" not in args.checkpoint else Path(args.checkpoint)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory(prefix="runtime-loops-")
    with keep as work:
        Path(work).mkdir(parents=True, exist_ok=True)
        rows = export_all(args, Path(work), checkpoint)
        decode_rounds(rows, args.rounds, args.new_tokens, checkpoint)
    for row in rows:
        row.pop("folder")
        row.pop("tokenizer", None)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    chart(rows, out / "decode.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
