"""Per-stage export time and peak memory, and the artifact's latency next to eager PyTorch.

    python benchmarks/stages_and_latency.py --format onnx
    python benchmarks/stages_and_latency.py --format executorch --sizes tiny

For each model size (a tiny random Llama and a mid-size one: hidden 512, 4 layers), exports with
dynamic=True, prints the stage/pass table (time, peak RSS, node counts), then times eager PyTorch
and the saved artifact on its real runtime (the target's runner) on the same inputs (median of
--repeats runs). Any registered target can be measured.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hfexport import AutoExportConfig, AutoHfExporter, ExportFolder, save_export
from hfexport.pipeline.instruments import StepRecord, measured
from hfexport.pipeline.pipeline import stage_table
from hfexport.presets import PRESETS, sample_inputs
from hfexport.targets import target_names

SIZES = {
    "tiny": {},
    "mid": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8000,
    },
}


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="onnx", choices=target_names())
    parser.add_argument("--sizes", default="tiny,mid")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)

    for size in args.sizes.split(","):
        benchmark(size, args)


def benchmark(size: str, args: argparse.Namespace) -> None:
    model = PRESETS["tiny-llama"].build(**SIZES[size])
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    config = AutoExportConfig.from_dict({"export_format": args.format, "dynamic": True})
    result = AutoHfExporter.from_config(config).run(model, sample_inputs(model), config)
    inputs = sample_inputs(model, args.batch, args.seq, seed=1)
    with tempfile.TemporaryDirectory() as folder:
        with measured(StepRecord("serialize", "stage", len(result.records))) as serialize:
            manifest = save_export(folder, {"model": result})
        size_mb = (Path(folder) / manifest.components["model"].file).stat().st_size / 2**20
        run = ExportFolder(folder).runner().run
        with torch.no_grad():
            eager_ms = median_ms(lambda: model(**inputs), args.repeats)
            artifact_ms = median_ms(lambda: run(inputs), args.repeats)

    print(f"\n## {size} Llama ({parameters:.1f}M parameters), format {args.format}\n")
    print(stage_table([*result.records, serialize]))
    total = sum(r.seconds for r in result.records) + serialize.seconds
    print(f"\ntotal export time {total:.2f}s, artifact {size_mb:.1f} MiB")
    print(
        f"latency on ({args.batch}, {args.seq}), median of {args.repeats}: "
        f"eager PyTorch {eager_ms:.2f} ms | {args.format} {artifact_ms:.2f} ms "
        f"({eager_ms / artifact_ms:.2f}x eager speed)"
    )


if __name__ == "__main__":
    main()
