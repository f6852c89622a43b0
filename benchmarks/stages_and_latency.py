"""Per-stage export time and peak memory, and the artifact's latency next to eager PyTorch.

    python benchmarks/stages_and_latency.py --format onnx
    python benchmarks/stages_and_latency.py --format executorch --sizes tiny

For each model size (a tiny random Llama and a mid-size one: hidden 512, 4 layers), exports with
dynamic=True, prints the stage/pass table (time, peak RSS, node counts), then times eager PyTorch
and the saved artifact on its real runtime on the same inputs (median of --repeats runs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.pipeline.artifacts import artifact_kind
from hfexport.pipeline.instruments import StepRecord, measured
from hfexport.pipeline.pipeline import stage_table
from hfexport.presets import PRESETS, sample_inputs

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


def runtime_runner(path: Path, export_format: str):
    if export_format == "onnx":
        from hfexport.runtime import OnnxRunner

        runner = OnnxRunner(path)
        return lambda inputs: runner.session.run(None, runner.feed(inputs))
    if export_format == "executorch":
        from hfexport.runtime import ExecutorchRunner

        runner = ExecutorchRunner(path)
        return runner.run
    from hfexport.runtime import load_exported_program

    module = load_exported_program(path).module()
    return lambda inputs: module(**inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="onnx", choices=["dynamo", "onnx", "executorch"])
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
        kind = artifact_kind(result.program)
        path = Path(folder) / f"model{kind.suffix}"
        with measured(StepRecord("serialize", "stage", len(result.records))) as serialize:
            kind.save(result.program, path)
        size_mb = path.stat().st_size / 2**20
        run = runtime_runner(path, args.format)
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
