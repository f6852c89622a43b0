"""Coverage sweep: every transformers model type, as a tiny random model, exported to every target.

For each model type of ``transformers.CONFIG_MAPPING``: build the tiny model
(:func:`hfexport.models.tiny.build_tiny`), run it eagerly on :func:`config_sample_inputs` at two
shapes; where eager runs, export it with each target's default config plus ``dynamic=True`` (one
shared capture through ``run_targets``, each target alone when that fails), save the export
folder, run it on its raw runtime through ``ExportFolder(folder).runner()`` on both shapes and
compare the main output (the first output tensor) with eager: pass at 1e-4 (dynamo) or 1e-3 (onnx,
executorch). transformers' own exporters (``transformers.exporters``, ``dynamic=True``) run in the
same case process for comparison (this benchmark may import them; the hfexport package never does).
A generative type is also saved as a checkpoint folder, exported with ``hfexport export
--generation`` (the command line's defaults) and run through ``hfexport.load(folder)``'s greedy
decoder: pass when its tokens are ``model.generate(do_sample=False)``'s (targets
``generate:<target>``; ``--no-generation`` skips them).

One process per case (forked by a server process that imported the stack once), killed after
``--timeout`` seconds; results are JSONL lines ``{"type", "target", "status", ...}`` in
``benchmarks/results/coverage/coverage.jsonl``; a (type, target) pair already there is skipped, so
the sweep resumes. ``--report`` (also done at the end of every run) writes ``docs/coverage.md``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/coverage.py --targets dynamo --no-generation --timeout 150
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/coverage.py --only llama,bert,vit --targets onnx,executorch
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/coverage.py --retry   # after a fix: what did not pass
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the work tree's hfexport, not an installed copy

RESULTS = ROOT / "benchmarks" / "results" / "coverage" / "coverage.jsonl"
DOC = ROOT / "docs" / "coverage.md"
TARGETS = ("dynamo", "onnx", "executorch")
TOLERANCE = {"dynamo": 1e-4, "onnx": 1e-3, "executorch": 1e-3}
SECOND_SHAPE = (3, 12)  # (batch, seq) of the second sample; the first is (2, 8)
KINDS = ("decoder LM", "encoder", "encoder-decoder", "vision", "audio", "multimodal", "SSM / hybrid", "other")


def cause(error: BaseException) -> str:
    """One line: the exception type and the first line of its message."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0][:300] if message else ''}".strip()


def flat_tensors(value: Any) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flat_tensors(item)]
    return []


def max_diff(expected: Any, got: Any) -> float:
    import torch

    expected, got = torch.as_tensor(expected).float(), torch.as_tensor(got).float()
    if expected.shape != got.shape:
        raise ValueError(f"output shape {tuple(got.shape)} differs from eager's {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    return float((expected - got).abs().max())


def compare(target: str, eager: list, got: list) -> dict[str, Any]:
    if not got:
        return {"status": "fail", "cause": "the program returned no tensor"}
    diff = max_diff(eager[0], got[0])
    ok = diff <= TOLERANCE[target]
    return {"status": "pass" if ok else "mismatch", "diff": diff}


# ------------------------------------------------------------------------------------------- case


def run_case(
    model_type: str, targets: list[str], transformers_targets: list[str], generation_targets: list[str], out: Any
) -> None:
    """In the case process: put one dict per finished (type, target) on ``out``."""
    import torch

    torch.manual_seed(0)
    from hfexport.models.samples import config_sample_inputs, with_rope_positions
    from hfexport.models.tiny import build_tiny, model_class, model_kind

    record: dict[str, Any] = {"type": model_type, "target": "eager"}
    try:
        task, cls = model_class(model_type)
        record.update(task=task, cls=cls.__name__)
    except Exception as error:
        out.put({**record, "status": "no_class", "cause": cause(error)})
        return
    start = time.perf_counter()
    try:
        model = build_tiny(model_type)
    except Exception as error:
        out.put({**record, "status": "build_error", "cause": cause(error)})
        return
    record["kind"] = model_kind(model, task)
    try:
        # what the command line's single-graph export takes (sample_inputs_for without a folder)
        inputs = with_rope_positions(model, config_sample_inputs(model))
        second = with_rope_positions(model, config_sample_inputs(model, *SECOND_SHAPE, seed=1))
        record["inputs"] = {k: list(v.shape) for k, v in inputs.items()}
        with torch.no_grad():
            eager = [t.detach().clone() for t in flat_tensors(model(**inputs))]
            eager2 = [t.detach().clone() for t in flat_tensors(model(**second))]
            again = [t.detach().clone() for t in flat_tensors(model(**inputs))]
        if not eager:
            raise TypeError("the model returned no tensor")
    except Exception as error:
        out.put({**record, "status": "eager_error", "cause": cause(error)})
        return
    try:
        drift = max((max_diff(a, b) for a, b in zip(eager, again, strict=False)), default=0.0)
        message = f"eager differs from itself by {drift:.3g} on the same inputs"
    except ValueError as error:  # another shape: a length drawn at random (VITS' durations)
        drift, message = float("inf"), f"eager differs from itself on the same inputs: {error}"
    if drift > 0:
        # nothing to compare a program with: eager itself gives two answers (random noise in forward)
        out.put({**record, "status": "eager_nondeterministic", "cause": message})
        return
    # whether it generates, so a case killed by the timeout before its generation half is not
    # counted as a generation failure of a model that does not generate
    generates = bool(getattr(model, "can_generate", lambda: False)())
    out.put({**record, "status": "ok", "generates": generates, "seconds": round(time.perf_counter() - start, 2)})
    base = {"type": model_type, "kind": record["kind"], "cls": record["cls"]}
    if targets:
        hfexport_targets(model, inputs, second, eager, eager2, targets, base, out)
    # before transformers' exporters: they register their own pytree nodes for the cache classes,
    # after which hfexport's .pt2 pickled the StaticCache (XGLM, VaultGemma, Video-LLaVA: refused
    # when loaded, and passing in a case of their own)
    generation_case(model, inputs, base, generation_targets, out)
    for target in transformers_targets:
        out.put(
            {
                **base,
                "target": f"transformers:{target}",
                **transformers_case(model, inputs, second, eager, eager2, target),
            }
        )


def hfexport_targets(model, inputs, second, eager, eager2, targets, base, out) -> None:
    from hfexport import DynamoConfig, ExecutorchConfig, OnnxConfig
    from hfexport.exporters import run_targets

    config_class = {"dynamo": DynamoConfig, "onnx": OnnxConfig, "executorch": ExecutorchConfig}
    configs = {t: config_class[t](dynamic=True) for t in targets}
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    start = time.perf_counter()
    try:
        results = run_targets(model, inputs, list(configs.values()))
        shared = time.perf_counter() - start
    except Exception:
        shared = None
        for target, config in configs.items():  # one at a time: whose failure is it
            try:
                results.update(run_targets(model, inputs, [config]))
            except Exception as error:
                errors[target] = cause(error)
    for target in targets:
        record = measure(target, results.get(target), eager, eager2, inputs, second)
        if shared is not None and record["status"] != "pass" and target != "executorch" and "executorch" in targets:
            # the shared capture is bounded as ExecuTorch's memory planning needs: a target that
            # failed with those bounds is exported again alone, with its own defaults
            try:
                alone = run_targets(model, inputs, [configs[target]])[target]
                record = {**measure(target, alone, eager, eager2, inputs, second), "shared_capture": False}
            except Exception as error:
                record = {"status": "export_error", "cause": cause(error), "shared_capture": False}
        if target in errors:
            record = {"status": "export_error", "cause": errors[target]}
        out.put({**base, "target": target, "shared_capture": shared is not None, **record})


def measure(target: str, result: Any, eager: list, eager2: list, inputs: dict, second: dict) -> dict[str, Any]:
    """``result``'s program saved, loaded by its runner and run on both samples against eager."""
    import hfexport

    record: dict[str, Any] = {}
    if result is None:
        return {"status": "export_error", "cause": "no result"}
    try:
        with tempfile.TemporaryDirectory() as folder:
            hfexport.save_export(folder, {"model": result})
            runner = hfexport.ExportFolder(folder).runner()
            first = compare(target, eager, runner.run(inputs))
            record.update(diff=first.get("diff"))
            try:
                again = compare(target, eager2, runner.run(second))
                record.update(diff2=again.get("diff"))
            except Exception as error:
                again = {"status": "second_shape_error", "cause": cause(error)}
            status = first["status"] if first["status"] != "pass" else again["status"]
            record.update(status=status)
            if "cause" in again and status != "pass":
                record["cause"] = again["cause"]
    except Exception as error:
        record.update(status="run_error", cause=cause(error))
    return record


def transformers_case(model, inputs, second, eager, eager2, target: str) -> dict[str, Any]:
    """transformers' own exporter on the same model and samples, for comparison."""
    try:
        from transformers import exporters as tx

        exporter = {"dynamo": tx.DynamoExporter, "onnx": tx.OnnxExporter, "executorch": tx.ExecutorchExporter}[target]
        config = {"dynamo": tx.DynamoConfig, "onnx": tx.OnnxConfig, "executorch": tx.ExecutorchConfig}[target]
        exported = exporter().export(model, dict(inputs), config(dynamic=True))
    except Exception as error:
        return {"status": "export_error", "cause": cause(error)}
    try:
        first = compare(target, eager, flat_tensors(exported(**inputs)))
        try:
            again = compare(target, eager2, flat_tensors(exported(**second)))
        except Exception as error:
            again = {"status": "second_shape_error", "cause": cause(error)}
        status = first["status"] if first["status"] != "pass" else again["status"]
        found = {"status": status, "diff": first.get("diff"), "diff2": again.get("diff")}
        if "cause" in again and status != "pass":
            found["cause"] = again["cause"]
        return found
    except Exception as error:
        return {"status": "run_error", "cause": cause(error)}


NEW_TOKENS = 8  # greedy tokens compared with model.generate
CACHE_LEN = 64  # the generation exports' --max-cache-len (a multimodal sample prompt holds its image tokens)


def _varied_reference(model, prompt: dict) -> list[int]:
    """``model.generate``'s greedy tokens for ``prompt``. A tiny model at its default
    initialisation often repeats one token, which would compare little: then its matrices are
    redrawn at std 0.5 (seeded), kept when that gives more distinct tokens."""
    import copy

    import torch

    def generate() -> list[int]:
        with torch.no_grad():
            return model.generate(**prompt, do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS)[0].tolist()

    reference = generate()
    if len(set(reference[-NEW_TOKENS:])) >= 3:
        return reference
    default = copy.deepcopy(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    redrawn = generate()
    if len(set(redrawn[-NEW_TOKENS:])) > len(set(reference[-NEW_TOKENS:])):
        return redrawn
    model.load_state_dict(default)
    return reference


def generation_case(model, inputs, base, targets: list[str], out) -> None:
    """The generation half: for a model that generates, ``hfexport export CHECKPOINT --generation``
    (the command line's defaults, one capture for every target) from the tiny model saved as a
    checkpoint folder, then greedy decoding of one prompt through ``hfexport.load(folder)`` against
    ``model.generate(do_sample=False)``: one record ``{"target": "generate:<target>", ...}`` per
    target, ``pass`` when the new tokens are equal."""
    import contextlib
    import io

    import hfexport
    from hfexport.cli import main as cli

    if not targets:
        return
    if not model.can_generate():
        for target in targets:
            out.put({**base, "target": target, "status": "skipped", "cause": "does not generate"})
        return
    names = [t.split(":", 1)[1] for t in targets]
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    # the prompt: one row of the sample; a decoder-only model gets its text inputs only
    prompt = {k: v[:1] for k, v in inputs.items() if hasattr(v, "shape") and not k.startswith("decoder_")}
    if not encoder_decoder:
        prompt = {k: v for k, v in prompt.items() if k in ("input_ids", "attention_mask")}
    generation = model.generation_config
    if encoder_decoder and generation.decoder_start_token_id is None and generation.bos_token_id is None:
        # a default config may name no start token (a real checkpoint does): the pad id, as T5's
        generation.decoder_start_token_id = generation.pad_token_id or 0
    try:
        reference = _varied_reference(model, prompt)
    except Exception as error:
        for target in targets:
            out.put({**base, "target": target, "status": "eager_error", "cause": f"model.generate: {cause(error)}"})
        return
    with tempfile.TemporaryDirectory() as root:
        checkpoint = Path(root) / "checkpoint"
        model.save_pretrained(checkpoint)

        def export(formats: list[str], folder: Path) -> str | None:
            """``None``, or the command line's one-line error."""
            argv = ["export", str(checkpoint), "--generation", "--format", ",".join(formats)]
            argv += ["--out", str(folder), "--max-cache-len", str(CACHE_LEN)]
            errors = io.StringIO()
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                code = cli(argv)
            found = [line for line in errors.getvalue().splitlines() if line.startswith("hfexport: error")]
            return None if code == 0 else (found[-1] if found else f"exit {code}")

        folders = {name: Path(root) / "export" / name for name in names}
        failed: dict[str, str] = {}
        if export(names, Path(root) / "export") is not None:  # one target at a time: whose failure is it
            for name in names:
                error = export([name], folders[name])
                if error is not None:
                    failed[name] = error
        elif len(names) == 1:
            folders = {names[0]: Path(root) / "export"}
        for name, target in zip(names, targets, strict=True):
            record = {**base, "target": target}
            if name in failed:
                out.put({**record, "status": "export_error", "cause": failed[name].removeprefix("hfexport: error: ")})
                continue
            try:
                generator = hfexport.load(folders[name])
                if encoder_decoder:
                    start = list(generator.decoder_prompt())
                    got = generator.generate_ids(prompt, NEW_TOKENS)[0].tolist()[len(start) :]
                    # generate returns the decoder prompt too, but Whisper's returns the new tokens only
                    expected = reference[len(start) :] if reference[: len(start)] == start else reference
                else:
                    ids = prompt["input_ids"][0].tolist()
                    got = list(generator.generate(ids, NEW_TOKENS).tokens)
                    expected = reference[len(ids) :]
                record["expected"] = expected
                status = "pass" if got == expected else "mismatch"
                out.put({**record, "status": status, "got": got})
            except Exception as error:
                out.put({**record, "status": "run_error", "cause": cause(error)})


def _case_entry(model_type, targets, transformers_targets, generation_targets, out) -> None:
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    try:
        run_case(model_type, targets, transformers_targets, generation_targets, out)
    except BaseException as error:  # the parent records a crash of the case itself
        out.put({"type": model_type, "target": "case", "status": "crash", "cause": cause(error)})
        traceback.print_exc()


# ------------------------------------------------------------------------------------------- sweep


def load_results(path: Path = RESULTS) -> dict[tuple[str, str], dict]:
    found: dict[tuple[str, str], dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                found[(row["type"], row["target"])] = row
    return found


RETRIED_EAGER = ("crash", "build_error", "eager_error", "timeout")  # what a builder or sample fix can change


def pending_targets(model_type: str, done: dict, wanted: list[str], retry: bool = False) -> list[str] | None:
    """The targets of ``wanted`` still to run for ``model_type``; ``None`` when nothing is left
    (its eager record says it cannot run, or every target is done). ``retry``: a target whose
    record is not a pass runs again (after a fix)."""
    eager = done.get((model_type, "eager"))
    if eager is not None and eager["status"] != "ok" and not (retry and eager["status"] in RETRIED_EAGER):
        return None

    def finished(target: str) -> bool:
        row = done.get((model_type, target))
        return row is not None and not (retry and row["status"] not in ("pass", "skipped"))

    left = [t for t in wanted if not finished(t)]
    return left if left or eager is None else None


# the modules every case imports, loaded once by the fork server
PRELOADED = ["torch", "transformers", "hfexport", "hfexport.models.samples", "hfexport.models.tiny"]


def _case_context() -> Any:
    """Cases fork from a server process that imported the stack and runs no thread: forked straight
    from the sweep, whose ``--jobs`` threads may hold a lock at that moment, a case could hang until
    its timeout (CvT: 45 s alone, "timeout (600 s)" at --jobs 2)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


def run_one(model_type: str, targets: list[str], timeout: float) -> list[dict]:
    context = _case_context()
    out = context.Queue()
    plain = [t for t in targets if ":" not in t]
    theirs = [t.split(":", 1)[1] for t in targets if t.startswith("transformers:")]
    generate = [t for t in targets if t.startswith("generate:")]
    process = context.Process(target=_case_entry, args=(model_type, plain, theirs, generate, out), daemon=True)
    start = time.perf_counter()
    process.start()
    rows: list[dict] = []
    while True:
        try:
            rows.append(out.get(timeout=0.5))
            continue
        except queue.Empty:
            pass
        if not process.is_alive():
            while True:
                try:
                    rows.append(out.get_nowait())
                except queue.Empty:
                    break
            break
        if time.perf_counter() - start > timeout:
            process.kill()
            process.join()
            done = {r["target"] for r in rows}
            eager = next((r for r in rows if r["target"] == "eager"), None)
            if eager is None:
                rows.append(
                    {"type": model_type, "target": "eager", "status": "timeout", "cause": f"timeout ({timeout:.0f} s)"}
                )
            elif eager["status"] == "ok":
                for target in targets:
                    if target not in done:
                        base = {
                            "type": model_type,
                            "target": target,
                            "kind": eager.get("kind"),
                            "cls": eager.get("cls"),
                        }
                        if target.startswith("generate:") and eager.get("generates") is False:
                            rows.append({**base, "status": "skipped", "cause": "does not generate"})
                        else:
                            rows.append({**base, "status": "timeout", "cause": f"timeout ({timeout:.0f} s)"})
            break
    process.join(5)
    died = f"the case process died (exit {process.exitcode})"
    eager = next((r for r in rows if r["target"] == "eager"), None)
    if process.exitcode not in (0, None, -9) and eager is None:
        rows.append({"type": model_type, "target": "eager", "status": "crash", "cause": died})
    elif eager is not None and eager["status"] == "ok":
        # a case that died mid-way (LongT5 under transformers' exporters) recorded nothing for the
        # targets after it: without a row, every resumed sweep ran it again
        done = {r["target"] for r in rows}
        base = {"type": model_type, "kind": eager.get("kind"), "cls": eager.get("cls")}
        rows += [{**base, "target": t, "status": "crash", "cause": died} for t in targets if t not in done]
    return rows


def sweep(args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import transformers

    types = list(transformers.CONFIG_MAPPING.keys())
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(types))
        if unknown:
            raise SystemExit(f"unknown model types: {', '.join(unknown)}")
        types = wanted
    targets = [t for t in args.targets.split(",") if t]
    known = {*TARGETS, *(f"generate:{t}" for t in TARGETS)}
    if set(targets) - known:
        raise SystemExit(
            f"unknown targets {', '.join(sorted(set(targets) - known))}; valid: {', '.join(sorted(known))}"
        )
    plain = [t for t in targets if ":" not in t]
    if args.generation:
        targets += [f"generate:{t}" for t in plain if f"generate:{t}" not in targets]
    if args.transformers:
        targets += [f"transformers:{t}" for t in plain]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    done = load_results()
    todo = [(t, left) for t in types if (left := pending_targets(t, done, targets, args.retry)) is not None]
    if args.shuffle:  # a spread over every kind first, when a run cannot cover every type
        import random

        random.Random(0).shuffle(todo)
    if args.limit:
        todo = todo[: args.limit]
    print(
        f"{len(todo)} model types to run ({len(types) - len(todo)} done or skipped), targets {','.join(targets)}",
        flush=True,
    )

    def one(index_item):
        index, (model_type, left) = index_item
        start = time.perf_counter()
        rows = run_one(model_type, left, args.timeout)
        with RESULTS.open("a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
        summary = " ".join(f"{r['target']}={r['status']}" for r in rows)
        eager = next((r for r in rows if r["target"] == "eager"), {})
        why = next((r.get("cause") for r in rows if r["status"] not in ("ok", "pass") and r.get("cause")), "")
        print(
            f"[{index + 1}/{len(todo)}] {model_type} ({eager.get('cls', '?')}) {summary} "
            f"{time.perf_counter() - start:.1f}s {why[:120]}",
            flush=True,
        )

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, enumerate(todo)))
    write_report()


# ------------------------------------------------------------------------------------------- report


def write_report(path: Path = DOC) -> None:
    """``docs/coverage.md`` from the JSONL: totals per target and per kind, one table per kind."""
    rows = load_results()
    eager = {t: r for (t, target), r in rows.items() if target == "eager"}
    runs = [t for t, r in eager.items() if r["status"] == "ok"]
    every = (*TARGETS, *(f"transformers:{t}" for t in TARGETS), *(f"generate:{t}" for t in TARGETS))
    columns = [c for c in every if any((t, c) in rows for t in runs)]
    status_count = defaultdict(int)
    for r in eager.values():
        status_count[r["status"]] += 1
    lines = [
        "# Coverage: every transformers model type, tiny and random, on every target",
        "",
        "Written by `make coverage` (`benchmarks/coverage.py`) from `benchmarks/results/coverage/coverage.jsonl`.",
        "Each model type of transformers' `CONFIG_MAPPING` is built as a tiny random model from its config's",
        "defaults (`hfexport.models.tiny`), run eagerly on generic inputs (`hfexport.models.samples`) at two",
        "shapes (batch 2 x 8 tokens, 3 x 12), exported with each target's defaults plus `dynamic=True`, run on",
        "its raw runtime on both shapes and compared with eager on the main output (pass: max abs diff within",
        "1e-4 on Dynamo, 1e-3 on ONNX / ExecuTorch). The `transformers:` columns run transformers' own",
        "exporters (`dynamic=True`) on the same model and inputs in the same process, for comparison.",
        "",
        f"Model types: {len(eager)} run; eager: "
        + ", ".join(f"{n} {s}" for s, n in sorted(status_count.items(), key=lambda kv: -kv[1]))
        + " (no_class: a sub-config with no model class of its own; eager_nondeterministic: two eager runs on the"
        " same inputs differ, so no program can be compared with it).",
        "",
        "## Totals (of the types whose tiny model runs eagerly and that the target was run on)",
        "",
        "| kind | types | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    by_kind: dict[str, list[str]] = defaultdict(list)
    for t in runs:
        by_kind[eager[t].get("kind") or "other"].append(t)

    def total(types: list[str], column: str) -> str:
        # a generation row whose reference (model.generate on the sweep's prompt) fails has nothing
        # to be compared with, as a type whose eager forward fails: listed, not counted
        ran = [
            rows[(t, column)]
            for t in types
            if (t, column) in rows and rows[(t, column)]["status"] not in ("skipped", "eager_error")
        ]
        if not ran:
            return "–"
        passed = sum(r["status"] == "pass" for r in ran)
        return f"{passed}/{len(ran)} ({100 * passed / len(ran):.1f}%)"

    for kind in KINDS:
        if by_kind.get(kind):
            lines.append(
                f"| {kind} | {len(by_kind[kind])} | " + " | ".join(total(by_kind[kind], c) for c in columns) + " |"
            )
    lines.append(f"| **all** | {len(runs)} | " + " | ".join(f"**{total(runs, c)}**" for c in columns) + " |")
    behind = []
    for target in TARGETS:
        theirs = f"transformers:{target}"
        for t in runs:
            mine, other = rows.get((t, target)), rows.get((t, theirs))
            if mine and other and other["status"] == "pass" and mine["status"] != "pass":
                behind.append(f"{t} ({target}: {mine['status']})")
    lines += [
        "",
        "Types that transformers' exporter passes and hfexport does not, on the same target: "
        + (", ".join(behind) if behind else "none")
        + ".",
    ]
    no_reference = sorted({t for t in runs for c in columns if rows.get((t, c), {}).get("status") == "eager_error"})
    if no_reference:
        lines += [
            "",
            f"Not counted in the generation columns: {len(no_reference)} types whose `model.generate` fails on the"
            " sweep's prompt (text ids only; a model that needs pixel values or audio features to generate, or whose"
            " generate itself fails), so there is no reference to compare with: " + ", ".join(no_reference) + ".",
        ]
    lines += ["", "## Failure classes", ""]
    for column in columns:
        classes: dict[str, list[str]] = defaultdict(list)
        for t in runs:
            r = rows.get((t, column))
            if r and r["status"] not in ("pass", "skipped"):
                classes[_failure_class(r)].append(t)
        if classes:
            lines += [f"### {column}", "", "| cause | count | types |", "|---|---|---|"]
            for why, types in sorted(classes.items(), key=lambda kv: -len(kv[1])):
                more = " …" if len(types) > 8 else ""
                lines.append(f"| {_cell(why, 160)} | {len(types)} | {', '.join(sorted(types)[:8])}{more} |")
            lines.append("")
    for kind in KINDS:
        types = sorted(by_kind.get(kind, []))
        if not types:
            continue
        lines += [
            f"## {kind}",
            "",
            "| type | class | " + " | ".join(columns) + " |",
            "|---|---|" + "---|" * len(columns),
        ]
        for t in types:
            cells = [_status_cell(rows.get((t, c))) for c in columns]
            lines.append(f"| {t} | {eager[t].get('cls', '')} | " + " | ".join(cells) + " |")
        lines.append("")
    failed = sorted(t for t, r in eager.items() if r["status"] not in ("ok", "no_class"))
    if failed:
        lines += [
            "## Not run: the tiny model does not build or run eagerly",
            "",
            "| type | status | cause |",
            "|---|---|---|",
        ]
        for t in failed:
            lines.append(f"| {t} | {eager[t]['status']} | {_cell(eager[t].get('cause', ''), 200)} |")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _failure_class(row: dict) -> str:
    if row["status"] == "mismatch":
        if "got" in row:
            return "mismatch: greedy tokens differ from model.generate's"
        return "mismatch: max abs diff above the tolerance"
    why = row.get("cause") or row["status"]
    # numbers and names vary between types: the class is the message up to its first specific detail
    import re

    return re.sub(r"\d+", "N", why)[:140]


def _status_cell(row: dict | None) -> str:
    if row is None or row["status"] == "skipped":
        return "–"
    if row["status"] == "pass":
        return "pass"
    if row["status"] == "mismatch" and "got" in row:
        return "tokens differ"
    if row["status"] == "mismatch":
        return f"mismatch {row.get('diff') or 0:.1e}/{row.get('diff2') or 0:.1e}"
    return f"{row['status']}: {_cell(row.get('cause', ''), 100)}"


def _cell(text: str, limit: int) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="dynamo,onnx,executorch", help="comma-separated: dynamo,onnx,executorch")
    parser.add_argument("--only", default="", help="comma-separated model types (default: every registered type)")
    parser.add_argument(
        "--no-generation",
        dest="generation",
        action="store_false",
        help="skip the generation cases (by default each generative type is also exported with --generation and "
        "its greedy tokens compared with model.generate: targets generate:<target>)",
    )
    parser.add_argument(
        "--retry", action="store_true", help="run again the cases that did not pass (and the types that did not run)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="cases run at the same time")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    parser.add_argument("--limit", type=int, default=0, help="run at most this many types")
    parser.add_argument("--shuffle", action="store_true", help="run the types in a fixed shuffled order")
    parser.add_argument(
        "--no-transformers",
        dest="transformers",
        action="store_false",
        help="skip transformers' own exporters (run by default for comparison)",
    )
    parser.add_argument("--report", action="store_true", help="only rewrite docs/coverage.md from the JSONL")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.report:
        write_report()
        print(f"wrote {DOC.relative_to(ROOT)}")
        return
    sweep(args)
    print(f"wrote {RESULTS.relative_to(ROOT)} and {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
