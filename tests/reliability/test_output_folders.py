"""Issue 12, class 6: no stale artifact that looks valid. ``--out`` must be empty unless
``--overwrite`` is given, which removes the earlier export before the new one starts; the new one
is staged and moved in only when complete, so a failed or interrupted export leaves no program;
a reused dump folder loses the earlier run's step folders."""

import os
import signal
import subprocess
import sys

import pytest

from hfexport import register_pass
from hfexport.cli import main
from hfexport.pipeline.pass_manager import PassResult

HFEXPORT = [sys.executable, "-m", "hfexport.cli"]
PROGRAM_FILES = ("hfexport.json", "model.pt2", "model.onnx", "model.pte")


@register_pass(name="test_output_folders_fails")
def fails(program):
    raise RuntimeError("boom")


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def earlier_export(tmp_path):
    out = tmp_path / "out"
    assert main(["export", "tiny-llama", "--format", "dynamo", "--out", str(out)]) == 0
    assert {"hfexport.json", "model.pt2"} <= set(listing(out))
    return out


def test_a_non_empty_out_is_refused_without_overwrite_and_left_as_it_was(earlier_export, capsys):
    before = {name: (earlier_export / name).read_bytes() for name in listing(earlier_export)}
    assert main(["export", "tiny-llama", "--format", "onnx", "--out", str(earlier_export)]) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("hfexport: error: --out ") and "is not empty" in message and "--overwrite" in message
    assert {name: (earlier_export / name).read_bytes() for name in listing(earlier_export)} == before


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("mine")
    assert main(["export", "tiny-llama", "--out", str(file)]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err
    assert file.read_text() == "mine"


def test_overwrite_with_another_format_leaves_only_the_new_program(earlier_export):
    assert main(["export", "tiny-llama", "--format", "onnx", "--out", str(earlier_export), "--overwrite"]) == 0
    assert listing(earlier_export) == ["hfexport.json", "model.onnx"]


def test_a_failed_export_over_an_earlier_one_leaves_no_program(earlier_export, capsys):
    (earlier_export / "notes.txt").write_text("mine")
    command = ["export", "tiny-llama", "--out", str(earlier_export), "--overwrite"]
    assert main([*command, "--passes", "test_output_folders_fails"]) == 2
    assert "RuntimeError: boom" in capsys.readouterr().err
    assert listing(earlier_export) == ["notes.txt"]  # the user's file stays; no program, old or new


def test_an_interrupted_export_over_an_earlier_one_leaves_no_program(earlier_export):
    # ExecuTorch: its delegate stage takes seconds, so the interrupt lands mid-export
    command = [*HFEXPORT, "export", "tiny-llama", "--format", "executorch", "--out", str(earlier_export), "--overwrite"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in process.stderr:  # interrupt as the delegate stage starts
        seen.append(line)
        if line.startswith("[4/") and "done" not in line:
            break
    os.kill(process.pid, signal.SIGINT)
    rest = process.stderr.read()
    assert process.wait(timeout=300) == 130, "".join(seen)[-2000:] + rest[-2000:]
    assert "interrupted; nothing from this run was written" in rest and "Traceback" not in rest
    assert not [name for name in listing(earlier_export) if name in PROGRAM_FILES or name.startswith(".hfexport")]


def test_a_reused_dump_folder_loses_the_earlier_runs_step_folders(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "notes.txt").write_text("mine")
    first = ["--passes", "remove_noop_conversions,dead_code_elimination", "--dump-dir", str(dumps)]
    assert main(["export", "tiny-llama", "--out", str(tmp_path / "a"), *first]) == 0
    assert (dumps / "01_fx_passes" / "01_dead_code_elimination").is_dir()
    second = ["--passes", "remove_noop_conversions", "--dump-dir", str(dumps)]
    assert main(["export", "tiny-llama", "--out", str(tmp_path / "b"), *second]) == 0
    assert sorted(p.name for p in (dumps / "01_fx_passes").iterdir() if p.is_dir()) == ["00_remove_noop_conversions"]
    assert (dumps / "notes.txt").read_text() == "mine" and (dumps / "report.md").is_file()


def test_a_dump_dir_that_is_a_file_is_one_clear_error(tmp_path, capsys):
    file = tmp_path / "dumps"
    file.write_text("mine")
    assert main(["export", "tiny-llama", "--out", str(tmp_path / "out"), "--dump-dir", str(file)]) == 2
    assert "dump_dir" in capsys.readouterr().err and file.read_text() == "mine"


@register_pass(name="test_output_folders_swallows_ctrl_c")
def swallows_ctrl_c(program):
    try:  # what backend code that catches KeyboardInterrupt does
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10**6))  # the handler runs between bytecodes
    except KeyboardInterrupt:
        pass
    return PassResult(program, modified=False)


def test_an_interrupt_a_backend_swallows_still_writes_nothing(earlier_export, capsys):
    command = ["export", "tiny-llama", "--out", str(earlier_export), "--overwrite"]
    assert main([*command, "--passes", "test_output_folders_swallows_ctrl_c"]) == 130
    assert "interrupted; nothing from this run was written" in capsys.readouterr().err
    assert not [name for name in listing(earlier_export) if name in PROGRAM_FILES or name.startswith(".hfexport")]
