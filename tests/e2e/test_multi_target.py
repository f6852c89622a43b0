"""One capture, several targets: the command line and Python, numerics against eager, the shared bounds."""

import pytest
import torch
from models import build, eager, sample_inputs

from hfexport import (
    ConfigError,
    DynamoConfig,
    ExecutorchConfig,
    ExportFolder,
    OnnxConfig,
    run_targets,
)
from hfexport.cli import main


@pytest.fixture
def export_calls(monkeypatch):
    calls = []
    original = torch.export.export

    def counting(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    return calls


def test_cli_onnx_and_executorch_from_one_capture(tmp_path, export_calls, capsys):
    out = tmp_path / "out"
    assert main(["export", "tiny-llama", "--format", "onnx,executorch", "--out", str(out), "--verify"]) == 0
    # one trace of the model for both targets (XNNPACK's partitioner traces its own small pattern modules)
    assert export_calls.count("LlamaForCausalLM") == 1
    model = build("tiny-llama")
    inputs = sample_inputs(model)  # the CLI's sample: static (2, 8)
    expected = eager(model, inputs).logits
    for target, suffix in [("onnx", ".onnx"), ("executorch", ".pte")]:
        folder = ExportFolder(out / target)
        assert folder.manifest.target == target and (out / target / f"model{suffix}").is_file()
        got = torch.as_tensor(folder.runner().run(inputs)[0])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    stderr = capsys.readouterr().err
    assert "[1/1] capture done" in stderr  # the one capture, then each target's stages
    assert "to_onnx done" in stderr and "to_executorch done" in stderr


def test_python_one_capture_bounded_for_executorch_feeds_both(export_calls, tmp_path):
    from hfexport import save_export

    model = build("tiny-llama")
    configs = [OnnxConfig(dynamic=True, verify=True), ExecutorchConfig(dynamic=True, verify=True, max_seq_len=64)]
    results = run_targets(model, sample_inputs(model), configs)
    assert export_calls.count("LlamaForCausalLM") == 1 and list(results) == ["onnx", "executorch"]
    for result in results.values():
        axes = {(a.input, a.axis): a for a in result.input_axes}
        assert (axes[("input_ids", 0)].max, axes[("input_ids", 1)].max) == (8, 64)
        assert result.record("to_onnx" if result.target == "onnx" else "to_executorch").max_abs_diff <= 1e-4
        assert "shared by onnx, executorch" in result.report
        assert "ExecuTorch memory planning: max_seq_len" in result.report  # the report says where the bounds come from
    # the ONNX program carries the bounds the ExecuTorch target asked for, and its runner enforces them
    save_export(tmp_path, {"model": results["onnx"]})
    runner = ExportFolder(tmp_path).runner()
    inputs = sample_inputs(model, 3, 21, seed=4)
    torch.testing.assert_close(torch.as_tensor(runner.run(inputs)[0]), eager(model, inputs).logits, atol=1e-4, rtol=0)
    from hfexport import HfExportError

    with pytest.raises(HfExportError, match="'input_ids' axis 1 has size 65, above the exported upper bound 64"):
        runner.run(sample_inputs(model, 1, 65))


def test_targets_must_agree_on_capture_settings():
    model = build("tiny-llama")
    with pytest.raises(ConfigError, match="must agree on 'dynamic'"):
        run_targets(model, sample_inputs(model), [DynamoConfig(dynamic=True), OnnxConfig()])
    with pytest.raises(ConfigError, match="names a target twice"):
        run_targets(model, sample_inputs(model), [OnnxConfig(), OnnxConfig()])
