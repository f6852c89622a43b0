"""Issue 12, classes 2 and 8: options are validated when the config is built, bounds against the
sample before capture, and the figures in messages are the real ones."""

import math

import pytest
import torch
from models import build, sample_inputs
from transformers import GenerationConfig

from hfexport import (
    AutoExportConfig,
    ConfigError,
    DynamoConfig,
    DynamoExporter,
    ExecutorchConfig,
    ExecutorchExporter,
    PassOrderError,
    StageError,
    register_pass,
)
from hfexport.pipeline.numerics import max_abs_diff
from hfexport.pipeline.pass_manager import PassResult


def state_hash(model):
    return hash(tuple((name, tensor.sum().item()) for name, tensor in model.state_dict().items()))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"dynamic": "no"}, "DynamoConfig dynamic must be bool, got 'no' (str)"),
        ({"strict": 1}, "DynamoConfig strict must be bool, got 1 (int)"),
        ({"tolerance": "1e-3"}, "DynamoConfig tolerance must be float or None, got '1e-3' (str)"),
        ({"tolerance": -1}, "tolerance must be a positive number"),
        ({"tolerance": math.inf}, "tolerance must be a positive number"),
        ({"export_format": "executorch", "max_seq_len": 0}, "ExecutorchConfig max_seq_len must be at least 1, got 0"),
        ({"export_format": "executorch", "max_batch_size": -2}, "max_batch_size must be at least 1, got -2"),
        ({"export_format": "executorch", "max_batch_size": "8"}, "max_batch_size must be int or None, got '8' (str)"),
        ({"export_format": "onnx", "optimize": "false"}, "OnnxConfig optimize must be bool, got 'false' (str)"),
    ],
)
def test_a_bad_option_is_refused_when_the_config_is_built(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AutoExportConfig.from_dict({"export_format": "dynamo", **values})


def test_bounds_below_the_sample_are_refused_with_the_real_sizes():
    model = build("tiny-llama")
    before = state_hash(model)
    inputs = sample_inputs(model, 2, 8)
    with pytest.raises(ConfigError, match="'input_ids' has batch 2, above the batch bound 1"):
        ExecutorchExporter().export(model, inputs, ExecutorchConfig(dynamic=True, max_seq_len=4, max_batch_size=1))
    with pytest.raises(ConfigError, match="'input_ids' has 8 tokens, above the sequence bound 4"):
        ExecutorchExporter().export(model, inputs, ExecutorchConfig(dynamic=True, max_seq_len=4))
    assert state_hash(model) == before and inputs["input_ids"].shape == (2, 8)


def test_a_cache_shorter_than_the_sample_prompt_is_refused():
    model = build("tiny-llama")
    short = GenerationConfig(cache_implementation="static", max_cache_len=4)
    with pytest.raises(ConfigError, match="max_cache_len=4 cannot hold the sample prompt \\(8 tokens\\)"):
        DynamoExporter().export_for_generation(model, sample_inputs(model, 1, 8), DynamoConfig(dynamic=True), short)


def test_a_nan_is_reported_as_nan_and_fails_verification():
    expected = [torch.tensor([1.0, 2.0])]
    assert math.isnan(max_abs_diff(expected, [torch.tensor([1.0, float("nan")])]))
    assert max_abs_diff([torch.tensor([float("nan")])], [torch.tensor([float("nan")])]) == 0.0
    assert not max_abs_diff(expected, [torch.tensor([1.0, float("nan")])]) <= 1e-4


def test_an_eager_failure_under_verify_names_the_eager_reference_run_not_a_stage():
    class FailsEagerly(torch.nn.Module):
        def forward(self, input_ids):
            raise RuntimeError("eager forward is broken")

    with pytest.raises(StageError, match="^the eager reference run \\(verify\\) failed: RuntimeError: eager forward"):
        DynamoExporter().export(
            FailsEagerly(), {"input_ids": torch.ones(1, 3, dtype=torch.long)}, DynamoConfig(verify=True)
        )


def test_a_pass_listed_twice_is_refused():
    model = build("tiny-llama")
    passes = ["remove_noop_conversions", "dead_code_elimination", "remove_noop_conversions"]
    with pytest.raises(PassOrderError, match="remove_noop_conversions listed more than once"):
        DynamoExporter().export(model, sample_inputs(model), DynamoConfig(passes=passes))


def test_a_user_pass_cannot_take_a_built_in_name():
    with pytest.raises(ConfigError, match="pass name 'dead_code_elimination' is taken by hfexport's own pass"):

        @register_pass(name="dead_code_elimination")
        def mine(program):
            return PassResult(program, modified=False)

    from hfexport import get_pass

    assert get_pass("dead_code_elimination").fn.__module__.startswith("hfexport.")


USER_PASSES = """
from hfexport import register_pass


@register_pass(name="user_explodes")
def user_explodes(program):
    raise RuntimeError("boom from the user's module")
"""


def test_the_reproducer_of_a_user_pass_says_how_to_load_it_and_replays_in_a_new_process(tmp_path):
    import shlex
    import subprocess
    import sys

    module = tmp_path / "my_passes.py"
    module.write_text(USER_PASSES)
    dumps, out = tmp_path / "dumps", tmp_path / "out"
    hfexport = [sys.executable, "-m", "hfexport.cli"]
    export = [*hfexport, "export", "tiny-llama", "--import", str(module), "--passes", "user_explodes"]
    failed = subprocess.run([*export, "--dump-dir", str(dumps), "--out", str(out)], capture_output=True, text=True)
    assert failed.returncode == 2 and "boom from the user's module" in failed.stderr, failed.stderr[-2000:]
    comment, command = (dumps / "01_fx_passes" / "00_user_explodes" / "repro.txt").read_text().splitlines()
    assert f"--import loads {module}" in comment
    replayed = subprocess.run([*hfexport, *shlex.split(command)[1:]], capture_output=True, text=True)
    assert replayed.returncode == 2, replayed.stderr[-2000:]
    assert "pass 'user_explodes'" in replayed.stderr and "boom from the user's module" in replayed.stderr
    assert "Traceback" not in replayed.stderr


def test_an_import_that_fails_is_one_clear_error(tmp_path, capsys):
    from hfexport.cli import main

    assert main(["passes", "--import", "no_such_module_here"]) == 2
    assert "--import no_such_module_here failed: ModuleNotFoundError" in capsys.readouterr().err
