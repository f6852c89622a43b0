"""Issue 12, class 5: an ordinary command-line mistake is one line on stderr saying what was wrong
and what to do, a non-zero exit, no traceback; ``--debug`` shows the traceback."""

import json
import shutil
import subprocess
import sys

import pytest
from models import build
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from hfexport.cli import main


def one_line_error(capsys, argv, *words):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert "Traceback" not in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("hfexport: error:")]
    assert len(errors) == 1 and all(word in errors[0] for word in words), err[-2000:]
    return errors[0]


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "saved"
    build("tiny-llama").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def generation_export(tmp_path_factory, saved_llama):
    out = tmp_path_factory.mktemp("gen") / "gen"
    assert main(["export", str(saved_llama), "--generation", "--components", "decode", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["export", "tiny-llama", "--out", "{tmp}/o", "--seq", "-1"], ["--seq", "at least 1, got -1"]),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--batch", "two"], ["--batch", "whole number"]),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--config", "{tmp}/bad.json"], ["cannot read a JSON object"]),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--config", "{tmp}/dynamic.json"], ["dynamic must be bool"]),
        (
            ["export", "tiny-llama", "--out", "{tmp}/o", "--format", "executorch", "--config", "{tmp}/cuda.json"],
            ["CUDA"],
        ),
        (
            ["export", "tiny-llama", "--out", "{tmp}/o", "--config", "{tmp}/dim-min-max.json"],
            ["min 10 above its max 2"],
        ),
        (
            ["export", "tiny-llama", "--out", "{tmp}/o", "--config", "{tmp}/dim-range.json"],
            ["'input_ids' axis 1 has sample size 8, outside its Dim 'seq' range [10, 64]"],
        ),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--config", "{tmp}/dim-axis.json"], ["axis 5", "has 2 axes"]),
        (
            ["export", "tiny-llama", "--out", "{tmp}/o", "--quantize", "int4"],
            ["--quantize does not apply to", "dynamo"],
        ),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--format", "onnx", "--quantize", "int2"], ["'int4' or 'int8'"]),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--passes", "nope"], ["unknown pass 'nope'"]),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--format", "tflite"], ["unknown --format tflite"]),
        (["export", "no-such-model", "--out", "{tmp}/o"], ["neither a preset", "nor a folder"]),
        (["export", "{tmp}/no-weights", "--out", "{tmp}/o"], ["no-weights"]),
        (["export", "{tmp}/broken-config", "--out", "{tmp}/o"], ["error"]),
        (["export", "tiny-bert", "--generation", "--out", "{tmp}/o"], ["BertModel does not generate"]),
        (["export", "tiny-llama", "--out", "{tmp}/file.txt"], ["is a file"]),
        (["export", "tiny-llama", "--out", "{tmp}/o", "--dump-dir", "{tmp}/file.txt"], ["dump_dir", "is a file"]),
        (["generate", "{tmp}/missing", "--prompt-ids", "1,2"], ["no hfexport.json"]),
        (["replay", "{tmp}/missing.pt2", "--passes", "dead_code_elimination"], ["does not exist"]),
        (["replay", "{tmp}/missing.onnx", "--passes", "onnx_optimizer"], ["missing.onnx does not exist"]),
        (["replay", "{tmp}/bad.onnx", "--passes", "onnx_optimizer"], ["not a readable ONNX model", "DecodeError"]),
        (["replay", "{tmp}/empty.onnx", "--passes", "onnx_optimizer"], ["holds no ONNX graph"]),
        (["replay", "{tmp}/file.txt", "--passes", "onnx_optimizer"], ["a .pt2, .onnx or .edge.pt2 file", "not .txt"]),
    ],
)
def test_a_mistake_is_one_line(tmp_path, capsys, argv, words):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "dynamic.json").write_text(json.dumps({"dynamic": "no"}))
    (tmp_path / "cuda.json").write_text(json.dumps({"backend": "cuda"}))
    for name, dim in [("min-max", {"min": 10, "max": 2}), ("range", {"min": 10, "max": 64}), ("axis", {})]:
        axis = "5" if name == "axis" else "1"
        shapes = {"dynamic_shapes": {"input_ids": {axis: {"dim": "seq", **dim}}}}
        (tmp_path / f"dim-{name}.json").write_text(json.dumps(shapes))
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "bad.onnx").write_text("{not an onnx model")
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "no-weights").mkdir()
    build("tiny-llama").config.save_pretrained(tmp_path / "no-weights")
    (tmp_path / "broken-config").mkdir()
    (tmp_path / "broken-config" / "config.json").write_text("{")
    one_line_error(capsys, [a.format(tmp=tmp_path) for a in argv], *words)
    assert (tmp_path / "file.txt").read_text() == "mine" and not (tmp_path / "o").exists()


def test_generate_mistakes_are_one_line(generation_export, tmp_path, capsys):
    one_line_error(capsys, ["generate", generation_export, "--prompt-ids", "a,b"], "comma-separated integers")
    one_line_error(capsys, ["generate", generation_export, "--prompt-ids", "5,128"], "[128]", "0 to 127")
    one_line_error(capsys, ["generate", generation_export, "--prompt-ids", "5", "--max-new-tokens", "0"], "at least 1")
    one_line_error(capsys, ["generate", generation_export, "--prompt-ids", "5", "--chat"], "--chat", "--prompt text")
    long = ",".join(["5"] * 60)
    too_many = ["--max-new-tokens", "250"]
    one_line_error(
        capsys, ["generate", generation_export, "--prompt-ids", long, *too_many], "prompt (60) + new tokens (250)"
    )
    full = ",".join(["5"] * 256)
    one_line_error(
        capsys, ["generate", generation_export, "--prompt-ids", full], "prompt (256 tokens) fills", "--max-cache-len"
    )
    static = tmp_path / "static"
    assert main(["export", "tiny-llama", "--out", str(static)]) == 0
    one_line_error(capsys, ["generate", static, "--prompt-ids", "5"], "single-graph export")
    # another model's tokenizer beside the program: its ids would index past the embedding table,
    # which the runtime reported as a failed kernel with "the program may need other sizes"
    mismatched = tmp_path / "mismatched"
    shutil.copytree(generation_export, mismatched)
    words = Tokenizer(WordLevel({"<unk>": 0, "hello": 500}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(mismatched)
    one_line_error(
        capsys,
        ["generate", mismatched, "--prompt", "hello"],
        "[500] outside the model's vocabulary (0 to 127)",
        "not the model's tokenizer",
    )


def test_an_onnx_graph_this_onnx_runtime_cannot_load_names_the_version_it_was_exported_with(
    tmp_path, capsys, saved_llama, monkeypatch
):
    # the decode graph uses ONNX Runtime contrib ops (GroupQueryAttention with its query lengths)
    # that an older ONNX Runtime rejects when it loads the file: when the installed version is
    # not the one the manifest recorded, the one-line error names both, next to the truncated-file
    # cause (here the real runtime fails on a truncated file, under another version string)
    import onnxruntime

    out = tmp_path / "onnx"
    argv = ["export", str(saved_llama), "--format", "onnx", "--generation", "--components", "decode", "--out", str(out)]
    assert main([*argv, "--max-cache-len", "16"]) == 0
    path = out / "model.onnx"
    path.write_bytes(path.read_bytes()[:2048])
    monkeypatch.setattr(onnxruntime, "__version__", "1.20.0")
    exported_with = json.loads((out / "hfexport.json").read_text())["versions"]["onnxruntime"]
    one_line_error(
        capsys,
        ["generate", out, "--prompt-ids", "5,6"],
        "truncated",
        f"onnxruntime {exported_with}, and this is 1.20.0",
        f"install onnxruntime=={exported_with}",
    )


def test_debug_shows_the_traceback(tmp_path):
    command = [sys.executable, "-m", "hfexport.cli", "--debug", "generate", str(tmp_path), "--prompt-ids", "1"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" in result.stderr and "no hfexport.json" in result.stderr


@pytest.mark.parametrize(("fmt", "artifact"), [("onnx", "model.onnx"), ("executorch", "model.pte")])
def test_a_truncated_artifact_given_to_generate_is_one_line(tmp_path, capsys, saved_llama, fmt, artifact):
    out = tmp_path / fmt
    argv = ["export", str(saved_llama), "--format", fmt, "--generation", "--components", "decode", "--out", str(out)]
    assert main([*argv, "--max-cache-len", "16"]) == 0
    path = out / artifact
    path.write_bytes(path.read_bytes()[:2048])
    one_line_error(capsys, ["generate", out, "--prompt-ids", "5,6"], str(path), "truncated")
