"""Every precision on every target: bfloat16 and float16 models exported for generation decode
eager's greedy tokens in that dtype (ONNX, whose CPU runtime has no bfloat16, in float32 from a
bfloat16 model), single-graph bfloat16 exports verify, and the ``dtype`` config field."""

import copy
import hashlib
import logging
import os
import subprocess
import sys

import pytest
import torch
from executorch.exir._serialize._program import deserialize_pte_binary
from models import build, sample_inputs
from transformers import GenerationConfig

from hfexport import (
    ConfigError,
    DynamoConfig,
    ExecutorchConfig,
    ExportFolder,
    OnnxConfig,
    run_for_generation,
    run_targets,
    save_export,
)
from hfexport.generation import greedy_decode
from hfexport.precision import converted_model

STATIC = GenerationConfig(cache_implementation="static", max_cache_len=32)
TARGETS = ("dynamo", "onnx", "executorch")
NEW_TOKENS = 16


def eager_tokens(model, prompt):
    with torch.no_grad():
        return model.generate(**prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_llama_generates_eagers_tokens_on_every_target(dtype, tmp_path, hfexport_logs):
    """One ``run_for_generation`` per dtype, verified stage by stage, every target's decode loop
    against ``model.generate`` in the dtype its program runs in: bfloat16 on Dynamo and ExecuTorch
    (before the planning fix, ExecuTorch's state cache read through a reshape gave all-zero logits:
    token 0 forever), float32 on ONNX (auto; one warning says so); float16 everywhere, with ONNX
    Runtime's rotary and grouped-query-attention fusions applied in float16."""
    model = build("tiny-llama").to(dtype)
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    prompt = sample_inputs(model, 1, 6)
    configs = [DynamoConfig(dynamic=True, verify=True), OnnxConfig(dynamic=True, verify=True)]
    # explicit: dtype="auto" exports a bfloat16 model for ExecuTorch in float32 (XNNPACK takes no bfloat16)
    configs.append(ExecutorchConfig(dynamic=True, verify=True, dtype=str(dtype).removeprefix("torch.")))
    results = run_for_generation(model, prompt, configs, STATIC, multi_token_decode=True)
    # the user's model is untouched: same dtype, same tensors
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert weights == {name: p.data_ptr() for name, p in model.named_parameters()}
    warnings = [r.getMessage() for r in hfexport_logs.records if "runs no" in r.getMessage()]
    program_dtype = {"dynamo": dtype, "executorch": dtype, "onnx": dtype if dtype == torch.float16 else torch.float32}
    if dtype == torch.bfloat16:
        assert warnings == [
            "ONNX Runtime's CPU provider runs no bfloat16: exporting the bfloat16 model in float32 for onnx; "
            "dtype='float16' gives a half-precision program"
        ]
    else:
        assert warnings == []
    expected = {
        d: eager_tokens(model if d == dtype else copy.deepcopy(model).to(d), prompt) for d in {dtype, torch.float32}
    }
    for target in TARGETS:
        folder = tmp_path / target
        save_export(folder, {name: by_target[target] for name, by_target in results.items()})
        export = ExportFolder(folder)
        wanted = str(program_dtype[target]).removeprefix("torch.")
        assert {spec.dtype for spec in export.manifest.components.values()} == {wanted}, target
        decoder = export.decoder(batch_size=1)
        tokens = greedy_decode(decoder, prompt["input_ids"], NEW_TOKENS, decoder.max_cache_len)
        assert torch.equal(tokens, expected[program_dtype[target]]), target
    onnx_decode = results["decode"]["onnx"]
    fusions = onnx_decode.record("onnx_ort_fusions").counts
    attention = onnx_decode.record("onnx_group_query_attention").counts
    assert fusions["rotary_embedding"] == 4 and attention["group_query_attention"] == 2  # 2 layers' q and k
    assert onnx_decode.record("onnx_passes").nodes_out <= 70  # 157 in float16 without the fusions


def test_bfloat16_bert_verifies_on_every_target():
    """A single-graph bfloat16 encoder verifies on every target from one call: within a few steps
    of bfloat16's resolution on Dynamo and ExecuTorch (an absolute 1e-2 failed ExecuTorch at
    0.0156, one rounding of a value near 3), in float32 on ONNX within 1e-4 of the float32 copy."""
    model = build("tiny-bert").to(torch.bfloat16)
    inputs = sample_inputs(model, 2, 8)
    configs = [DynamoConfig(dynamic=True, verify=True), OnnxConfig(dynamic=True, verify=True)]
    configs.append(ExecutorchConfig(dynamic=True, verify=True, dtype="bfloat16"))  # auto: float32 (XNNPACK)
    results = run_targets(model, inputs, configs)
    for target, result in results.items():
        last = result.records[-1]
        assert last.max_abs_diff is not None, target
        if target == "onnx":
            assert last.max_abs_diff <= 1e-4
        else:
            hidden = model(**inputs).last_hidden_state.float().abs()
            assert last.max_abs_diff <= 8 * 2**-7 * float(hidden.max()), target


def test_executorch_views_of_a_buffer_written_in_place_read_the_buffer():
    """The root of the bfloat16 decode's zero logits, in a few lines: a mutable buffer written by
    ``index_put_`` and read through a reshape. executorch 1.4.1's planner moves the in-place
    result onto the buffer but leaves the reshape's view on a separate, never-written slot
    (15 here instead of 21); hfexport's planning pass points such views at the buffer."""
    from executorch.exir import ExecutorchBackendConfig, memory, to_edge
    from executorch.runtime import Runtime

    from hfexport.targets.executorch.memory_planning import planning_pass

    class Cache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(1, 2, 4, 3))

        def forward(self, position, values):
            self.cache.index_copy_(2, position, values)
            return self.cache.view(2, 4, 3)[:, 1] * 1.0

    sample = (torch.tensor([1]), torch.arange(6.0).reshape(1, 2, 1, 3) + 1)
    program = to_edge(torch.export.export(Cache(), sample)).to_executorch(
        ExecutorchBackendConfig(run_reinplace_pass=True, memory_planning_pass=planning_pass(True, True, True))
    )
    targets = [n.target for n in program.exported_program().graph.nodes if n.op == "call_function"]
    assert any("index_put_" in str(t) for t in targets) and memory.view in targets  # the case at issue
    got = Runtime.get().load_program(program.buffer).load_method("forward").execute(list(sample))[0]
    torch.testing.assert_close(got, Cache()(*sample), rtol=0, atol=0)


def test_dtype_field_is_validated_in_one_line():
    with pytest.raises(
        ConfigError, match=r"^DynamoConfig dtype must be one of 'auto', 'float32', 'float16', 'bfloat16'"
    ):
        DynamoConfig(dtype="half")
    # ONNX Runtime's CPU provider runs no bfloat16: asked explicitly, refused before any work
    with pytest.raises(ConfigError, match=r"^OnnxConfig dtype 'bfloat16': ONNX Runtime's CPU provider has no bfloat16"):
        OnnxConfig(dtype="bfloat16")
    assert OnnxConfig.from_dict({"export_format": "onnx", "dtype": "float16"}).to_dict()["dtype"] == "float16"
    assert ExecutorchConfig(dtype="bfloat16").dtype == "bfloat16"
    # XNNPACK's quantized linears take float32 or float16 activations
    with pytest.raises(ConfigError, match=r"^ExecutorchConfig quantize='8da4w' with dtype 'bfloat16': XNNPACK"):
        ExecutorchConfig(dtype="bfloat16", quantize="8da4w")


def test_explicit_dtype_converts_a_copy(hfexport_logs):
    """``dtype="float16"`` on a float32 model exports the converted copy (its manifest says so) and
    leaves the model as it was; the copy's weights are the originals converted, tied ones still
    tied, with no warning (the user asked for it)."""
    model = build("tiny-llama")
    copy16 = converted_model(model, torch.float16)
    assert copy16.lm_head.weight is copy16.model.embed_tokens.weight or not model.config.tie_word_embeddings
    assert {p.dtype for p in copy16.parameters()} == {torch.float16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    inputs = sample_inputs(model, 2, 8)
    result = run_targets(model, inputs, [DynamoConfig(dynamic=True, dtype="float16", verify=True)])["dynamo"]
    placeholders = [n.meta["val"] for n in result.program.graph.nodes if n.op == "placeholder"]
    assert {v.dtype for v in placeholders if v.is_floating_point()} == {torch.float16}
    assert not [r for r in hfexport_logs.records if r.levelno >= logging.WARNING and "dtype" in r.getMessage()]
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_cli_dtype_auto_says_it_converts_and_refuses_bfloat16_onnx(tmp_path):
    folder = tmp_path / "bf16"
    build("tiny-llama").to(torch.bfloat16).save_pretrained(folder)
    command = [sys.executable, "-m", "hfexport.cli", "export", folder, "--format", "onnx"]
    refused = subprocess.run(
        [*map(str, command), "--dtype", "bfloat16", "--out", tmp_path / "no"],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].endswith("('auto' exports a bfloat16 model in float32)")
    assert "Traceback" not in refused.stderr
    out = tmp_path / "out"
    done = subprocess.run([*map(str, command), "--out", out], capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ONNX Runtime's CPU provider runs no bfloat16: exporting the bfloat16 model in float32" in done.stderr
    assert ExportFolder(out).manifest.component("model").dtype == "float32"


@pytest.mark.parametrize(("dtype", "program_dtype"), [("auto", "float32"), ("float16", "float16")])
def test_a_bfloat16_checkpoint_exports_to_executorch_8da4w_in_float32_by_default(dtype, program_dtype, tmp_path):
    """Most checkpoints are bfloat16, and XNNPACK takes no bfloat16 node: ``auto`` exports such a
    model for ExecuTorch in float32, saying so, so its layers are delegated and 8da4w's quantized
    linears lower at all (before: ``to_edge`` failed, "expected scalar type torch.float32 but found
    torch.bfloat16"). ``--dtype float16`` gives a float16 program, its linears dequantized in
    float16 (before: the same failure). The runner program decodes."""
    folder = tmp_path / "bf16"
    model = build("tiny-llama").to(torch.bfloat16)
    model.save_pretrained(folder)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "hfexport.cli", "export", folder, "--format", "executorch", "--generation"]
    done = subprocess.run(
        [*map(str, command), "--quantize", "8da4w", "--dtype", dtype, "--out", out],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warned = "XNNPACK runs no bfloat16: exporting the bfloat16 model in float32 for executorch" in done.stderr
    assert warned == (dtype == "auto")
    export = ExportFolder(out)
    assert export.manifest.component("decode").dtype == program_dtype
    # every linear layer runs in XNNPACK: the program's own kernels hold no matmul nor dequantization
    program = deserialize_pte_binary((out / "model.pte").read_bytes())
    plan = next(p for p in getattr(program, "program", program).execution_plan if p.name == "forward")
    assert {d.id for d in plan.delegates} == {"XnnpackBackend"}
    operators = {o.name for o in plan.operators}
    assert not {name for name in operators if "mm" in name or "linear" in name or "quant" in name}, operators
    prompt = torch.tensor([[1, 5, 9, 23]])
    decoder = export.decoder(batch_size=1)
    tokens = greedy_decode(decoder, prompt, NEW_TOKENS, decoder.max_cache_len)
    assert tokens.shape == (1, prompt.shape[1] + NEW_TOKENS)


def test_the_command_line_converts_its_own_model_in_place_with_the_checkpoint_s_values(tmp_path):
    """The command line's model is its own: it is converted a tensor at a time, in place, each
    mapped page of the checkpoint read paged out as it goes (a Llama-3.2-1B-shaped bfloat16
    checkpoint peaked at 7.3 GB converting to float32 beside the mapped file, 5.0 without). The
    values are the checkpoint's, converted; tied weights stay tied."""
    from transformers import AutoModelForCausalLM

    from hfexport.precision import converted_in_place

    build("tiny-llama", tie_word_embeddings=True).to(torch.bfloat16).save_pretrained(tmp_path)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).to(torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # memory-mapped safetensors
    assert converted_in_place(model, torch.float32) is model
    assert model.config.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for (name, got), want in zip(model.state_dict().items(), expected.state_dict().values(), strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, want), name


def test_for_onnx_the_command_line_keeps_the_bfloat16_weights_as_read_and_writes_them_in_float32(tmp_path):
    """Exporting a bfloat16 checkpoint to ONNX (float32: its CPU runtime has no bfloat16), the
    command line's model keeps its weights as read, memory-mapped (but for the embedding table),
    and computes in float32; the ONNX lowering writes each weight converted as it saves it. A
    Llama-3.2-1B-shaped checkpoint's export peaked at 5.3 GiB holding its float32 weights from the
    capture to the save, now 3.5. The folder's weights are the checkpoint's, converted (no
    bfloat16 initializer, no cast of one left for ONNX Runtime; the tied embedding table once),
    and its logits are the float32 model's."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from transformers import AutoModelForCausalLM

    from hfexport.cli import main
    from hfexport.precision import converted_in_place, model_dtype

    folder, out = tmp_path / "bf16", tmp_path / "out"
    # a table over onnxscript's folding limit (8,192 elements), as a real one is
    build("tiny-llama", tie_word_embeddings=True, vocab_size=512).to(torch.bfloat16).save_pretrained(folder)
    expected = AutoModelForCausalLM.from_pretrained(folder).to(torch.float32)
    model = converted_in_place(AutoModelForCausalLM.from_pretrained(folder), torch.float32, keep_stored=True)
    assert model_dtype(model) == torch.float32 and model.config.dtype == torch.float32
    assert model.dtype == torch.float32  # transformers' own, from the first parameter: models cast to it
    assert model.model.layers[0].mlp.down_proj.parametrizations.weight.original.dtype == torch.bfloat16
    # the embedding table is converted (an eager forward would cast it whole to read a few rows)
    assert (
        model.model.embed_tokens.weight.dtype == torch.float32
        and model.lm_head.weight is model.model.embed_tokens.weight
    )
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    with torch.no_grad():
        want = expected(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, want)

    assert main(["export", str(folder), "--format", "onnx", "--out", str(out)]) == 0
    file = out / ExportFolder(out).manifest.component("model").file
    proto = onnx.load(file)
    assert ExportFolder(out).manifest.component("model").dtype == "float32"
    initializers = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert not [t.name for t in proto.graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16]
    assert not [n.name for n in proto.graph.node if n.op_type == "Cast" and n.input[0] in initializers]
    checkpoint = {
        array.tobytes()
        for weight in expected.state_dict().values()
        for array in (weight.numpy(), np.ascontiguousarray(weight.numpy().T))
    }
    # each named after its weight (the packed q, k and v projections are made of three)
    matrices = [name for name in initializers if name.endswith((".weight", ".weight.T"))]
    assert len(matrices) >= 9 and all(initializers[name].tobytes() in checkpoint for name in matrices)
    table = expected.model.embed_tokens.weight.detach().numpy()
    both_ways = {table.tobytes(), np.ascontiguousarray(table.T).tobytes()}
    assert sum(a.tobytes() in both_ways for a in initializers.values()) == 1  # tied: written once
    session = ort.InferenceSession(str(file))
    feeds = {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())}
    got = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5)


def test_for_executorch_the_command_line_keeps_the_linear_weights_as_read_and_writes_the_same_pte(
    tmp_path, monkeypatch, calls_counted
):
    """Exporting a bfloat16 checkpoint to ExecuTorch (float32: XNNPACK runs no bfloat16), the
    command line's model keeps its linear layers' weights as read and computes in float32; the
    program converts them one at a time into a temporary file its tensors map (a
    Llama-3.2-1B-shaped export peaked at 5.3 GiB holding its float32 weights from the capture to
    the save, now 3.4; the builder: 5.0). The ``.pte`` is byte for byte the one the checkpoint
    converted to float32 beforehand gives. Under quantization every weight is converted first (the
    pass reads float32 weights), as before."""
    from transformers import AutoModelForCausalLM

    from hfexport.cli import main
    from hfexport.precision import in_dtype

    bf16, fp32 = tmp_path / "bf16", tmp_path / "fp32"
    model = build("tiny-llama", tie_word_embeddings=True, vocab_size=512).to(torch.bfloat16)
    model.save_pretrained(bf16)
    model.to(torch.float32).save_pretrained(fp32)

    loaded, _ = in_dtype(AutoModelForCausalLM.from_pretrained(bf16), {}, torch.float32, [ExecutorchConfig()], True)
    layer = loaded.model.layers[0]
    assert layer.mlp.down_proj.parametrizations.weight.original.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == loaded.model.embed_tokens.weight.dtype == torch.float32
    quantized = ExecutorchConfig(quantize="8da4w")
    loaded, _ = in_dtype(AutoModelForCausalLM.from_pretrained(bf16), {}, torch.float32, [quantized], True)
    assert not hasattr(loaded.model.layers[0].mlp.down_proj, "parametrizations")

    from hfexport.targets.executorch import stored_weights

    converted = []
    original = stored_weights._converted

    def recorded(sources):
        made = original(sources)
        converted.extend(made)
        return made

    monkeypatch.setattr(stored_weights, "_converted", recorded)
    from hfexport.direct_writes import DirectStream
    from hfexport.targets.executorch import shared_weights

    copied, given, key_of = calls_counted(DirectStream, "write_from"), [], shared_weights.known_key

    def known_key(tensor):  # the keys XNNPACK is given
        key = key_of(tensor)
        given.extend([key] if key is not None else [])
        return key

    monkeypatch.setattr(shared_weights, "known_key", known_key)
    command = ["export", "--format", "executorch", "--generation"]
    assert main([command[0], str(bf16), *command[1:], "--out", str(tmp_path / "from-bf16")]) == 0
    assert len(converted) == 2 * 7 and all(stored_weights.mapped(t) for t in converted)  # 2 layers of 7 linears
    # XNNPACK names each converted weight by a key taken as it was written: a SHA-256 of the
    # bfloat16 bytes it was converted from, where XNNPACK's own is that of the float32 bytes
    keys = {stored_weights.known_key(t): hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in converted}
    sources = [t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes() for t in converted]
    prefix = b"hfexport: float32 of bfloat16\0"
    assert list(keys) == [hashlib.sha256(prefix + source).hexdigest() for source in sources]
    if stored_weights.direct_place(converted[0]) is not None:  # O_DIRECT on the temporary directory
        # XNNPACK took the keys, and the .pte copied each weight from the temporary file past the page cache
        assert sorted(given) == sorted(keys) and len(copied) == 2 * 7
    converted.clear()
    assert main([command[0], str(fp32), *command[1:], "--out", str(tmp_path / "from-fp32")]) == 0
    assert not converted
    pte = [(tmp_path / name / "model.pte").read_bytes() for name in ("from-bf16", "from-fp32")]
    for ours, xnnpacks in keys.items():  # the same program, the keys aside
        assert pte[0].count(ours.encode()) == 2  # in the delegate's graph and in the named data
        pte[0] = pte[0].replace(ours.encode(), xnnpacks.encode())
    assert pte[0] == pte[1]


def test_stored_weights_map_their_float32_values_and_are_read_again_once_released(tmp_path, monkeypatch):
    """:func:`stored_weights_converted` folds each cast of a stored weight into a float32 weight
    that maps a temporary file: the program computes what the model does, before and after the
    pages it read were handed back. On a temporary directory in memory (tmpfs) the weights are
    converted in memory instead."""
    import tempfile

    from hfexport.precision import converted_in_place
    from hfexport.targets.executorch.stored_weights import mapped, pages_released, stored_weights_converted

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4, bias=False))
    model = converted_in_place(model.to(torch.bfloat16), torch.float32, keep_stored=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
    for directory, spilled in ((str(tmp_path), True), ("/dev/shm", False)):
        monkeypatch.setattr(tempfile, "tempdir", directory)
        program = torch.export.export(model, (x,))
        assert stored_weights_converted(program) == 2  # the first layer's bias and the second's weight
        casts = [n for n in program.graph.nodes if n.op == "call_function" and "to" in str(n.target).split(".")[1:2]]
        assert not casts
        weights = [t for t in program.state_dict.values() if t.dtype == torch.float32]
        assert len(weights) == 3 and sum(mapped(t) for t in weights) == (2 if spilled else 0)
        torch.testing.assert_close(program.module()(x), want, rtol=0, atol=0)
        for weight in weights:
            pages_released(weight)
        torch.testing.assert_close(program.module()(x), want, rtol=0, atol=0)
    assert next(model[2].parameters()).dtype == torch.bfloat16  # the model's own are not changed


def test_a_model_kept_stored_reports_the_dtype_it_computes_in_from_its_first_parameter():
    """transformers' ``PreTrainedModel.dtype`` is its first floating-point parameter's, and models
    cast their inputs and masks to it: kept as read, a bias-less first linear layer's bfloat16
    weight would make a float32 model cast its inputs to bfloat16. The first parameter is
    converted; the others stay stored."""
    from hfexport.precision import converted_in_place, model_dtype

    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    converted_in_place(model, torch.float32, keep_stored=True)
    first = next(p for p in model.parameters() if p.is_floating_point())
    assert first.dtype == torch.float32 and model_dtype(model) == torch.float32
    assert model[1].parametrizations.weight.original.dtype == torch.bfloat16
    assert model(torch.randn(3, 4)).dtype == torch.float32


def test_eager_forwards_convert_stored_weights_into_reused_buffers_never_into_one_still_held(calls_counted):
    """Within ``conversions_reused`` (hfexport's own eager runs: generate recording the components,
    the sample's checks, the capture's reference), a weight computed in float32 is converted into
    a buffer reused from weight to weight and forward to forward, not a fresh allocation each
    time: the logits are bit for bit the plain conversion's, a converted weight someone still
    holds is never converted into, and under autograd or outside the context every conversion is
    a fresh tensor, as before."""
    from hfexport.computed_weights import conversions_reused
    from hfexport.precision import converted_in_place

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16, bias=False) for _ in range(5)]  # the first is converted: the model's dtype
    model = converted_in_place(torch.nn.Sequential(*layers).to(torch.bfloat16), torch.float32, keep_stored=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        want = model(x)
    fresh = calls_counted(torch.Tensor, "to")
    with conversions_reused(), torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), want)
        assert len(fresh) == 1  # four stored weights of one shape, three forwards: one buffer
        held = layers[1].weight
        assert torch.equal(held, layers[1].parametrizations.weight.original.float())
        other = layers[2].weight  # the held one is not converted into
        assert len(fresh) == 2 and held.data_ptr() != other.data_ptr()
        assert torch.equal(held, layers[1].parametrizations.weight.original.float())
        del held, other
        assert torch.equal(model(x), want) and len(fresh) == 2
    with conversions_reused():
        model(x).sum().backward()  # autograd: fresh tensors, the gradient reaches the stored weights
    assert len(fresh) == 2 + 4 and layers[1].parametrizations.weight.original.grad is not None
    with torch.no_grad():
        model(x)
    assert len(fresh) == 2 + 4 + 4
