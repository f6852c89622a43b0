"""Issue 12, class 1: what would have been silently wrong or silently changed is an error that
names the cause, or does what was asked."""

import numpy as np
import pytest
import torch
from models import build, sample_inputs

from hfexport import ConfigError, DynamoConfig, DynamoExporter, OnnxConfig, OnnxExporter, PassError, register_pass
from hfexport.pipeline.pass_manager import PassResult


@register_pass(name="test_returns_a_string")
def returns_a_string(program):
    return PassResult("not a program", modified=True)


@register_pass(name="test_drops_an_onnx_output", stage="onnx_passes")
def drops_an_onnx_output(program):
    program.model.graph.outputs.pop()
    return PassResult(program, modified=True)


def test_a_pass_returning_a_non_program_fails_and_export_never_returns_it():
    model = build("tiny-llama")
    with pytest.raises(PassError, match="test_returns_a_string.*program is a str, expected ExportedProgram"):
        DynamoExporter().export(model, sample_inputs(model), DynamoConfig(passes=["test_returns_a_string"]))


def test_an_onnx_pass_dropping_a_graph_output_fails_naming_the_outputs():
    model = build("tiny-llama")
    config = OnnxConfig(passes=["test_drops_an_onnx_output"])
    dropped = r"changed the program signature.*'cache.layers.1.values'\] -> \[[^\]]*'cache.layers.1.keys'\]"
    with pytest.raises(PassError, match=f"test_drops_an_onnx_output.*{dropped}"):
        OnnxExporter().export(model, sample_inputs(model), config)


@pytest.mark.parametrize("opset", [7, 17, 99])
def test_an_opset_torch_onnx_cannot_write_is_refused_when_the_config_is_built(opset):
    with pytest.raises(ConfigError, match=f"opset_version must be an int from 18 through \\d+.*got {opset}"):
        OnnxConfig(opset_version=opset)


@pytest.mark.parametrize("opset", ["20", 18.0, True])
def test_an_opset_that_is_not_an_int_is_refused(opset):
    with pytest.raises(ConfigError, match=f"opset_version must be int or None, got {opset!r}"):
        OnnxConfig(opset_version=opset)


def test_the_opset_asked_for_is_the_opset_written():
    model = build("tiny-llama")
    program = OnnxExporter().export(model, sample_inputs(model), OnnxConfig(opset_version=21))
    assert program.model.opset_imports[""] == 21
    torch.testing.assert_close(
        torch.from_numpy(np.asarray(program(**sample_inputs(model))[0])),
        model(**sample_inputs(model)).logits.detach(),
        atol=1e-4,
        rtol=0,
    )


@register_pass(name="test_zeroes_a_weight_in_place")
def zeroes_a_weight_in_place(program):
    program.state_dict["model.embed_tokens.weight"].data.zero_()
    return PassResult(program, modified=True)


def weights_hash(model):
    return hash(tuple((name, float(tensor.double().abs().sum())) for name, tensor in model.state_dict().items()))


def test_a_user_pass_editing_weights_in_place_leaves_the_users_model_unchanged():
    model = build("tiny-llama")
    before = weights_hash(model)
    config = DynamoConfig(passes=["test_zeroes_a_weight_in_place"])
    program = DynamoExporter().export(model, sample_inputs(model), config)
    assert weights_hash(model) == before
    assert float(program.state_dict["model.embed_tokens.weight"].detach().abs().sum()) == 0.0  # its own copy
    assert float(model.model.embed_tokens.weight.detach().abs().sum()) > 0


@pytest.mark.parametrize("target", ["dynamo", "onnx"])
def test_editing_the_model_after_the_export_leaves_the_program_unchanged(target):
    model = build("tiny-llama")
    inputs = sample_inputs(model)
    expected = model(**inputs).logits.detach()
    if target == "dynamo":
        program = DynamoExporter().export(model, inputs)
        run = lambda: program.module()(**inputs).logits.detach()  # noqa: E731
    else:
        program = OnnxExporter().export(model, inputs, OnnxConfig(optimize=False))
        # the first call serialises the model into an ONNX Runtime session: after the edit
        run = lambda: torch.from_numpy(np.asarray(program(**inputs)[0]))  # noqa: E731
    with torch.no_grad():
        model.lm_head.weight.zero_()
    assert model(**inputs).logits.abs().max() == 0  # the model did change
    torch.testing.assert_close(run(), expected, atol=1e-4, rtol=0)


def test_a_static_export_refuses_an_input_the_model_never_reads():
    model = build("tiny-llama")
    inputs = dict(sample_inputs(model))
    inputs["attention_masks"] = inputs["attention_mask"].clone()  # misspelled: forward only sees it in **kwargs
    with pytest.raises(ConfigError, match="does not use input 'attention_masks'.*fix its name.*attention_mask"):
        DynamoExporter().export(model, inputs)
    assert "attention_masks" in inputs  # the caller's dict is untouched


def test_an_input_that_is_no_parameter_of_forward_is_refused_before_tracing():
    class Plain(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids * 2

    with pytest.raises(ConfigError, match="Plain.forward has no parameter 'input_id'.*forward takes: input_ids"):
        DynamoExporter().export(Plain(), {"input_id": torch.ones(1, 3)})


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (
            torch.tensor([[1, 500, 3]]),
            "'input_ids' holds id\\(s\\) \\[500\\] outside the embedding table \\(0 to 127\\)",
        ),
        (torch.tensor([[1, -1, 3]]), "'input_ids' holds id\\(s\\) \\[-1\\] outside the embedding table"),
        (torch.tensor([[1.0, 2.0]]), "'input_ids' holds token ids but has dtype float32; pass integer ids"),
        (torch.zeros(1, 0, dtype=torch.long), "'input_ids' is empty \\(shape \\(1, 0\\)\\)"),
        ([[1, 2, 3]], "'input_ids' is a list; pass a torch tensor"),
        (np.array([[1, 2, 3]]), "'input_ids' is a ndarray; pass a torch tensor"),
    ],
)
def test_a_sample_the_model_cannot_run_is_refused_before_tracing(ids, message):
    # a tracer never looks at values: ids outside the table would be captured without a word
    model = build("tiny-llama")
    with pytest.raises(ConfigError, match=message):
        DynamoExporter().export(model, {"input_ids": ids})
