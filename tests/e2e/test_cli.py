"""The hfexport command line, run as a real subprocess."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import build, sample_inputs

from hfexport import load_exported_program

HFEXPORT = [sys.executable, "-m", "hfexport.cli"]


def run(*args, check=True):
    result = subprocess.run([*HFEXPORT, *map(str, args)], capture_output=True, text=True, env={**os.environ})
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_export_preset_with_dumps_and_verify(tmp_path):
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    result = run("export", "tiny-llama", "--format", "dynamo", "--out", out, "--dump-dir", dumps, "--verify")
    assert (out / "model.pt2").is_file()
    report = (dumps / "report.md").read_text()
    assert "| capture |" in report and "| fx_passes |" in report
    assert "[1/2] capture" in result.stderr and "[2/2] fx_passes done" in result.stderr  # progress
    assert "| step | time (s)" in result.stdout  # the stage table
    program = load_exported_program(out / "model.pt2")
    model = build("tiny-llama")
    inputs = sample_inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(**inputs).logits, model(**inputs).logits, atol=1e-4, rtol=0)


def test_export_local_folder_with_pass_list(tmp_path):
    model = build("tiny-qwen3")
    model.save_pretrained(tmp_path / "saved")
    out = tmp_path / "out"
    result = run(
        "export", tmp_path / "saved", "--out", out, "--dynamic", "--passes", "dead_code_elimination", "--verify"
    )
    # one line per step: transformers' own weight-loading bar stays off
    assert "loading " in result.stderr and "Loading weights" not in result.stderr
    program = load_exported_program(out / "model.pt2")
    inputs = sample_inputs(model, 3, 13)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(**inputs).logits, model(**inputs).logits, atol=1e-4, rtol=0)


def test_passes_lists_every_registered_pass():
    result = run("passes")
    lines = result.stdout.strip().splitlines()
    names = [line.split()[0] for line in lines]
    assert {"dead_code_elimination", "remove_noop_conversions", "remove_tensor_metadata_asserts"} <= set(names)
    assert all(len(line.split(maxsplit=2)) == 3 for line in lines)  # name, stage, description


def test_the_command_line_collects_garbage_less_often_and_gives_the_thresholds_back(monkeypatch):
    # a young-generation pass every 700 allocations re-scanned the export's graphs: 2.05 of a
    # Llama-3.2-1B-shaped ONNX export's CPU seconds, 0.37 with one every 100,000
    import gc

    from hfexport import cli

    during = []
    monkeypatch.setattr(cli, "_main", lambda argv: during.append(gc.get_threshold()) or 0)
    before = gc.get_threshold()
    assert cli.main(["passes"]) == 0
    assert during[0][0] == 100_000
    assert gc.get_threshold() == before


def test_only_the_export_commands_process_has_openmp_threads_sleep_when_idle(tmp_path, monkeypatch):
    # spinning GNU OpenMP workers took 2.2 of a Llama-3.2-1B-shaped ONNX export's 24 user CPU seconds
    from hfexport.export_process import started_as_the_export_command

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    show = tmp_path / "show_env.py"
    show.write_text("import os, sys\nprint('policy', os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr)\n")
    exported = run("export", "tiny-llama", "--format", "dynamo", "--out", tmp_path / "out", "--import", show)
    assert "policy PASSIVE" in exported.stderr
    library = subprocess.run(
        [sys.executable, "-c", "import os, hfexport; print(os.environ.get('OMP_WAIT_POLICY'))"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"},
    )
    assert library.stdout.strip() == "None"
    assert started_as_the_export_command(["/venv/bin/python", "/venv/bin/hfexport", "export", "tiny-llama"])
    assert not started_as_the_export_command(["/venv/bin/python", "/venv/bin/hfexport", "generate", "out"])
    assert started_as_the_export_command(["python", "-u", "-m", "hfexport.cli", "export", "tiny-llama"])
    assert not started_as_the_export_command(["python", "-m", "pytest", "tests"])
    assert not started_as_the_export_command(["python", "tool.py", "/data/hfexport", "export"])


def test_errors_are_one_clear_line(tmp_path):
    result = run("export", tmp_path / "missing", "--out", tmp_path / "o", check=False)
    assert result.returncode == 2
    assert "neither a preset" in result.stderr and "Traceback" not in result.stderr
    result = run("export", "tiny-llama", "--out", tmp_path / "o", "--passes", "nope", check=False)
    assert result.returncode == 2 and "unknown pass 'nope'" in result.stderr and "Traceback" not in result.stderr


def test_replay_runs_a_pass_on_a_dumped_program(tmp_path):
    run("export", "tiny-llama", "--out", tmp_path / "out", "--passes", "")
    result = run(
        "replay",
        tmp_path / "out" / "model.pt2",
        "--passes",
        "remove_tensor_metadata_asserts",
        "--out",
        tmp_path / "r.pt2",
    )
    assert "remove_tensor_metadata_asserts: modified=True" in result.stderr
    program = load_exported_program(tmp_path / "r.pt2")
    assert not any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in program.graph.nodes)
    assert Path(tmp_path / "r.pt2").stat().st_size > 0


def test_export_onnx_with_dumps_and_verify(tmp_path):
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    run("export", "tiny-llama", "--format", "onnx", "--dynamic", "--out", out, "--dump-dir", dumps, "--verify")
    assert (out / "model.onnx").is_file()
    assert (dumps / "02_to_onnx" / "program.onnx").is_file()
    assert (dumps / "03_onnx_passes" / "00_onnx_optimizer" / "program.onnx").is_file()
    assert (dumps / "03_onnx_passes" / "00_onnx_optimizer" / "graph.txt").read_text().startswith("<")
    report = (dumps / "report.md").read_text()
    assert "| to_onnx |" in report and "| ↳ onnx_optimizer |" in report


def test_export_executorch(tmp_path):
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    result = run(
        "export", "tiny-llama", "--format", "executorch", "--dynamic", "--out", out, "--dump-dir", dumps, "--verify"
    )
    assert (out / "model.pte").is_file() and (out / "hfexport.json").is_file()
    assert not list(out.glob("*.pte.json"))  # the manifest replaced the sidecar
    assert (dumps / "05_delegate" / "delegation.md").is_file()
    assert "| delegate |" in result.stdout
    # to_edge deep-copies tree specs, and torch warns about its own LeafSpec on each copy
    assert "FutureWarning" not in result.stderr


# tiny-gemma3: sliding-window layers (window 4), loaded from decode.pt2 in a fresh process
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma3"])
def test_export_for_generation_then_generate(tmp_path, preset):
    out = tmp_path / "gen"
    export = run(
        "export", preset, "--format", "dynamo", "--dynamic", "--generation", "--max-cache-len", "32", "--out", out
    )
    # the decode graph takes the prompt, so the prefill `generate` never runs is not exported
    assert (out / "decode.pt2").is_file() and not (out / "prefill.pt2").exists()
    # progress per component and per stage
    lines = export.stderr.splitlines()
    assert [line for line in lines if line.startswith("component ")] == ["component 1/1: decode"]
    assert sum(line.startswith("[1/2] capture done") for line in lines) == 1
    result = run("generate", out, "--prompt-ids", "5,9,14,2,77", "--max-new-tokens", "8")
    model = build(preset)
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([[5, 9, 14, 2, 77]]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    assert result.stdout.strip().splitlines()[-1] == ",".join(map(str, expected[0, 5:].tolist()))


def test_generation_export_of_the_components_asked_for_generates(tmp_path):
    out = tmp_path / "gen"
    export = run("export", "tiny-llama", "--generation", "--components", "prefill,decode", "--out", out)
    assert [line for line in export.stderr.splitlines() if line.startswith("component ")] == [
        "component 1/2: prefill",
        "component 2/2: decode",
    ]
    assert (out / "prefill.pt2").is_file() and (out / "decode.pt2").is_file()
    result = run("generate", out, "--prompt-ids", "5,9,14", "--max-new-tokens", "4")
    model = build("tiny-llama")
    with torch.no_grad():
        expected = model.generate(torch.tensor([[5, 9, 14]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert result.stdout.strip().splitlines()[-1] == ",".join(map(str, expected[0, 3:].tolist()))
    wrong = run("export", "tiny-llama", "--generation", "--components", "encoder", "--out", tmp_path / "x", check=False)
    assert (
        wrong.returncode != 0 and "has no generation component encoder; its components: prefill, decode" in wrong.stderr
    )


def test_generation_export_with_no_options_generates(tmp_path):
    # --generation implies --dynamic: a static decode graph could not take a prompt, then one token
    # and generate without --max-new-tokens goes on until the default cache of 256 is full (a random
    # model says no end-of-sequence token), and says so
    out = tmp_path / "gen"
    run("export", "tiny-llama", "--generation", "--out", out)
    result = run("generate", out, "--prompt-ids", "5,9,14,2,77")
    model = build("tiny-llama")
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([[5, 9, 14, 2, 77]]), max_new_tokens=251, min_new_tokens=251, do_sample=False
        )
    assert result.stdout.strip().splitlines()[-1] == ",".join(map(str, expected[0, 5:].tolist()))
    assert "decode" in result.stderr and "(251 new tokens)" in result.stderr  # the figures line
    assert "stopped: the prompt and the answer filled the export's cache (256 tokens)" in result.stderr
