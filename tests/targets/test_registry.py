"""The target registry drives the auto classes and the command line: a toy target registered here
is exported through `hfexport export --format` with no change to the CLI."""

import json
from pathlib import Path

import pytest
from models import build, eager, sample_inputs

from hfexport import AutoExportConfig, AutoHfExporter, DynamoConfig, HfExporter, Target, get_target
from hfexport.cli import main
from hfexport.targets import TARGETS
from hfexport.targets.dynamo import program_component


class ToyConfig(DynamoConfig):
    export_format = "toy"


class ToyExporter(HfExporter):
    export_format = "toy"


class ToyTarget(Target):
    """Writes the program's graph as text."""

    name = "toy"
    suffix = ".toy"
    config_class = ToyConfig
    default_passes = ("remove_tensor_metadata_asserts", "dead_code_elimination")

    def save(self, program, path: Path) -> None:
        path.write_text(str(program.graph))

    def component(self, program, captured):
        return program_component(program, captured)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(TARGETS, "toy", ToyTarget)
    yield
    from hfexport import targets

    targets._INSTANCES.pop("toy", None)


def test_a_registered_target_is_usable_from_the_auto_classes_and_the_cli(toy, tmp_path):
    config = AutoExportConfig.from_dict({"export_format": "toy", "dynamic": True})
    assert isinstance(config, ToyConfig) and isinstance(AutoHfExporter.from_config(config), ToyExporter)
    assert isinstance(get_target("toy"), ToyTarget)

    out = tmp_path / "out"
    assert main(["export", "tiny-llama", "--format", "dynamo,toy", "--dynamic", "--out", str(out)]) == 0
    graph = (out / "toy" / "model.toy").read_text()
    assert "aten.embedding" in graph and "_assert_tensor_metadata" not in graph  # its passes ran
    manifest = json.loads((out / "toy" / "hfexport.json").read_text())
    assert manifest["target"] == "toy" and manifest["components"]["model"]["file"] == "model.toy"
    assert [i["path"] for i in manifest["components"]["model"]["inputs"]] == ["input_ids", "attention_mask"]
    # the Dynamo artifact of the same capture runs
    from hfexport import ExportFolder

    model = build("tiny-llama")
    inputs = sample_inputs(model, 3, 5)
    import torch

    got = ExportFolder(out / "dynamo").runner().run(inputs)[0]
    torch.testing.assert_close(got, eager(model, inputs).logits, atol=1e-4, rtol=0)


def test_an_unknown_format_lists_the_registered_ones(tmp_path, capsys):
    assert main(["export", "tiny-llama", "--format", "tflite", "--out", str(tmp_path)]) == 2
    assert "unknown --format tflite; valid: dynamo, onnx, executorch" in capsys.readouterr().err
