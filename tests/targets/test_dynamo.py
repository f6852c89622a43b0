"""DynamoExporter end to end: numerics against eager on several shapes, explicit Dims."""

import pytest
import torch
from models import build, eager, main_output, sample_inputs

from hfexport import DynamoConfig, DynamoExporter

SHAPES = [(2, 8), (3, 13), (1, 5)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-bert"])
def test_dynamic_export_matches_eager_on_other_shapes(preset):
    model = build(preset)
    program = DynamoExporter().export(model, sample_inputs(model, 2, 8), config=DynamoConfig(dynamic=True))
    assert isinstance(program, torch.export.ExportedProgram)
    for batch, seq in SHAPES:
        inputs = sample_inputs(model, batch, seq, seed=batch * 100 + seq)
        with torch.no_grad():
            got = program.module()(**inputs)
        expected = main_output(eager(model, inputs))
        assert main_output(got).shape == expected.shape
        torch.testing.assert_close(main_output(got), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", ["tiny-mistral", "tiny-gemma3"])
def test_sliding_window_cache_exports(preset):
    # DynamicSlidingWindowLayer keeps a Python token counter that is a SymInt while tracing.
    model = build(preset)
    program = DynamoExporter().export(model, sample_inputs(model), config=DynamoConfig(dynamic=True))
    inputs = sample_inputs(model, 3, 13)
    with torch.no_grad():
        got = program.module()(**inputs)
    expected = eager(model, inputs)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=0)
    assert got.cache.layers[0].cumulative_length == 13


def test_explicit_dims_with_deferred_asserts_as_in_the_spec():
    model = build("tiny-llama")
    inputs = sample_inputs(model, 2, 8)
    inputs["attention_mask"][1, :3] = 0  # a padded batch, as a tokenizer with padding=True gives
    batch = torch.export.Dim("batch", min=1, max=32)
    seq = torch.export.Dim("seq", min=1, max=2048)
    config = DynamoConfig(
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    program = DynamoExporter().export(model, inputs, config=config)
    for shape in [(2, 8), (5, 21)]:
        sample = sample_inputs(model, *shape, seed=7)
        sample["attention_mask"][0, :2] = 0
        with torch.no_grad():
            got = program.module()(**sample).logits
        torch.testing.assert_close(got, eager(model, sample).logits, atol=1e-4, rtol=0)
    with pytest.raises(Exception, match="32"):
        program.module()(**sample_inputs(model, 33, 4))


def test_export_does_not_mutate_model_or_inputs():
    model = build("tiny-llama")
    model.train()  # exported in eval mode, and the flag must come back
    inputs = sample_inputs(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config_before = model.config.to_dict()
    attention = model.config._attn_implementation
    forward = model.forward
    inputs_before = {k: v.clone() for k, v in inputs.items()}

    DynamoExporter().export(model, inputs, config=DynamoConfig(dynamic=True, verify=True))

    assert model.training and all(m.training for m in model.modules())
    assert model.config.to_dict() == config_before
    assert model.config._attn_implementation == attention
    assert model.forward == forward and "forward" not in vars(model)
    after = model.state_dict()
    assert after.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(after[name], tensor), name
    for name, tensor in inputs_before.items():
        assert torch.equal(inputs[name], tensor), name
    assert set(inputs) == set(inputs_before)


def test_dynamic_cache_as_input_and_output():
    from transformers import DynamicCache

    model = build("tiny-llama")
    prompt = sample_inputs(model, 2, 6)
    with torch.no_grad():
        cache = model(**prompt).cache
    step = {
        "input_ids": sample_inputs(model, 2, 1, seed=3)["input_ids"],
        "attention_mask": torch.ones(2, 7, dtype=torch.long),
        "past_key_values": cache,
    }
    program = DynamoExporter().export(model, step, config=DynamoConfig(dynamic=True))
    keys_before = cache.layers[0].keys.clone()
    with torch.no_grad():
        # transformers 5.24 renamed past_key_values to cache; the program takes the new name
        got = program.module()(input_ids=step["input_ids"], attention_mask=step["attention_mask"], cache=cache)
        expected = model(**{**step, "past_key_values": _copy(cache)})
    assert torch.equal(cache.layers[0].keys, keys_before)  # the caller's cache is not updated
    assert isinstance(got.cache, DynamicCache)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.cache.layers[1].values, expected.cache.layers[1].values, atol=1e-4, rtol=0)


def _copy(cache):
    import copy

    return copy.deepcopy(cache)


class _LatePooler(torch.nn.Module):
    """Sets ``pooler_output`` after building its output, as Aya Vision's vision tower does: eager's
    field order (last_hidden_state, hidden_states, pooler_output) is not the dataclass's."""

    def forward(self, x: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        out = BaseModelOutputWithPooling(last_hidden_state=x * 2, hidden_states=(x + 1,))
        out.pooler_output = x[:, :1].mean(-1)
        return out


def test_output_fields_set_after_construction_keep_their_names(tmp_path):
    import onnxruntime as ort

    from hfexport import OnnxConfig, OnnxExporter
    from hfexport.targets.dynamo import DynamoRunner, program_component

    model, x, y = _LatePooler(), torch.randn(2, 5, 4), torch.randn(3, 7, 4)
    expected = model(y)
    expected = {
        "last_hidden_state": expected.last_hidden_state,
        "hidden_states.0": expected.hidden_states[0],
        "pooler_output": expected.pooler_output,
    }
    program = DynamoExporter().export(model, {"x": x}, config=DynamoConfig(dynamic=True))
    got = DynamoRunner(program, program_component(program, None)).run_named({"x": y})
    assert set(got) == set(expected)
    OnnxExporter().export(model, {"x": x}, config=OnnxConfig(dynamic=True)).save(tmp_path / "model.onnx")
    session = ort.InferenceSession(tmp_path / "model.onnx")
    names = [o.name for o in session.get_outputs()]
    by_name = dict(zip(names, session.run(None, {"x": y.numpy()}), strict=True))
    assert len(by_name) == 3
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=0)
        onnx_name = next(n for n in names if n.replace("_", ".").endswith(name.replace("_", ".")))
        torch.testing.assert_close(torch.from_numpy(by_name[onnx_name]), value, atol=1e-6, rtol=0)
