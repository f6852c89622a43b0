"""Time decode steps of several ExecuTorch or ONNX programs alternately, in one process.

A single benchmark run's decode figures move with the machine (its neighbours, its memory
bandwidth), so two programs measured minutes apart can swap places. This script takes turns
between the programs, round after round, and reports the median step of each::

    python benchmarks/alternating_steps.py hfexport=EXPORT_FOLDER optimum=path/to/model.pte

- ``label=FOLDER``: an hfexport export folder (``hfexport export … --format executorch|onnx
  --generation``). Its steps run through hfexport's own decode loop (``greedy_decode``); an ONNX
  Runtime session gets 1 intra-op thread, as torch and ExecuTorch do here.
- ``label=FILE.pte``: an optimum-executorch program (``benchmarks/peers.py --keep DIR``). Its
  steps are bare ``forward(input_ids, cache_position)`` calls with a greedy argmax.
- For hfexport's programs the ``execute`` column also gives the time inside the program alone
  (ExecuTorch's ``execute``, ONNX Runtime's ``run_with_iobinding``), so the kinds compare like for
  like; the ``loop`` column adds hfexport's Python per step (masks, argmax, the token counters
  copied out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hfexport.models.loading import model_folder

sys.path.insert(0, str(Path(__file__).parent))
from decode import TEACHER_FORCED_QUESTION, batch1_decoder, prompt_ids  # decode.py's chat prompt and loader


def hfexport_steps(folder: Path, ids: torch.Tensor, steps: int, cache_len: int) -> Callable[[], tuple[float, float]]:
    """A callable that times one run: (ms per step through the decode loop, ms per step inside ``execute``)."""
    from hfexport import ExportFolder
    from hfexport.generation import greedy_decode

    decoder = batch1_decoder(ExportFolder(folder), threads=1)
    owner, name = (
        (decoder.session, "run_with_iobinding") if hasattr(decoder, "session") else (decoder.runner, "execute")
    )
    execute = getattr(owner, name)
    calls: list[float] = []  # seconds inside each execute, the prompt's first

    def timed_execute(*args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)

    setattr(owner, name, timed_execute)

    def run() -> tuple[float, float]:
        # each token's arrival is stamped: between two stamps lies one whole step of the loop
        stamps: list[float] = []
        calls.clear()
        greedy_decode(decoder, ids, steps + 1, cache_len, on_token=lambda _: stamps.append(time.perf_counter()))
        steps_inside = calls[1:]  # the decode steps, without the prompt's
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3, sum(steps_inside) / len(steps_inside) * 1e3

    return run


def optimum_steps(pte: Path, ids: torch.Tensor, steps: int) -> Callable[[], tuple[float, float]]:
    """A callable that times one run of bare ``forward`` calls (the same figure twice: there is no loop around them)."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (its custom SDPA and KV cache)
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(pte).load_method("forward")

    def run() -> tuple[float, float]:
        length = ids.shape[1]
        token = method.execute((ids, torch.arange(length)))[0][:, -1].argmax(-1)
        start = time.perf_counter()
        for i in range(steps):
            token = method.execute((token.view(1, 1), torch.tensor([length + i])))[0][:, -1].argmax(-1)
        per_step = (time.perf_counter() - start) / steps * 1e3
        return per_step, per_step

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("programs", nargs="+", help="label=EXPORT_FOLDER or label=FILE.pte")
    parser.add_argument(
        "--checkpoint", default="smollm2-135m-instruct", help="the programs' checkpoint (a packaged name or a folder)"
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--cache-len", type=int, default=128, help="the static cache length the programs were exported with"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = prompt_ids(model_folder(args.checkpoint), 0, TEACHER_FORCED_QUESTION)
    runs = {}
    for spec in args.programs:
        label, _, path = spec.partition("=")
        if not path:
            parser.error(f"{spec!r}: give label=path")
        path = Path(path)
        if path.suffix == ".pte":
            runs[label] = optimum_steps(path, ids, args.steps)
        else:
            runs[label] = hfexport_steps(path, ids, args.steps, args.cache_len)
    for run in runs.values():  # a warm-up run each: a program's first calls are slower
        run()
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
    for _ in range(args.rounds):
        for label, run in runs.items():
            times[label].append(run())
    print(f"| program | loop ms/step (median of {args.rounds}) | execute ms/step | rounds (loop) |")
    print("|---|---:|---:|---|")
    for label, measured in times.items():
        loop = statistics.median(m[0] for m in measured)
        inside = statistics.median(m[1] for m in measured)
        rounds = ", ".join(f"{m[0]:.2f}" for m in measured)
        print(f"| {label} | {loop:.2f} | {inside:.2f} | {rounds} |")


if __name__ == "__main__":
    main()
