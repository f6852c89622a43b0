"""Quantization passes (ONNX Runtime's quantizers on ONNX, torchao's 8da4w / 8da8w patterns for
ExecuTorch): what they quantize, the numerics check that replaces max abs diff after them, and the
config / command-line switch."""

import numpy as np
import pytest
import torch
from models import build, eager, sample_inputs

from hfexport import (
    ConfigError,
    ExecutorchConfig,
    ExecutorchExporter,
    ExportFolder,
    OnnxConfig,
    OnnxExporter,
    Pass,
    PassResult,
    VerificationError,
    save_export,
)
from hfexport.pipeline.numerics import QUANTIZED_WEIGHTS

# tiny-llama: 2 layers x (q, k, v, o, gate, up, down) + lm_head
LINEAR_LAYERS = 15


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a).flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize(
    ("mode", "op", "min_cosine"), [("int4", "MatMulNBits", 0.98), ("int8", "MatMulInteger", 0.999)]
)
def test_onnx_quantization_pass_quantizes_every_linear_layer(mode, op, min_cosine, tmp_path):
    model = build("tiny-llama")
    result = OnnxExporter().run(model, sample_inputs(model), OnnxConfig(dynamic=True, verify=True, quantize=mode))
    (record,) = [p for s in result.records for p in s.children if p.name.startswith("onnx_int")]
    # onnx_packed_projections ran before: per layer q k v, o, gate, up, down, and the lm_head
    assert record.counts[QUANTIZED_WEIGHTS] == 2 * 5 + 1
    assert record.counts["weight_kib_after"] < record.counts["weight_kib_before"]
    histogram = {node.op_type for node in result.program.model.graph}
    assert op in histogram
    if mode == "int4":
        # the logits' MatMul keeps 8 bits; the packed q k v weights are one MatMulNBits, split
        # after it; every input quantized to int8 on the fly, no float minimums
        graph = result.program.model.graph
        levels = [
            (n.attributes["bits"].as_int(), n.attributes["accuracy_level"].as_int()) for n in graph if n.op_type == op
        ]
        assert levels == [(4, 4)] * (2 * 5) + [(8, 4)] and record.counts["int8_weights_kept"] == 1
        splits = [len(node.outputs) for node in graph if node.op_type == "Split"]
        assert sorted(splits) == [3, 3] and "float_input_weights" not in record.counts
        assert not [node for node in graph if node.op_type == "MatMul" and node.inputs[1].const_value is not None]
    # verify checked the logits by cosine similarity, and the report says what it measured
    assert "quantized: logit cosine" in result.report and "top-1 agreement" in result.report
    save_export(tmp_path, {"model": result})
    inputs = sample_inputs(model, 3, 11, seed=3)  # another shape through the saved artifact
    assert cosine(ExportFolder(tmp_path).runner().run(inputs)[0], eager(model, inputs).logits) >= min_cosine


@pytest.mark.parametrize(("mode", "op"), [("int4", "MatMulNBits"), ("int8", "MatMulInteger")])
def test_a_weight_read_through_a_transpose_is_quantized_too(mode, op):
    # without the optimizer every linear reads its weight through a Transpose, and a tied output
    # projection always does (SmolLM2's table is too large for the optimizer to fold a transposed
    # copy): each gets its own transposed weight, so the quantizer takes it
    model = build("tiny-llama", tie_word_embeddings=True)
    config = OnnxConfig(dynamic=True, verify=True, quantize=mode, optimize=False)
    result = OnnxExporter().run(model, sample_inputs(model), config)
    (record,) = [p for s in result.records for p in s.children if p.name.startswith("onnx_int")]
    assert record.counts[QUANTIZED_WEIGHTS] == LINEAR_LAYERS == record.counts["untied_weights"]
    graph = result.program.model.graph
    weights = [
        node.inputs[1].name for node in graph if node.op_type == "MatMul" and node.inputs[1].const_value is not None
    ]
    plain = [name for name in weights if not name.endswith("_minimums") and not name.startswith("block_sums")]
    assert plain == [] and sum(node.op_type == op for node in graph) == LINEAR_LAYERS
    assert "quantized: logit cosine" in result.report


def on_a_4bit_lattice(weight: torch.Tensor) -> torch.Tensor:
    """Each 32 inputs of each output at ``minimum + step * q``, q in 0..15: a Q4_1 GGUF tensor."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    return (low + step * torch.round((groups - low) / step)).reshape(weight.shape)


@pytest.mark.parametrize(("minimums", "error_range"), [(True, (0, 1e-4)), (False, (1e-2, 10))])
def test_int4_blocks_hold_weights_already_on_a_4bit_lattice_exactly(minimums, error_range, tmp_path):
    # a GGUF Q4_1 checkpoint: float minimums hold it as it is, where ONNX Runtime's own blocks
    # round each minimum to an integer zero point (SmolLM2's teacher-forced top-1: 81% → 95%)
    from hfexport.exporters import OnnxExporter as Exporter
    from hfexport.targets.onnx.passes.quantize import OnnxInt4Weights

    model = build("tiny-llama")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(on_a_4bit_lattice(module.weight))
    # fp32 compute (accuracy level 1) and every weight in 4 bits: the weights' error alone
    quantize = OnnxInt4Weights(group_size=32, accuracy_level=1, minimums=minimums, int8_output=False)  # Q4_1's
    inputs = sample_inputs(model)
    result = OnnxExporter().run(model, inputs, OnnxConfig(passes=[*Exporter().target.default_passes, quantize]))
    save_export(tmp_path, {"model": result})
    logits = torch.as_tensor(ExportFolder(tmp_path).runner().run(inputs)[0])
    error = float((logits - eager(model, inputs).logits).abs().max())
    assert error_range[0] <= error < error_range[1], error


def test_a_tied_output_projection_goes_to_4_bits_with_its_top_logits_recomputed_from_the_fp32_table(tmp_path):
    # weights on a 4-bit lattice and fp32 compute: every 4-bit block with minimums is exact, so the
    # only error left is the output projection's symmetric 4 bits, which rescoring removes from
    # the top logits at each position
    from hfexport.exporters import OnnxExporter as Exporter
    from hfexport.targets.onnx.passes.quantize import OnnxInt4Weights

    model = build("tiny-llama", tie_word_embeddings=True)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not model.lm_head.weight:
                module.weight.copy_(on_a_4bit_lattice(module.weight))
    inputs = sample_inputs(model)
    reference = eager(model, inputs).logits
    errors = {}
    for top in (8, 0):
        quantize = OnnxInt4Weights(group_size=32, accuracy_level=1, minimums=True, int8_output=False, rescore_top=top)
        result = OnnxExporter().run(model, inputs, OnnxConfig(passes=[*Exporter().target.default_passes, quantize]))
        (record,) = [p for s in result.records for p in s.children if p.name == "onnx_int4_weights"]
        ops = [node.op_type for node in result.program.model.graph]
        assert (ops.count("TopK"), ops.count("ScatterElements"), record.counts.get("rescored_outputs", 0)) == (
            (1, 1, 1) if top else (0, 0, 0)
        )
        folder = tmp_path / str(top)
        save_export(folder, {"model": result})
        logits = torch.as_tensor(ExportFolder(folder).runner().run(inputs)[0])
        index = reference.topk(4, dim=-1).indices  # eager's best four at each position
        errors[top] = float((logits.gather(-1, index) - reference.gather(-1, index)).abs().max())
    assert errors[8] < 1e-4 < 1e-2 < errors[0], errors


def test_8da4w_rescores_a_tied_output_projection_in_4_bits_and_leaves_the_other_logits_as_they_were():
    from hfexport import DynamoConfig, DynamoExporter
    from hfexport.passes.quantize import Int4WeightsInt8Activations

    model = build("tiny-llama", tie_word_embeddings=True)
    inputs = sample_inputs(model, 3, 11, seed=3)
    logits = {}
    for top in (8, 0):
        passes = [
            *DynamoExporter().target.default_passes,
            Int4WeightsInt8Activations(int8_output=False, rescore_top=top),
        ]
        program = DynamoExporter().export(model, sample_inputs(model), DynamoConfig(dynamic=True, passes=passes))
        targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert (targets.count("aten.topk.default"), targets.count("aten.scatter.src")) == ((1, 1) if top else (0, 0))
        assert int(program.constants["lm_head.weight_qdata"].abs().max()) <= 8  # 4 bits
        with torch.no_grad():
            logits[top] = program.module()(**inputs).logits
    # the same 4-bit logits except the eight best at each position, which the fp32 table recomputed
    changed = (logits[8] != logits[0]).sum(-1)
    assert int(changed.max()) <= 8 and int(changed.min()) >= 1
    assert cosine(logits[8], eager(model, inputs).logits) >= 0.98


def test_8da4w_with_minimums_adds_an_offset_per_weight_and_keeps_only_the_output_projection_at_8_bits():
    from collections import Counter

    from hfexport import DynamoConfig, DynamoExporter
    from hfexport.passes.quantize import Int4WeightsInt8Activations

    model = build("tiny-llama")
    passes = [*DynamoExporter().target.default_passes, Int4WeightsInt8Activations(minimums=True)]
    program = DynamoExporter().export(model, sample_inputs(model), DynamoConfig(dynamic=True, passes=passes))
    ops = Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")
    # a linear per 4-bit weight for its minimums, one per input the 4-bit weights read for its block sums
    assert ops["aten.linear.default"] == LINEAR_LAYERS + (LINEAR_LAYERS - 1) + 2 * 4
    wide = {k for k, t in program.constants.items() if k.endswith("_qdata") and int(t.abs().max()) > 8}
    assert wide == {"lm_head.weight_qdata"}
    assert len([key for key in program.constants if key.endswith("_minimums")]) == LINEAR_LAYERS - 1
    inputs = sample_inputs(model, 3, 11, seed=3)
    assert cosine(program.module()(**inputs).logits, eager(model, inputs).logits) >= 0.98


def test_8da4w_groups_with_minimums_hold_a_4bit_lattice_exactly():
    # XNNPACK's symmetric groups (values -8..7) plus the per-group offset the pass adds as a linear
    from hfexport.passes.quantize import minimum_groups

    weight = on_a_4bit_lattice(torch.randn(24, 96, generator=torch.Generator().manual_seed(0)))
    values, scale, offsets = minimum_groups(weight, 32)
    assert values.dtype == torch.int8 and int(values.min()) >= -8 and int(values.max()) <= 7
    rebuilt = (values.reshape(24, 3, 32) * scale[..., None] + offsets[..., None]).reshape(24, 96)
    torch.testing.assert_close(rebuilt, weight, atol=1e-6, rtol=0)


class ZeroWeights(Pass):
    """A broken 'quantization': every weight matrix becomes zeros."""

    name = "zero_weights"
    stage = "onnx_passes"
    runs_after = ("onnx_optimizer",)

    def __call__(self, program):
        import onnx_ir as ir

        zeroed = 0
        for value in program.model.graph.initializers.values():
            if value.const_value is not None and len(value.shape) == 2:
                value.const_value = ir.tensor(np.zeros(value.shape.numpy(), dtype=np.float32))
                zeroed += 1
        return PassResult(program, modified=True, counts={QUANTIZED_WEIGHTS: zeroed})


def test_a_quantization_that_breaks_the_logits_is_caught_by_cosine_similarity():
    from hfexport.exporters import OnnxExporter as Exporter

    model = build("tiny-llama")
    passes = [*Exporter().target.default_passes, ZeroWeights()]
    with pytest.raises(VerificationError, match=r"cosine similarity .* with eager PyTorch \(at least 0.98"):
        OnnxExporter().export(model, sample_inputs(model), OnnxConfig(verify=True, passes=passes))


def test_quantize_modes_and_group_sizes_are_checked_when_the_config_is_built():
    with pytest.raises(ConfigError, match="quantize must be None, 'int4' or 'int8', got 'int3'"):
        OnnxConfig(quantize="int3")
    # named by the config's own field, before a checkpoint is loaded
    with pytest.raises(ConfigError, match="OnnxConfig quantize_group_size must be a power of two .* got 48"):
        OnnxConfig(quantize="int4", quantize_group_size=48)
    model = build("tiny-llama")
    with pytest.raises(ConfigError, match="group_size must be a power of two"):
        OnnxExporter().export(model, sample_inputs(model), OnnxConfig(quantize="int4", quantize_group_size=24))
    from hfexport.passes.quantize import Int4WeightsInt8Activations
    from hfexport.targets.onnx.passes.quantize import OnnxInt4Weights

    for quantization in (OnnxInt4Weights, Int4WeightsInt8Activations):
        with pytest.raises(ConfigError, match="rescore_top must be a whole number .* got -1"):
            quantization(rescore_top=-1)
    with pytest.raises(ConfigError, match="float_tail must be a fraction of the linear layers from 0 to 1, got 8"):
        OnnxInt4Weights(float_tail=8)


@pytest.mark.parametrize("minimums", [True, False])
def test_int4_keeps_the_inputs_of_the_layers_nearest_the_logits_in_fp32(minimums):
    # 4 layers x 5 4-bit MatMuls (q k v packed; gate and up too with minimums, which packs its own
    # blocks): float_tail 1/4 is the last layer
    from hfexport.exporters import OnnxExporter as Exporter
    from hfexport.targets.onnx.passes.quantize import OnnxInt4Weights

    model = build("tiny-llama", num_hidden_layers=4)
    inputs = sample_inputs(model)
    levels = {}
    for tail in (1 / 4, 1 / 8, 0):
        # the output projection: 8 bits; the attention projections' inputs int8 here, as the rest
        quantize = OnnxInt4Weights(minimums=minimums, float_tail=tail, float_attention=False)
        result = OnnxExporter().run(model, inputs, OnnxConfig(passes=[*Exporter().target.default_passes, quantize]))
        graph = result.program.model.graph
        nodes = [node for node in graph if node.op_type == "MatMulNBits" and node.attributes["bits"].as_int() == 4]
        levels[tail] = [node.attributes["accuracy_level"].as_int() for node in nodes]
        (record,) = [p for s in result.records for p in s.children if p.name == "onnx_int4_weights"]
        assert record.counts.get("float_input_weights", 0) == {1 / 4: 5, 1 / 8: 2, 0: 0}[tail]
    per_layer = 4 if minimums else 5  # nodes: q k v (packed), o, gate, up, down
    assert levels[1 / 4] == [4] * 3 * per_layer + [1] * per_layer
    # the last 2 nodes: up (gate up with minimums) and down
    assert levels[1 / 8] == [4] * (4 * per_layer - 2) + [1] * 2
    assert levels[0] == [4] * 4 * per_layer


@pytest.mark.parametrize("minimums", [True, False])
def test_int4_keeps_the_attention_projections_inputs_in_fp32(minimums):
    # the linear layers torch.onnx records inside LlamaAttention (q, k, v, o) take fp32 inputs,
    # the MLP's int8; float_attention=False gives them int8 too
    from hfexport.exporters import OnnxExporter as Exporter
    from hfexport.targets.onnx.passes.quantize import OnnxInt4Weights

    model = build("tiny-llama", num_hidden_layers=3)
    inputs = sample_inputs(model)
    per_weight = {}
    for attention in (True, False):
        quantize = OnnxInt4Weights(minimums=minimums, float_tail=0, float_attention=attention)
        result = OnnxExporter().run(
            model, inputs, OnnxConfig(verify=True, passes=[*Exporter().target.default_passes, quantize])
        )
        graph = result.program.model.graph
        nodes = [node for node in graph if node.op_type == "MatMulNBits" and node.attributes["bits"].as_int() == 4]
        per_weight[attention] = [node.attributes["accuracy_level"].as_int() for node in nodes]
        (record,) = [p for s in result.records for p in s.children if p.name == "onnx_int4_weights"]
        assert record.counts.get("float_input_weights", 0) == (3 * 2 if attention else 0)
    layer = [1, 1, 4, 4] if minimums else [1, 1, 4, 4, 4]  # q k v (packed), o, gate, up (packed: minimums), down
    assert per_weight[True] == layer * 3
    assert per_weight[False] == [4] * len(layer) * 3


def test_cli_quantize_flag(tmp_path):
    from hfexport.cli import main

    assert main(["export", "tiny-llama", "--format", "onnx", "--quantize", "int4", "--out", str(tmp_path)]) == 0
    import onnx

    nodes = onnx.load(tmp_path / "model.onnx").graph.node
    assert "MatMulNBits" in {node.op_type for node in nodes}
    # the default blocks (64: SmolLM2 in og.Generator, benchmarks/results/runtime-loops), the 8-bit output
    # projection's in GGUF Q8_0's 32
    blocks = {
        (attributes["bits"], attributes["block_size"])
        for attributes in (
            {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            for node in nodes
            if node.op_type == "MatMulNBits"
        )
    }
    assert blocks == {(4, 64), (8, 32)}, blocks


# the .pte against the fp32 weights alone (the fp32 .pte is 416 KiB for 353 KiB of weights)
# 8da8w lowers the same pattern with int8 weights: make test-all
@pytest.mark.parametrize(
    ("mode", "min_cosine", "size_ratio"),
    [("8da4w", 0.98, 0.45), pytest.param("8da8w", 0.999, 0.6, marks=pytest.mark.slow)],
)
def test_executorch_quantization_pass_delegates_every_linear_layer_as_quantized(mode, min_cosine, size_ratio, tmp_path):
    model = build("tiny-llama")
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fp32_kib = sum(t.numel() * t.element_size() for t in weights.values()) / 2**10
    result = ExecutorchExporter().run(
        model, sample_inputs(model), ExecutorchConfig(dynamic=True, verify=True, quantize=mode)
    )
    (record,) = [p for s in result.records for p in s.children if p.name.endswith("_int8_activations")]
    assert record.counts[QUANTIZED_WEIGHTS] == LINEAR_LAYERS == record.counts["quantized_linears"]
    assert record.counts["weight_kib_after"] < record.counts["weight_kib_before"] / 2.5
    # every quantize / dequantize went to XNNPACK: none is left for the portable kernels
    edge = result.program.exported_program()
    assert not [n for n in edge.graph.nodes if "quantize" in str(n.target) or "qparams" in str(n.target)]
    assert "quantized: logit cosine" in result.report and "top-1 agreement" in result.report
    save_export(tmp_path, {"model": result})
    assert (tmp_path / "model.pte").stat().st_size / 2**10 < fp32_kib * size_ratio
    inputs = sample_inputs(model, 3, 11, seed=3)
    assert cosine(ExportFolder(tmp_path).runner().run(inputs)[0], eager(model, inputs).logits) >= min_cosine
    # quantizing the program left the user's model alone
    assert all(torch.equal(weights[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize(
    ("name", "tied"),
    [
        ("int4_weights_int8_activations", False),
        ("int8_weights_int8_activations", False),
        ("int4_weights_int8_activations", True),
    ],
)
def test_torchao_quantization_pass_replaces_fp32_linear_weights(name, tied):
    from collections import Counter

    from hfexport import DynamoConfig, DynamoExporter

    # tied: the output projection shares the embedding table (SmolLM2), which stays fp32
    model = build("tiny-llama", tie_word_embeddings=tied)
    passes = [*DynamoExporter().target.default_passes, name]
    program = DynamoExporter().export(model, sample_inputs(model), DynamoConfig(dynamic=True, passes=passes))
    ops = Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")
    assert ops["torchao.choose_qparams_affine.default"] == LINEAR_LAYERS
    assert ops["torchao.dequantize_affine.default"] == 2 * LINEAR_LAYERS  # input and weight of each
    assert ops["aten.linear.default"] == LINEAR_LAYERS
    # the fp32 linear weights are gone: the embedding table stays (a 2-D float weight), norms too
    kept = {key for key, t in program.state_dict.items() if t.dim() == 2 and t.is_floating_point()}
    # (a tied table is listed under both names)
    assert kept == {"model.embed_tokens.weight", *(["lm_head.weight"] if tied else [])}
    int8 = [key for key, t in program.constants.items() if key.endswith("_qdata")]
    assert len(int8) == LINEAR_LAYERS and all(program.constants[k].dtype == torch.int8 for k in int8)
    if name.startswith("int4"):
        # 4-bit values, except an output projection not tied to the embedding: int8 per channel (a
        # tied one is rescored from the fp32 table)
        wide = {k for k in int8 if int(program.constants[k].abs().max()) > 8}
        assert wide == (set() if tied else {"lm_head.weight_qdata"})
        assert ops["aten.topk.default"] == ops["aten.scatter.src"] == int(tied)
        assert all(
            int(program.constants[k].min()) >= -8 and int(program.constants[k].max()) <= 7 for k in set(int8) - wide
        )
    inputs = sample_inputs(model, 3, 11, seed=3)  # the program runs eagerly too, at another shape
    assert cosine(program.module()(**inputs).logits, eager(model, inputs).logits) >= 0.98


def test_executorch_quantize_modes_are_checked_when_the_config_is_built():
    with pytest.raises(ConfigError, match="quantize must be None, '8da4w' .* got 'int3'"):
        ExecutorchConfig(quantize="int3")
    with pytest.raises(ConfigError, match="quantize_group_size must be a multiple of 32 .* got 16"):
        ExecutorchConfig(quantize="8da4w", quantize_group_size=16)
    assert ExecutorchExporter().pass_list(ExecutorchConfig(quantize="int4"))[-1].name == "int4_weights_int8_activations"
    assert (
        ExecutorchExporter().pass_list(ExecutorchConfig(quantize="8da8w"))[-1].name == "int8_weights_int8_activations"
    )


def test_a_weight_shared_by_two_layers_is_quantized_once_and_runs_on_executorch():
    from hfexport.targets.executorch.lowering import run_pte

    class Shared(torch.nn.Module):  # ALBERT-style: one linear layer applied twice
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.proj(torch.cumsum(self.proj(x), -1))  # cumsum: not XNNPACK, two delegates

    model, x = Shared().eval(), torch.randn(2, 3, 64)
    result = ExecutorchExporter().run(model, {"x": x}, ExecutorchConfig(quantize="8da4w"))
    (record,) = [p for s in result.records for p in s.children if p.name == "int4_weights_int8_activations"]
    assert record.counts[QUANTIZED_WEIGHTS] == 1 and record.counts["quantized_linears"] == 2
    assert cosine(run_pte(result.program, {"x": x})[0], model(x).detach()) >= 0.98


def test_int4_quantizes_a_weight_at_a_time_without_a_protobuf_copy_of_the_model(monkeypatch):
    # serialising the model to protobuf for ONNX Runtime's quantizer copied every weight: a
    # Llama-3.2-1B-shaped int4 export peaked at 20.4 GB (6.3 GB without)
    from hfexport.targets.onnx.passes import quantize

    def refused(program):
        raise AssertionError("the int4 pass serialised the whole model")

    monkeypatch.setattr(quantize, "_proto", refused)
    model = build("tiny-llama", tie_word_embeddings=True)
    inputs = sample_inputs(model)
    result = OnnxExporter().run(model, inputs, OnnxConfig(quantize="int4", verify=True))
    (record,) = [p for s in result.records for p in s.children if p.name == "onnx_int4_weights"]
    assert record.counts["rescored_outputs"] == 1  # the tied output projection, 4 bits, its top logits exact
    assert "quantized: logit cosine" in result.report


@pytest.mark.parametrize(
    ("mode", "algorithm", "dtype", "group_size"),
    [("8da4w", "hqq", torch.int4, 32), ("8da4w", "affine", torch.int4, 32), ("8da8w", "affine", torch.int8, None)],
)
def test_torchao_weights_are_quantized_a_few_rows_at_a_time_with_the_whole_matrix_s_values(
    mode, algorithm, dtype, group_size, monkeypatch
):
    """The 8da4w / 8da8w weights are quantized in slices of rows, which kept torchao's HQQ copies of
    a large table (a 128256-row embedding) in cache and out of the peak: each group is one row's, so
    the values, scales and zero points are those of the whole matrix at once (a last slice shorter)."""
    from hfexport.passes import quantize
    from hfexport.passes.quantize import Int4WeightsInt8Activations, Int8WeightsInt8Activations

    pass_ = Int4WeightsInt8Activations(algorithm=algorithm) if mode == "8da4w" else Int8WeightsInt8Activations()
    weight = torch.randn(203, 256) * 0.02
    monkeypatch.setattr(quantize, "QUANTIZE_CHUNK_ELEMENTS", 1 << 40)
    whole = pass_._quantized(weight, dtype, group_size)
    monkeypatch.setattr(quantize, "QUANTIZE_CHUNK_ELEMENTS", 10 * 256)
    sliced = pass_._quantized(weight, dtype, group_size)
    assert whole[0].shape == weight.shape and whole[0].dtype == torch.int8
    for a, b in zip(whole[:3], sliced[:3], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
    assert whole[3:] == sliced[3:]


@pytest.mark.parametrize(
    ("rows", "columns", "group_size", "dtype", "scale"),
    [(64, 2048, 32, torch.int4, 0.02), (8, 256, 256, torch.int8, 0.02), (40, 512, 64, torch.int4, 3.0)],
)
def test_hqq_scales_are_torchaos_bit_for_bit(rows, columns, group_size, dtype, scale):
    """``hqq_scale_only`` leaves a group out of its iterations once the group's scale stops
    changing; its values and scales are still exactly torchao's, for groups that move for many
    passes, groups of zeros (no scale to solve for) and groups already on a 4-bit lattice (a fixed
    point from the start), and with torchao's early stop (a slice where every group is fixed)."""
    from torchao.quantization import quant_primitives
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    from hfexport.passes.quantize import hqq_scale_only

    torch.manual_seed(0)
    weight = torch.randn(rows, columns) * scale
    weight[1] = 0
    lattice = torch.randint(-8, 8, (columns,)).float()
    lattice[::group_size] = -8  # each group's largest magnitude: its first scale is the one it is made with
    weight[2] = lattice * 0.01
    qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[dtype]
    for part in (weight, weight[1:3]):  # [1:3]: every group fixed at once, torchao stops early
        values, scales = hqq_scale_only(part, group_size, qmin, qmax)
        want_values, want_scales = quant_primitives._choose_qparams_and_quantize_scale_only_hqq(
            part, [1, group_size], qmin, qmax
        )
        assert values.dtype == torch.int8 and scales.dtype == torch.float32
        assert torch.equal(values, want_values.to(torch.int8)) and torch.equal(scales, want_scales)
    if dtype == torch.int4:  # on its own lattice: the values it was made of
        assert torch.equal(values[1], lattice.to(torch.int8))


def test_the_fp32_weights_a_quantization_pass_replaced_are_freed_when_the_caller_is_done_with_the_model():
    """In a ``disposable_weights`` block (the command line's, over the model it loaded), the pass
    stage frees each private parameter the program no longer holds: the linear weights 8da4w
    replaced, which a Llama-3.2-3B-shaped export held (12 GB) to the end. The program is the same
    byte for byte; the embedding table it still reads is whole; a user's model (not private), a
    capture two targets share and a component before the last free nothing."""
    from transformers import GenerationConfig

    from hfexport import DynamoConfig
    from hfexport.exporters import run_for_generation, run_targets
    from hfexport.pipeline.pass_manager import disposable_weights, private_weights

    static = GenerationConfig(cache_implementation="static", max_cache_len=32)
    prompt = sample_inputs(build("tiny-llama"), 1, 6)

    def export(model):
        config = ExecutorchConfig(dynamic=True, quantize="8da4w", llm_runner=True)
        return run_for_generation(model, prompt, [config], static, multi_token_decode=True)["decode"]["executorch"]

    kept = build("tiny-llama")
    with disposable_weights(kept):  # not private: the user's
        reference = export(kept)
    assert all(p.untyped_storage().nbytes() for p in kept.parameters())
    assert "model_weights_freed_mib" not in reference.record("int4_weights_int8_activations").counts

    model = private_weights(build("tiny-llama"))
    with disposable_weights(model):
        freed = export(model)
    assert freed.record("int4_weights_int8_activations").counts["model_weights_freed_mib"] > 0
    emptied = {name for name, p in model.named_parameters() if not p.untyped_storage().nbytes()}
    linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert emptied == linears - tied  # the embedding table (and an output projection tied to it) is read
    assert model.model.embed_tokens.weight.untyped_storage().nbytes()
    assert freed.program.buffer == reference.program.buffer

    shared = private_weights(build("tiny-llama"))
    inputs = sample_inputs(shared, 1, 6)
    configs = [DynamoConfig(dynamic=True), ExecutorchConfig(dynamic=True, quantize="8da4w")]
    with disposable_weights(shared):
        run_targets(shared, inputs, configs)
    assert all(p.untyped_storage().nbytes() for p in shared.parameters())


def test_a_runtime_interface_refused_after_the_weights_were_freed_falls_back_on_a_reloaded_model(
    tmp_path, monkeypatch, capsys
):
    """The command line falls back to hfexport's own interface when the runtime's cannot express
    a model; a refusal after the pass stage (the LLM runner's interface is its own stage) comes
    after the quantized layers' fp32 weights were freed, so the second export loads the model again."""
    from hfexport.cli import main
    from hfexport.targets.executorch import llm_runner

    def refuse(program, run):
        raise llm_runner._refuse("it is refused by this test")

    monkeypatch.setattr(llm_runner, "llm_runner_io", refuse)
    build("tiny-llama").save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "out"
    argv = ["export", str(tmp_path / "ckpt"), "--format", "executorch", "--generation", "--quantize", "8da4w"]
    assert main([*argv, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "it is refused by this test: exporting hfexport's own interface instead" in err
    assert err.count("loading ") == 2
    assert ExportFolder(out).manifest.component("decode").interface != "executorch-llm-runner"
