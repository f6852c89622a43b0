"""Issue 12, class 7: every target's runner checks inputs by name before execution (missing,
unknown, dtype, rank, static sizes, lower and upper bounds, axes sharing one dimension) and names
the input."""

import pytest
import torch
from models import build, sample_inputs

from hfexport import DynamoConfig, ExecutorchConfig, ExportFolder, HfExportError, OnnxConfig, run_targets, save_export


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    model = build("tiny-llama")
    configs = [DynamoConfig(dynamic=True), OnnxConfig(dynamic=True), ExecutorchConfig(dynamic=True)]
    results = run_targets(model, sample_inputs(model), configs)
    found = {}
    for fmt, result in results.items():
        folder = tmp_path_factory.mktemp(fmt)
        save_export(folder, {"model": result})
        found[fmt] = ExportFolder(folder).runner()
    return found


def mistakes(inputs):
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    return [
        ({"input_ids": ids}, "missing input\\(s\\) \\['attention_mask'\\]"),
        ({**inputs, "pixel_values": torch.zeros(1)}, "unknown input\\(s\\) \\['pixel_values'\\]"),
        ({**inputs, "input_ids": ids.int()}, "'input_ids' has dtype int32, the program takes int64"),
        ({**inputs, "attention_mask": mask.float()}, "'attention_mask' has dtype float32, the program takes int64"),
        (
            {"input_ids": ids[:, :0], "attention_mask": mask[:, :0]},
            "'input_ids' axis 1 has size 0, below the exported minimum 1 \\(an empty input\\)",
        ),
        ({**inputs, "input_ids": ids[0]}, "'input_ids' has rank 1, the program expects 2"),
        (
            {**inputs, "attention_mask": mask[:, :4]},
            "break a size relation the program was exported with: .*input_ids.shape\\[1\\] = 5, "
            "attention_mask.shape\\[1\\] = 4",
        ),
    ]


@pytest.mark.parametrize("target", ["dynamo", "onnx", "executorch"])
def test_each_bad_input_is_named_before_the_runtime_runs(folders, target):
    model = build("tiny-llama")
    inputs = sample_inputs(model, 2, 5)
    runner = folders[target]
    for bad, message in mistakes(inputs):
        with pytest.raises(HfExportError, match=message):
            runner.run(bad)
    # and the good inputs, batch 1 included, still run
    for batch in (1, 3):
        good = sample_inputs(model, batch, 5)
        with torch.no_grad():
            expected = model(**good).logits
        got = torch.as_tensor(runner.run(good)[0])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # a strided view (a slice of a longer mask) runs like its contiguous copy
    sliced = {**good, "attention_mask": torch.ones(3, 10, dtype=torch.long)[:, ::2]}
    assert not sliced["attention_mask"].is_contiguous()
    torch.testing.assert_close(torch.as_tensor(runner.run(sliced)[0]), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("raw", "meaning"),
    [
        ("method->execute() failed with error 0x12", "method->execute() failed with error 0x12: an invalid argument"),
        ("Failed to load program, error: 0x:23", "Failed to load program, error: 0x:23: an invalid program"),
        ("no code here", "no code here"),
    ],
)
def test_the_executorch_runtimes_bare_codes_are_named(raw, meaning):
    from hfexport.targets.executorch.runner import runtime_error_text

    assert runtime_error_text(RuntimeError(raw)) == meaning


def test_axes_exported_with_one_dim_must_agree(tmp_path):
    model = build("tiny-llama")
    seq = torch.export.Dim("seq", min=2, max=32)
    config = OnnxConfig(dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    save_export(tmp_path, {"model": run_targets(model, sample_inputs(model, 2, 5), [config])["onnx"]})
    runner = ExportFolder(tmp_path).runner()
    inputs = sample_inputs(model, 2, 6)
    with pytest.raises(
        HfExportError, match="'attention_mask' axis 1 has size 4, but input 'input_ids' axis 1 has size 6"
    ):
        runner.run({**inputs, "attention_mask": inputs["attention_mask"][:, :4]})
    torch.testing.assert_close(
        torch.as_tensor(runner.run(inputs)[0]), model(**inputs).logits.detach(), atol=1e-4, rtol=0
    )


class WholeWindows(torch.nn.Module):
    """Adds each token's window of 4 (the windows' tokens repeated) to the tokens: the trace
    conditions the sequence on being whole windows, a condition no axis range can state."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        batch, length, width = hidden.shape
        windows = hidden[:, : 4 * (length // 4)].reshape(batch, length // 4, 4, width).mean(2)
        return hidden + windows.repeat_interleave(4, dim=1)


@pytest.mark.parametrize(
    "config", [OnnxConfig(dynamic=True), ExecutorchConfig(dynamic=True)], ids=["onnx", "executorch"]
)
def test_a_runtime_failure_names_the_shape_condition_the_trace_fixed(tmp_path, config):
    model = WholeWindows().eval()
    sample = {"input_ids": torch.randint(0, 10, (2, 8))}
    save_export(tmp_path, {"model": next(iter(run_targets(model, sample, [config]).values()))})
    runner = ExportFolder(tmp_path).runner()
    for length in (4, 12):  # whole windows run, and match eager
        ids = torch.randint(0, 10, (2, length))
        torch.testing.assert_close(torch.as_tensor(runner.run({"input_ids": ids})[0]), model(ids), atol=1e-5, rtol=0)
    with pytest.raises(
        HfExportError,
        match=r"failed running the program \(.*\): the inputs' shapes fail a condition the program was traced "
        r"with, .*input_ids\.shape\[1\].* does not hold for input_ids\.shape\[1\] = 6; ",
    ):
        runner.run({"input_ids": torch.randint(0, 10, (2, 6))})
