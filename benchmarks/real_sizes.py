"""Exports of the sizes people deploy (Llama-3.2-1B and -3B shapes), side by side with ONNX Runtime GenAI's builder.

    python benchmarks/real_sizes.py --builder-python /work/peers/venv-genai/bin/python
    python benchmarks/real_sizes.py --shapes llama-3.2-1b --variants onnx:int4

No weights are downloaded: each shape is a random-weight bfloat16 checkpoint made from the model's real config
(``LlamaForCausalLM(config).save_pretrained``, seeded), with SmolLM2-135M-Instruct's tokenizer files beside it (its ids
are within the vocabulary; the text is noise, the shapes and bytes are real). Each variant is exported in a child
process as a user runs it (``hfexport export CHECKPOINT --format onnx|executorch --generation [--quantize
int4|8da4w]``; the builder as in ``runtime_loops.py``, ONNX only); per export: wall seconds, CPU seconds (user +
system) and peak RSS of the child, and for hfexport each pipeline stage's seconds and peak RSS from its progress lines
(what is left of the wall time is loading, the dtype conversion, the generation checks and the save). Each export runs
``--rounds`` times, the exporters in turns, the order rotated each round, and the table gives each exporter's run of
median CPU time (mostly the kernel's, writing the folder through the page cache, which moved the builder's 1B fp32
export from 14 to 23 CPU seconds between two runs); ``results.json`` has every round. Then the last round's folder
runs in a child: ``og.Model`` + ``og.Generator``, or the ``.pte``'s LLM-runner ``forward`` in the ExecuTorch runtime,
16 greedy tokens (decode tokens/s). Folders are deleted as soon as they are measured.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from runtime_loops import BUILDER, builder_script, in_turns, timed_child

# the published configs' shapes (meta-llama/Llama-3.2-1B-Instruct, -3B-Instruct)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
    "llama-3.2-3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
}
HFEXPORT = {
    "onnx:fp32": ["--format", "onnx"],
    "onnx:int4": ["--format", "onnx", "--quantize", "int4"],
    "executorch:fp32": ["--format", "executorch"],
    "executorch:8da4w": ["--format", "executorch", "--quantize", "8da4w"],
}
STAGE_LINE = re.compile(r"\[\d+/\d+\] (\w+) done in ([\d.]+)s, peak RSS (\d+) MiB")
RUN_IN_GENAI = """
import sys, time
import numpy as np
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
params = og.GeneratorParams(model)
params.set_search_options(max_length=24, do_sample=False)
generator = og.Generator(model, params)
generator.append_tokens(np.arange(1, 9, dtype=np.int32))
generator.generate_next_token()
started = time.perf_counter()
for _ in range(15):
    generator.generate_next_token()
print(15 / (time.perf_counter() - started))
"""
# the LLM runner's forward(tokens, input_pos) in the ExecuTorch runtime, greedy, as TextLLMRunner calls it (random
# weights make ids the copied tokenizer cannot decode, so the runner's text callback is left out)
RUN_IN_EXECUTORCH = """
import sys, time
from pathlib import Path
import torch
import executorch.extension.llm.custom_ops.custom_ops  # the runner's build has them
from executorch.runtime import Runtime
method = Runtime.get().load_program(next(Path(sys.argv[1]).glob("*.pte"))).load_method("forward")
prompt = torch.arange(1, 9)[None]
token = int(method.execute([prompt, torch.arange(8)])[0][0, -1].argmax())
started = time.perf_counter()
for position in range(8, 23):
    token = int(method.execute([torch.tensor([[token]]), torch.tensor([position])])[0][0, -1].argmax())
print(15 / (time.perf_counter() - started))
"""


def make_checkpoint(shape: str, folder: Path, tokenizer_from: Path) -> int:
    """A random-weight bfloat16 checkpoint of ``shape`` in ``folder``; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rms_norm_eps=1e-5,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bfloat16: a 3B model made in fp32 first peaks at 19 GB
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, folder / name)
    return sum(p.numel() for p in model.parameters())


def stages(log: Path) -> list[dict[str, Any]]:
    return [
        {"stage": m.group(1), "seconds": float(m.group(2)), "peak_rss_mib": int(m.group(3))}
        for m in STAGE_LINE.finditer(log.read_text())
    ]


def decode_in_runtime(folder: Path, variant: str) -> float | str:
    """Decode tokens/s over ``folder`` in its runtime, ``og.Generator`` or ExecuTorch's (in a child: the model's
    memory goes with it)."""
    script = RUN_IN_GENAI if variant.startswith("onnx") else RUN_IN_EXECUTORCH
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True)
    if done.returncode:
        return f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
    return round(float(done.stdout.strip().splitlines()[-1]), 1)


def measure(args: argparse.Namespace, shape: str, work: Path) -> list[dict[str, Any]]:
    from hfexport.checkpoints import checkpoint_folder

    checkpoint = work / shape
    print(f"{shape}: making the checkpoint ...", file=sys.stderr, flush=True)
    parameters = make_checkpoint(shape, checkpoint, checkpoint_folder("smollm2-135m-instruct"))
    rows = []
    for variant in args.variants:
        ours = [sys.executable, "-m", "hfexport.cli", "export", str(checkpoint), *HFEXPORT[variant], "--generation"]
        exports = [("hfexport", [*ours, "--max-cache-len", str(args.cache_len), "--out"])]
        if variant in BUILDER and args.builder_python:
            command = [args.builder_python, str(builder_script(args.builder_python)), "-i", str(checkpoint)]
            command += ["-p", BUILDER[variant], "-e", "cpu", "-c", str(work / "builder-cache"), "-o"]
            exports.append(("builder", command))
        measured: dict[str, list[dict[str, Any]]] = {exporter: [] for exporter, _ in exports}
        for index in range(args.rounds):  # the exporters in turns, the order rotated each round
            for exporter, command in in_turns(exports, index):
                out = work / f"{exporter}-{variant.replace(':', '-')}"
                log = work / f"{exporter}-{variant.replace(':', '-')}.log"
                print(f"{shape}: export {variant} ({exporter}), round {index + 1} ...", file=sys.stderr, flush=True)
                run = timed_child([*command, str(out)], log)
                run["stages"] = stages(log) if exporter == "hfexport" else []
                if index == args.rounds - 1:
                    run["folder_gib"] = round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**30, 2)
                    print(f"{shape}: run {variant} ({exporter}) in its runtime ...", file=sys.stderr, flush=True)
                    run["decode_tokens_per_second"] = decode_in_runtime(out, variant)
                measured[exporter].append(run)
                shutil.rmtree(out)
        for exporter, runs in measured.items():
            row = {"shape": shape, "parameters": parameters, "variant": variant, "exporter": exporter}
            middle = sorted(runs, key=lambda run: run["cpu_seconds"])[len(runs) // 2]  # the median CPU's run
            row |= {
                key: middle[key] for key in ("wall_seconds", "cpu_seconds", "system_seconds", "peak_rss_mib", "stages")
            }
            row |= {key: runs[-1][key] for key in ("folder_gib", "decode_tokens_per_second")}
            row["rounds"] = runs
            rows.append(row)
    shutil.rmtree(checkpoint)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | variant | exporter | wall s | CPU s (system) | peak RSS GiB | folder GiB | runtime tok/s "
        "| stages (s, peak RSS GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        per_stage = ", ".join(
            f"{s['stage']} {s['seconds']:.1f} s {s['peak_rss_mib'] / 1024:.1f}" for s in row["stages"]
        )
        lines.append(
            f"| {row['shape']} | {row['variant']} | {row['exporter']} | {row['wall_seconds']} | "
            f"{row['cpu_seconds']} ({row.get('system_seconds', '–')}) | "
            f"{row['peak_rss_mib'] / 1024:.1f} | {row['folder_gib']} | {row['decode_tokens_per_second']} | "
            f"{per_stage or '–'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--variants", default=",".join(HFEXPORT), help=f"comma-separated, of {', '.join(HFEXPORT)}")
    parser.add_argument("--builder-python", help="the Python of a venv with onnxruntime-genai's builder (torch 2.13.0)")
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="exports of each variant per exporter, in turns")
    parser.add_argument("--work", help="a folder for the checkpoints and exports (default: a temporary one)")
    parser.add_argument("--out", default="benchmarks/results/real-sizes")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [s for s in shapes if s not in SHAPES] + [v for v in args.variants if v not in HFEXPORT]
    if unknown:
        parser.error(f"unknown shapes or variants {unknown}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="real-sizes-", dir=args.work) as work:
        for shape in shapes:
            rows += measure(args, shape, Path(work))
            (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")  # kept as it goes
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
