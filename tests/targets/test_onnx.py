"""OnnxExporter end to end with a real ONNX Runtime session on the saved file."""

import collections
import contextlib
import json
import shlex

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from models import build, eager, main_output, sample_inputs

from hfexport import (
    AutoExportConfig,
    AutoHfExporter,
    ExportFolder,
    HfExportError,
    OnnxConfig,
    OnnxExporter,
    OnnxRunner,
    PassError,
    PassManager,
    get_target,
    register_pass,
    save_export,
)
from hfexport.cli import main

SHAPES = [(2, 8), (3, 13), (1, 5), (2, 80)]
PRESETS = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-qwen3-moe",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-mistral",
    "tiny-gpt2",
    "tiny-bert",
]


@pytest.mark.parametrize("preset", PRESETS)
def test_onnx_runtime_matches_eager(preset, tmp_path):
    model = build(preset)
    program = OnnxExporter().export(model, sample_inputs(model, 2, 8), config=OnnxConfig(dynamic=True))
    program.save(tmp_path / "model.onnx")
    runner = OnnxRunner(tmp_path / "model.onnx")
    expected_name = "logits" if "logits" in eager(model, sample_inputs(model)) else "last_hidden_state"
    assert runner.output_names[0] == expected_name
    for batch, seq in SHAPES:
        inputs = sample_inputs(model, batch, seq, seed=batch + seq)
        got = torch.from_numpy(runner.run_dict(inputs)[expected_name])
        torch.testing.assert_close(got, main_output(eager(model, inputs)), atol=1e-4, rtol=0)


def test_spec_example_runs_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = build("tiny-qwen3")
    inputs = sample_inputs(model, 1, 6)  # stands in for tokenizer("Hello, world!", return_tensors="pt")

    exporter = OnnxExporter()
    config = OnnxConfig(dynamic=True)
    onnx_program = exporter.export(model, inputs, config=config)

    # save and load with ONNX Runtime
    onnx_program.save("model.onnx")

    session = ort.InferenceSession("model.onnx")
    ort_inputs = {k: v.numpy() for k, v in inputs.items()}
    outputs = session.run(None, ort_inputs)

    torch.testing.assert_close(torch.from_numpy(outputs[0]), eager(model, inputs).logits, atol=1e-4, rtol=0)


def test_spec_explicit_dynamic_shapes_example_with_padding(tmp_path):
    model = build("tiny-llama")
    inputs = sample_inputs(model, 2, 8)
    inputs["attention_mask"][1, :5] = 0  # tokenizer(["Hello, world!", "Hi"], padding=True) pads the short one

    batch = torch.export.Dim("batch", min=1, max=32)
    seq = torch.export.Dim("seq", min=1, max=2048)

    exporter = OnnxExporter()
    config = OnnxConfig(
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    result = exporter.run(model, inputs, config=config)
    save_export(tmp_path, {"model": result})  # the manifest next to model.onnx records the bounds
    runner = OnnxRunner(tmp_path / "model.onnx")
    for shape in [(2, 8), (4, 11)]:
        sample = sample_inputs(model, *shape, seed=3)
        sample["attention_mask"][0, :4] = 0  # padded positions too: fully masked rows stay finite and match
        got = torch.from_numpy(runner.run_dict(sample)["logits"])
        assert not got.isnan().any()
        torch.testing.assert_close(got, eager(model, sample).logits, atol=1e-4, rtol=0)
    with pytest.raises(HfExportError, match="'input_ids' axis 0 has size 33, above the exported upper bound 32"):
        runner.run(sample_inputs(model, 33, 4))


def test_dropping_the_optimizer_by_name_changes_the_histogram(tmp_path):
    model = build("tiny-llama")
    inputs = sample_inputs(model)
    with_optimizer = OnnxExporter().run(model, inputs, OnnxConfig(dynamic=True, dump_dir=tmp_path / "a"))
    passes = [p for p in OnnxExporter().target.default_passes if p != "onnx_optimizer"]
    without = OnnxExporter().run(
        model, inputs, OnnxConfig(dynamic=True, dump_dir=tmp_path / "b", passes=passes, verify=True)
    )

    optimized = json.loads((tmp_path / "a" / "03_onnx_passes" / "00_onnx_optimizer" / "stats.json").read_text())
    plain = json.loads((tmp_path / "b" / "03_onnx_passes" / "stats.json").read_text())
    assert optimized["op_histogram"] != plain["op_histogram"]
    assert optimized["nodes"] < plain["nodes"]
    assert (tmp_path / "a" / "03_onnx_passes" / "00_onnx_optimizer" / "program.onnx").is_file()
    assert "onnx_optimizer" not in (tmp_path / "b" / "pipeline.txt").read_text()
    assert without.record("onnx_passes").max_abs_diff <= 1e-4
    assert with_optimizer.record("onnx_optimizer").counts["nodes_removed"] > 0
    # optimize=False drops it from the default list too
    assert "onnx_optimizer" not in str(OnnxExporter().build_pipeline(OnnxConfig(optimize=False)).describe())


def test_capture_runs_once(monkeypatch):
    calls = []
    original = torch.export.export

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    model = build("tiny-llama")
    OnnxExporter().export(model, sample_inputs(model), OnnxConfig(dynamic=True, verify=True))
    assert len(calls) == 1


def test_auto_classes_pick_onnx():
    config = AutoExportConfig.from_dict({"export_format": "onnx", "dynamic": True})
    assert isinstance(config, OnnxConfig) and config.dynamic and config.optimize
    assert isinstance(AutoHfExporter.from_config(config), OnnxExporter)
    assert OnnxConfig.from_json(OnnxConfig(opset_version=18, optimize=False).to_json()).opset_version == 18


def test_onnx_pass_in_a_dynamo_pipeline_is_rejected():
    from hfexport import ConfigError, DynamoConfig, DynamoExporter

    with pytest.raises(ConfigError, match="'onnx_optimizer' runs in stage 'onnx_passes'"):
        DynamoExporter().build_pipeline(DynamoConfig(passes="onnx_optimizer"))


def test_cache_outputs_have_path_names(tmp_path):
    model = build("tiny-gemma3")
    result = OnnxExporter().run(model, sample_inputs(model), OnnxConfig(dynamic=True))
    save_export(tmp_path, {"model": result})
    runner = OnnxRunner(tmp_path / "model.onnx")
    assert "cache.layers.1.keys" in runner.output_names
    assert "cache.layers.0.cumulative_length" in runner.scalar_outputs
    assert not any(name.startswith("output_") for name in runner.output_names)


def test_constant_inputs_do_not_shift_the_input_names(tmp_path):
    model = build("tiny-gpt2")
    # use_cache is a named flag of GPT-2's forward placed between tensor inputs: a constant of
    # the program, not an ONNX input
    inputs = {
        "input_ids": sample_inputs(model)["input_ids"],
        "use_cache": False,
        "attention_mask": sample_inputs(model)["attention_mask"],
    }
    save_export(tmp_path, {"model": OnnxExporter().run(model, inputs, OnnxConfig(dynamic=True))})
    runner = OnnxRunner(tmp_path / "model.onnx")
    assert sorted(runner.input_names) == ["attention_mask", "input_ids"]
    assert runner.output_names == ["logits"]
    sample = {**sample_inputs(model, 3, 9), "use_cache": False}
    got = torch.from_numpy(runner.run_dict(sample)["logits"])
    torch.testing.assert_close(got, eager(model, sample).logits, atol=1e-4, rtol=0)
    with pytest.raises(HfExportError, match="'use_cache' was exported as the constant False, got True"):
        runner.run({**sample, "use_cache": True})


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_multimodal_single_graph_runs_in_onnx_runtime(kind, tmp_path):
    # LLaVA checks its image-token count with a tensor .all() (aten._is_all_true, which torch.onnx
    # has no function for) and returns None entries in its image outputs; Qwen2-VL takes flattened
    # patch vectors whose width must stay static and its 3-section rope positions precomputed
    from models import build_llava, build_qwen2_vl

    model, inputs = build_llava() if kind == "llava" else build_qwen2_vl()
    if kind == "qwen2_vl":
        image_tokens = (inputs["input_ids"] == model.config.image_token_id).int()
        inputs["position_ids"], _ = model.model.get_rope_index(
            inputs["input_ids"], image_tokens, inputs["image_grid_thw"], None, attention_mask=inputs["attention_mask"]
        )
    result = OnnxExporter().run(model, inputs, OnnxConfig(dynamic=True))
    save_export(tmp_path, {"model": result})
    logits = torch.as_tensor(ExportFolder(tmp_path).runner().run(inputs)[0])
    torch.testing.assert_close(logits, eager(model, inputs).logits, atol=1e-4, rtol=0)


def test_default_passes_fuse_rms_norms_rotary_embeddings_and_attention_matmuls_and_keep_the_numbers():
    model = build("tiny-llama")
    result = OnnxExporter().run(model, sample_inputs(model), OnnxConfig(dynamic=True, verify=True))  # 1e-4 of eager
    (record,) = [p for s in result.records for p in s.children if p.name == "onnx_ort_fusions"]
    # 2 layers: 4 RMS norms fused with their residual adds, the final norm alone; each layer's
    # query and key rotations as ONNX Runtime's RotaryEmbedding, over one cos / sin for all layers
    assert record.counts == {"rms_normalization": 5, "skip_rms_normalization": 4, "rotary_embedding": 4}
    ops = collections.Counter(node.op_type for node in result.program.model.graph)
    assert ops["SkipSimplifiedLayerNormalization"] == 4 and ops["SimplifiedLayerNormalization"] == 1
    assert ops["Pow"] == ops["Sqrt"] == ops["Reciprocal"] == 0
    assert ops["RotaryEmbedding"] == 4 and ops["Neg"] == 0 and ops["Cos"] == ops["Sin"] == 1
    # attention as q @ kᵀ · scale: the keys are not scaled, the mask made additive once for all layers
    assert ops["IsNaN"] == 0 and ops["Where"] == 1 and ops["Softmax"] == 2
    without = OnnxExporter().run(model, sample_inputs(model), OnnxConfig(dynamic=True, optimize=False))
    skipped = {"onnx_ort_fusions", "onnx_group_query_attention", "onnx_packed_projections"}
    assert not any(p.name in skipped for s in without.records for p in s.children)


def test_projections_that_read_one_input_are_packed_into_one_matmul_with_the_same_numbers(tmp_path):
    model = build("tiny-llama")
    inputs = sample_inputs(model, 2, 8)
    packed = OnnxExporter().run(model, inputs, OnnxConfig(dynamic=True, verify=True))
    (record,) = [p for s in packed.records for p in s.children if p.name == "onnx_packed_projections"]
    # 2 layers: q k v into one; gate and up (they meet in a Mul), o, down and the lm_head apart
    assert record.counts == {"packed_matmuls": 2 * 3, "packs": 2}
    graph = packed.program.model.graph
    weights = [n for n in graph if n.op_type == "MatMul" and n.inputs[1].const_value is not None]
    # hidden 64: q k v 64 + 32 + 32, o 64, gate 128, up 128, down 64; the lm_head 128
    assert sorted(n.inputs[1].shape[1] for n in weights) == [64] * 4 + [128] * 7
    assert sorted(len(n.outputs) for n in graph if n.op_type == "Split") == [3, 3]
    passes = [p for p in get_target("onnx").default_passes if p != "onnx_packed_projections"]
    unpacked = OnnxExporter().run(model, inputs, OnnxConfig(dynamic=True, passes=passes))
    graph = unpacked.program.model.graph
    assert sum(n.op_type == "MatMul" and n.inputs[1].const_value is not None for n in graph) == 15
    other = sample_inputs(model, 3, 13, seed=1)
    logits = {}
    for name, result in (("packed", packed), ("unpacked", unpacked)):
        save_export(tmp_path / name, {"model": result})
        logits[name] = ExportFolder(tmp_path / name).runner().run(other)[0]
    np.testing.assert_allclose(logits["packed"], logits["unpacked"], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.as_tensor(logits["packed"]), eager(model, other).logits, atol=1e-4, rtol=0)


def test_save_writes_one_file_a_weight_at_a_time_that_loads_as_torch_onnx_saves_it(tmp_path):
    import onnx
    from onnx import numpy_helper

    from hfexport.targets.onnx.lowering import save_onnx

    model = build("tiny-llama")
    program = OnnxExporter().export(model, sample_inputs(model, 2, 8), config=OnnxConfig(dynamic=True))
    names = list(program.model.graph.initializers)
    save_onnx(program, tmp_path / "ours.onnx")
    assert list(program.model.graph.initializers) == names  # the program keeps its weights
    program.save(tmp_path / "torch.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.onnx", "torch.onnx"]  # no external data
    ours, theirs = onnx.load(tmp_path / "ours.onnx"), onnx.load(tmp_path / "torch.onnx")
    weights = {t.name: numpy_helper.to_array(t) for t in ours.graph.initializer}
    expected = {t.name: numpy_helper.to_array(t) for t in theirs.graph.initializer}
    assert len(weights) == len(ours.graph.initializer) == len(names) > 0
    assert weights.keys() == expected.keys()
    assert all((weights[name] == expected[name]).all() for name in names)
    assert [n.op_type for n in ours.graph.node] == [n.op_type for n in theirs.graph.node]
    inputs = sample_inputs(model, 1, 5)
    got = OnnxRunner(tmp_path / "ours.onnx").run_dict(inputs)["logits"]
    torch.testing.assert_close(torch.from_numpy(got), main_output(eager(model, inputs)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["transposed", "row-major"])
def test_a_weight_made_when_written_goes_out_in_slices_with_the_whole_conversion_s_bytes(layout, monkeypatch):
    """A weight the model stores in bfloat16, written in float32 (transposed: a linear layer's)
    a slice of rows at a time through reused buffers, has the bytes of the whole conversion; read,
    it is the same tensor."""
    import io

    import hfexport.precision
    import hfexport.targets.onnx.initializers as initializers

    monkeypatch.setattr(hfexport.precision, "_SLICE_BYTES", 3 * 40 * 4)  # three rows of 40 float32 values
    stored = torch.randn(40, 16).to(torch.bfloat16)
    source = stored.t() if layout == "transposed" else stored
    want = source.to(torch.float32).contiguous().numpy()
    tensor = initializers.MadeWhenWritten(source, torch.float32)
    for reused in (False, True):
        file = io.BytesIO()
        with hfexport.precision.buffers_reused() if reused else contextlib.nullcontext():
            tensor.tofile(file)
            tensor.tofile(file)  # a second weight through the same buffers
        assert file.getvalue() == want.tobytes() * 2
    assert tensor.dtype == ir.DataType.FLOAT and np.array_equal(tensor.numpy(), want)


class _WritesItsInput(torch.nn.Module):
    def forward(self, cache, x):
        before = cache * 1  # read before the write: the old value
        cache.add_(x)  # an in-place write of a user input, as a static cache's
        return cache * 2 + before


class _WritesAnIntermediate(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        return y


class _WritesAView(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y[:, 0].add_(1)  # the write reaches y through the view
        return y


def test_an_in_place_input_write_reaches_onnx_without_torch_onnx_retracing_it(monkeypatch):
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    from hfexport.targets.onnx.lowering import run_onnx_program, to_onnx, translatable_program

    registry = ONNXRegistry.from_torchlib()
    inputs = {"cache": torch.randn(2, 3), "x": torch.randn(2, 3)}
    program = torch.export.export(_WritesItsInput(), (), {k: v.clone() for k, v in inputs.items()})
    functional = translatable_program(program, registry)
    assert functional is not None
    assert not [n for n in functional.graph.nodes if n.op == "call_function" and n.target._schema.is_mutable]
    mutations = [s for s in functional.graph_signature.output_specs if s.kind.name == "USER_INPUT_MUTATION"]
    assert [s.target for s in mutations] == ["cache"]
    assert any(n.target is torch.ops.aten.add_.Tensor for n in program.graph.nodes)  # the program is unchanged

    retraces = []
    original = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(
        torch.export.ExportedProgram,
        "run_decompositions",
        lambda self, *args, **kwargs: retraces.append(1) or original(self, *args, **kwargs),
    )
    (got,) = run_onnx_program(to_onnx(program), inputs)
    assert retraces == []
    expected = (inputs["cache"] + inputs["x"]) * 2 + inputs["cache"]
    torch.testing.assert_close(torch.as_tensor(got), expected)

    intermediate = torch.export.export(_WritesAnIntermediate(), (), {"x": inputs["x"]})
    assert translatable_program(intermediate, registry) is not None
    (got,) = run_onnx_program(to_onnx(intermediate), {"x": inputs["x"]})
    torch.testing.assert_close(torch.as_tensor(got), inputs["x"] * 2 + 1)
    assert retraces == []

    # a write through a view is left to torch.onnx's own functionalisation (a retrace)
    view = torch.export.export(_WritesAView(), (), {"x": inputs["x"]})
    assert translatable_program(view, registry) is None
    (got,) = run_onnx_program(to_onnx(view), {"x": inputs["x"]})
    assert retraces == [1]
    expected = inputs["x"] * 2
    expected[:, 0] += 1
    torch.testing.assert_close(torch.as_tensor(got), expected)


class _MixesDtypes(torch.nn.Module):
    def forward(self, x, n):
        return (x + n) * 2 + torch.div(n, 3), n * 1.5


def test_type_promotion_reads_recorded_values_and_gives_torch_onnx_own_graph(monkeypatch):
    from hfexport.targets.onnx import lowering

    inputs = {"x": torch.randn(2, 3), "n": torch.arange(6).reshape(2, 3)}
    batch = torch.export.Dim("batch")
    program = torch.export.export(_MixesDtypes(), (), inputs, dynamic_shapes={"x": {0: batch}, "n": {0: batch}})
    runs = []
    original_run_node = torch.fx.Interpreter.run_node
    monkeypatch.setattr(
        torch.fx.Interpreter, "run_node", lambda self, node: runs.append(1) or original_run_node(self, node)
    )

    ours = lowering.to_onnx(program)
    ours_runs, runs[:] = len(runs), []
    original = lowering.patches_applied
    monkeypatch.setattr(
        lowering,
        "patches_applied",
        lambda names, scope=None: original([n for n in names if n != "onnx_type_promotion_from_metadata"], scope=scope),
    )
    torch_own = lowering.to_onnx(program)

    def op_types(onnx_program):
        return [node.op_type for node in onnx_program.model.graph]

    assert op_types(ours) == op_types(torch_own)
    assert op_types(ours).count("Cast") >= 2  # the int input promoted to float, the int division's result
    # torch's own pass runs every node again on fake tensors; ours only the inputs, the output and
    # the nodes it changed
    assert ours_runs < len(runs)
    expected = _MixesDtypes()(**inputs)
    for got, want in zip(lowering.run_onnx_program(ours, inputs), expected, strict=True):
        torch.testing.assert_close(torch.as_tensor(got), want)


def _decode_step_by_step(path, ids: torch.Tensor, pads: list[int]) -> torch.Tensor:
    """Logits of a plain ``session.run`` of a spec-form decode graph (cache of 16 slots) over
    ``ids`` [batch, 7], each row left-padded by ``pads``: the prompt, then one token a step, the
    returned cache fed back (GroupQueryAttention returns a new one without IO binding: zeros past
    the written slots)."""
    session = ort.InferenceSession(path)
    batch = ids.shape[0]
    caches = {
        i.name: np.zeros([batch, *i.shape[1:]], np.float32) if len(i.shape) == 4 else np.array(0, np.int64)
        for i in session.get_inputs()
        if i.name.startswith("input.cache.")
    }
    valid = torch.arange(16)[None, :] >= torch.tensor(pads)[:, None]  # [batch, slots]
    got = []
    for start, end in ((0, 5), (5, 6), (6, 7)):
        slots = torch.arange(start, end)
        mask = (torch.arange(16)[None, :] <= slots[:, None])[None] & valid[:, None, :]
        feeds = {
            "input_ids": ids[:, start:end].numpy(),
            "position_ids": (slots[None, :] - torch.tensor(pads)[:, None]).clamp(min=0).numpy(),
            "attention_mask": mask[:, None].numpy(),
            **caches,
        }
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
        caches = {name: outputs["output." + name.removeprefix("input.")] for name in caches}
        got.append(torch.from_numpy(outputs["logits"]))
    return torch.cat(got, 1)


def _tiny_llama_decode(passes=None):
    from transformers import GenerationConfig

    from hfexport import decompose_for_generation

    model = build("tiny-llama")
    static = GenerationConfig(cache_implementation="static", max_cache_len=16)
    module, kwargs = decompose_for_generation(model, sample_inputs(model, 1, 4), static, multi_token_decode=True)[
        "decode"
    ]
    return model, OnnxExporter().run(module, kwargs, OnnxConfig(dynamic=True, passes=passes))


def test_group_query_attention_decode_runs_without_io_binding_step_after_step(tmp_path):
    from hfexport.targets.onnx.lowering import save_onnx

    model, result = _tiny_llama_decode()
    assert collections.Counter(n.op_type for n in result.program.model.graph)["GroupQueryAttention"] == 2
    save_onnx(result.program, tmp_path / "decode.onnx")
    ids = sample_inputs(model, 1, 7, seed=3)["input_ids"]
    expected = eager(model, {"input_ids": ids}).logits
    torch.testing.assert_close(_decode_step_by_step(tmp_path / "decode.onnx", ids, [0]), expected, atol=1e-4, rtol=0)


def test_group_query_attention_reads_the_packed_projection_and_rotates_it_itself(tmp_path):
    # ONNX Runtime GenAI's builder's layout: GroupQueryAttention(qkv, do_rotary=1, cos / sin tables of
    # every slot, position_ids), no Split and RotaryEmbedding nodes before it; the same logits, a
    # left-padded row's positions included
    from hfexport.targets.onnx.lowering import save_onnx

    model, packed = _tiny_llama_decode()
    (record,) = [p for s in packed.records for p in s.children if p.name == "onnx_packed_attention_inputs"]
    # per layer: the qkv Split, two RotaryEmbedding; once, 14 nodes: the angles, the per-call cos /
    # sin rows and their index
    assert record.counts == {"packed_attention_inputs": 2, "nodes_removed": 2 * 3 + 14}
    graph = packed.program.model.graph
    ops = collections.Counter(node.op_type for node in graph)
    assert ops["RotaryEmbedding"] == ops["Cos"] == ops["Sin"] == ops["Split"] == 0  # gate and up apart
    for node in (n for n in graph if n.op_type == "GroupQueryAttention"):
        assert node.inputs[1] is None and node.inputs[2] is None and node.attributes["do_rotary"].value == 1
        assert node.inputs[9].name == "position_ids" and node.inputs[7].const_value.shape == (16, 8)
    save_onnx(packed.program, tmp_path / "packed.onnx")
    saved = onnx.load(tmp_path / "packed.onnx")
    norms = [n for n in saved.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(norms) == 4 and all(list(n.output)[1:3] == ["", ""] for n in norms)  # no statistics written

    passes = [p for p in get_target("onnx").default_passes if p != "onnx_packed_attention_inputs"]
    _, unpacked = _tiny_llama_decode(passes)
    assert collections.Counter(node.op_type for node in unpacked.program.model.graph)["RotaryEmbedding"] == 4
    save_onnx(unpacked.program, tmp_path / "unpacked.onnx")
    ids = sample_inputs(model, 2, 7, seed=3)["input_ids"]
    pads = [0, 3]
    logits = {name: _decode_step_by_step(tmp_path / f"{name}.onnx", ids, pads) for name in ("packed", "unpacked")}
    for row, pad in enumerate(pads):
        torch.testing.assert_close(logits["packed"][row, pad:], logits["unpacked"][row, pad:], atol=1e-5, rtol=0)
        expected = eager(model, {"input_ids": ids[row : row + 1, pad:]}).logits[0]
        torch.testing.assert_close(logits["packed"][row, pad:], expected, atol=1e-4, rtol=0)


def test_a_scalar_minus_a_mask_exports_when_torch_onnx_decomposes_the_program(tmp_path):
    # `1.0 - attention_mask` (XLNet, ProphetNet) in a program torch.onnx decomposes (one_hot has no
    # translation of its own): its decomposition made aten.sub.Tensor(1.0, mask) and failed
    class MaskedScores(torch.nn.Module):
        def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            inverted = 1.0 - attention_mask
            return torch.nn.functional.one_hot(ids, 7).float() * inverted[..., None]

    sample = {"ids": torch.tensor([[1, 5, 6], [0, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    OnnxExporter().export(MaskedScores(), sample, OnnxConfig(dynamic=True)).save(tmp_path / "model.onnx")
    runner = OnnxRunner(tmp_path / "model.onnx")
    other = {"ids": torch.randint(0, 7, (3, 5)), "attention_mask": torch.randint(0, 2, (3, 5))}
    for inputs in (sample, other):
        got = torch.from_numpy(next(iter(runner.run_dict(inputs).values())))
        assert torch.equal(got, MaskedScores()(**inputs))


def test_constant_int_outputs_are_left_out_of_the_graph(tmp_path):
    # MaskFormer-Swin returns its stages' feature-map sizes as ints, fixed at export; torch.onnx
    # left a None output out but failed on an int ("'int' object has no attribute 'name'")
    class WithSizes(torch.nn.Module):
        def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], None]:
            return pixels.mean(1), (4, 4), None

    sample = {"pixels": torch.randn(2, 3, 4, 4)}
    save_export(tmp_path, {"model": OnnxExporter().run(WithSizes(), sample, OnnxConfig(dynamic=True))})
    runner = ExportFolder(tmp_path).runner()
    other = {"pixels": torch.randn(3, 3, 4, 4)}
    for inputs in (sample, other):
        (got,) = runner.run(inputs)
        torch.testing.assert_close(torch.as_tensor(got), inputs["pixels"].mean(1), atol=1e-6, rtol=0)


def test_the_optimizer_keeps_small_epsilons_and_drops_exact_no_ops(tmp_path):
    # onnxscript's no-op rules matched constants within 1e-8 of 0: `sum + 1e-15` (a router's guard
    # against dividing by zero) and `mean + 1e-8` (an RMS norm's epsilon) were dropped, and an
    # all-zero row became NaN (MuseSpark: 1.52 away from eager, nothing said)
    class SmallEpsilons(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            shifted = (x + 0) * 1  # exact no-ops: still removed
            norm = shifted / (shifted.pow(2).mean(-1, keepdim=True) + 1e-8).sqrt()
            return norm, x.abs() / (x.abs().sum(-1, keepdim=True) + 1e-15)

    x = torch.randn(2, 3, 4)
    x[0, 1] = 0
    program = OnnxExporter().export(SmallEpsilons(), {"x": x}, OnnxConfig(dynamic=True))
    ops = collections.Counter(node.op_type for node in program.model.graph)
    assert ops["Add"] == 2 and ops["Mul"] == 0, ops
    program.save(tmp_path / "model.onnx")
    got = OnnxRunner(tmp_path / "model.onnx").run({"x": x})
    for value, expected in zip(got, SmallEpsilons()(x), strict=True):
        torch.testing.assert_close(torch.as_tensor(value), expected, atol=1e-5, rtol=0)


def test_a_split_by_a_size_known_at_run_time_survives_the_optimizer(tmp_path):
    # ProphetNet splits its n-gram streams by the sequence length: a SplitToSequence whose split is
    # a scalar computed at run time, which onnxscript's constant folding failed on ("'NoneType'
    # object has no attribute 'ndim'"), stopping the optimizer and the export
    class Streams(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            streams = torch.cat([x, 2 * x, 3 * x], dim=1).split(x.shape[1], dim=1)
            return streams[0] + streams[1] * streams[2]

    sample = {"x": torch.randn(2, 5, 4)}
    OnnxExporter().export(Streams(), sample, OnnxConfig(dynamic=True)).save(tmp_path / "model.onnx")
    runner = OnnxRunner(tmp_path / "model.onnx")
    for inputs in (sample, {"x": torch.randn(3, 7, 4)}):
        (got,) = runner.run(inputs)
        torch.testing.assert_close(torch.as_tensor(got), Streams()(**inputs), atol=1e-5, rtol=0)


@register_pass(name="explode_on_onnx_test", stage="onnx_passes")
def _explode_on_onnx(program):
    """Fails on purpose, naming what it read of the ONNX model (test)."""
    graph = program.model.graph
    raise RuntimeError(f"boom on {sum(1 for _ in graph)} nodes reading {', '.join(v.name for v in graph.inputs)}")


def test_a_failing_onnx_pass_replays_with_the_command_its_reproducer_prints(tmp_path, capsys):
    model = build("tiny-llama")
    config = OnnxConfig(dump_dir=str(tmp_path / "dump"), passes="onnx_optimizer,explode_on_onnx_test")
    with pytest.raises(PassError) as in_pipeline:
        OnnxExporter().export(model, sample_inputs(model), config)
    error = in_pipeline.value
    assert (error.pass_name, error.passes_before) == ("explode_on_onnx_test", ("onnx_optimizer",))
    assert error.cause.startswith("RuntimeError: boom on ") and "reading input_ids, attention_mask" in error.cause
    folder = tmp_path / "dump" / "03_onnx_passes" / "01_explode_on_onnx_test"
    comment, command = (folder / "repro.txt").read_text().splitlines()
    assert comment.startswith("# 'explode_on_onnx_test' is not one of hfexport's passes: --import loads")
    repro = shlex.split(command)
    assert repro[:5] == ["hfexport", "replay", "--import", __file__, str(folder / "input.onnx")]
    assert any(command in note for note in error.__notes__)

    # the printed command, as given: the same PassError (same pass, passes before it, cause)
    capsys.readouterr()
    assert main(repro[1:]) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"hfexport: error: {error}"
    with pytest.raises(PassError) as replayed:
        program = get_target("onnx").load_program(folder / "input.onnx")
        PassManager(["explode_on_onnx_test"]).run(program, ["onnx_optimizer"])
    assert (replayed.value.pass_name, replayed.value.passes_before, replayed.value.cause) == (
        error.pass_name,
        error.passes_before,
        error.cause,
    )

    # a pass that works writes an .onnx that ONNX Runtime runs as the export would have
    out = tmp_path / "fused.onnx"
    assert main(["replay", str(folder / "input.onnx"), "--passes", "onnx_ort_fusions", "--out", str(out)]) == 0
    assert "onnx_ort_fusions: modified=True" in capsys.readouterr().err
    fused = collections.Counter(node.op_type for node in __import__("onnx").load(out).graph.node)
    assert fused["SkipSimplifiedLayerNormalization"] > 0
    session = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    inputs = sample_inputs(model)
    logits = session.run(None, {name: inputs[name].numpy() for name in ("input_ids", "attention_mask")})[0]
    np.testing.assert_allclose(logits, main_output(eager(model, inputs)).numpy(), atol=1e-4)
    assert main(["replay", str(folder / "input.onnx"), "--passes", "onnx_ort_fusions", "--out", "x.pt2"]) == 2
    assert "saved as a .onnx file" in capsys.readouterr().err
