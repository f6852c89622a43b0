"""ONNX Runtime GenAI (``og.Model`` + ``og.Generator``, the real runtime) runs the folders a
decoder-only ``hfexport export --format onnx --generation`` writes, token-exact with
``model.generate``; hfexport's own loop runs the same file."""

import json

import numpy as np
import onnx
import onnxruntime_genai as og
import pytest
import torch
from models import build, build_llava, build_mamba, build_sliding_window
from transformers import GenerationConfig

from hfexport import ExportFolder, OnnxConfig, OnnxExporter, UnsupportedModelError, save_export
from hfexport.cli import main
from hfexport.exporters import run_for_generation
from hfexport.generation import greedy_decode
from hfexport.models.generation import runtime_facts

NEW_TOKENS = 12


def reference(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    """``model.generate``'s greedy new tokens, up to its first eos (which ORT GenAI does not return)."""
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static"
        )
    new = ids[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    return next((new[:i] for i, token in enumerate(new) if token in stops), new)


def og_generate(folder, prompts: list[list[int]], pad: int) -> list[list[int]]:
    """Greedy new tokens of each prompt in one ``og.Generator`` batch (ORT GenAI pads on the right)."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    longest = max(map(len, prompts))
    params.set_search_options(max_length=longest + NEW_TOKENS, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([p + [pad] * (longest - len(p)) for p in prompts], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(row)][longest:] for row in range(len(prompts))]


def prompts_for(model: torch.nn.Module) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (7, 3)]


def check_every_loop(folder, model: torch.nn.Module) -> None:
    """Each prompt alone and both in one right-padded batch under ``og.Generator``, and both left
    padded in hfexport's own loop over the same file, give ``model.generate``'s tokens."""
    prompts = prompts_for(model)
    expected = [reference(model, p) for p in prompts]
    pad = json.loads((folder / "genai_config.json").read_text())["model"].get("pad_token_id", 0)
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert og_generate(folder, [prompt], pad) == [tokens]
    batch = og_generate(folder, prompts, pad)
    for row, tokens in zip(batch, expected, strict=True):
        assert row[: len(tokens)] == tokens  # a row that ended keeps the batch's pad after its eos

    step = ExportFolder(folder).decoder(batch_size=2)
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    eos = model.generation_config.eos_token_id
    out = greedy_decode(step, ids, NEW_TOKENS, step.max_cache_len, mask, eos_token_id=eos, pad_token_id=-1)
    for row, tokens in zip(out[:, longest:].tolist(), expected, strict=True):
        assert row[: len(tokens)] == tokens


# Gemma3: a sliding window of 4, left behind by the 12 new tokens; Qwen3: per-head norms; Phi3:
# fused projections; GPT-2: learned positions; Qwen3-MoE: experts; Mistral: every layer slides
# (the last four in make test-all: make test's 30 minutes)
FAMILIES = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-gemma3",
    *(
        pytest.param(name, marks=pytest.mark.slow)
        for name in ("tiny-gpt2", "tiny-phi3", "tiny-qwen3-moe", "tiny-mistral")
    ),
]


@pytest.mark.parametrize("preset", FAMILIES)
def test_a_generation_folder_runs_token_exact_in_onnxruntime_genai_and_in_hfexport(preset, tmp_path):
    out = tmp_path / "out"
    assert main(["export", preset, "--format", "onnx", "--generation", "--out", str(out)]) == 0
    check_every_loop(out, build(preset))


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_sliding_windows_and_additive_masks_from_python_run_in_onnxruntime_genai(family, tmp_path):
    """Gemma2's eager attention adds a float mask; Qwen2 slides above its first layer only. Both
    exported from Python with ``OnnxConfig(genai=True)``, the folder written by ``save_export``."""
    model = build_sliding_window(family)
    inputs = {"input_ids": torch.randint(3, 100, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    cache = GenerationConfig(cache_implementation="static", max_cache_len=64)
    config = OnnxConfig(dynamic=True, genai=True, verify=True)
    results = run_for_generation(model, inputs, [config], cache, multi_token_decode=True)
    assert list(results) == ["decode"]  # the runtime's loop feeds the prompt to decode: no prefill
    generation = {"max_cache_len": 64, "multi_token_decode": True, "model": runtime_facts(model)}
    save_export(tmp_path, {name: by[config.export_format] for name, by in results.items()}, generation=generation)
    check_every_loop(tmp_path, model)


def test_the_graph_takes_only_what_onnxruntime_genai_feeds_and_its_config_says_so(tmp_path):
    out = tmp_path / "out"
    assert main(["export", "tiny-llama", "--format", "onnx", "--generation", "--out", str(out)]) == 0
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    past = [f"past_key_values.{layer}.{kind}" for layer in (0, 1) for kind in ("key", "value")]
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", *past, "position_ids"]
    assert [o.name for o in graph.output] == ["logits", *(name.replace("past_key_values", "present") for name in past)]
    mask = next(i for i in graph.input if i.name == "attention_mask").type.tensor_type
    assert mask.elem_type == onnx.TensorProto.INT64 and len(mask.shape.dim) == 2
    # every layer's attention reads one key count derived from the mask (not one per layer's counter)
    attention = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert len(attention) == 2 and len({node.input[5] for node in attention}) == 1
    # ... and attends over the slots written so far, the mask's width, not the whole cache (its
    # bias cut to them), as the builder's graph does
    producers = {output: node for node in graph.node for output in node.output}
    initializers = {t.name for t in graph.initializer}
    for node in attention:
        total, bias = producers[node.input[6]], producers[node.input[10]]
        assert node.input[6] not in initializers and total.op_type == "Squeeze"
        assert bias.op_type == "Slice" and producers[bias.input[2]].input == ["attention_mask"]
    config = json.loads((out / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert config["model"]["type"] == "decoder" and decoder["filename"] == "model.onnx"
    assert config["model"]["context_length"] == config["search"]["max_length"] == 256
    assert config["search"]["past_present_share_buffer"] is True
    assert (config["model"]["bos_token_id"], config["model"]["eos_token_id"]) == (1, [2])
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 16)
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert ExportFolder(out).manifest.component("decode").interface == "onnxruntime-genai"


def test_spec_io_keeps_the_spec_interface_for_hfexport_generate(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "tiny-llama", "--format", "onnx", "--generation", "--spec-io", "--out", str(out)]) == 0
    names = [i.name for i in onnx.load(out / "decode.onnx", load_external_data=False).graph.input]
    assert not (out / "model.onnx").exists()  # the runtime's name is for its own interface
    assert "input.cache.layers.0.cumulative_length" in names and "attention_mask" in names
    assert not (out / "genai_config.json").exists()
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt-ids", "5,6,7", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, reference(build("tiny-llama"), [5, 6, 7])[:4]))


@pytest.mark.parametrize("kind", ["mamba", "llava"])
def test_a_model_onnxruntime_genai_cannot_run_is_refused_in_one_line(kind):
    model, inputs = build_mamba() if kind == "mamba" else build_llava()
    cache = GenerationConfig(cache_implementation="static", max_cache_len=32)
    with pytest.raises(UnsupportedModelError) as raised:
        OnnxExporter().export_for_generation(model, inputs, OnnxConfig(dynamic=True, genai=True), cache, True)
    message = str(raised.value)
    assert "ONNX Runtime GenAI" in message and "--spec-io" in message and "\n" not in message


@pytest.mark.parametrize("window, chunk", [(None, None), (3, None), (None, 4)])
def test_the_graph_builds_the_decode_loops_masks(window, chunk):
    """The in-graph mask rule equals :func:`~hfexport.generation.decode_mask` on left-padded rows
    (hfexport's loops), prompt and decode steps alike."""
    import onnx_ir as ir
    import onnxruntime as ort

    from hfexport.generation import decode_mask
    from hfexport.targets.onnx.genai import _Builder, _derived_mask

    cache_len = 16
    valid_in = ir.Value(name="valid", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape(["batch", cache_len]))
    slots_in = ir.Value(name="slots", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["tokens"]))
    op = _Builder()
    mask = _derived_mask(op, valid_in, slots_in, cache_len, window, chunk)
    mask.name = "mask"
    graph = ir.Graph([valid_in, slots_in], [mask], nodes=op.nodes, opset_imports={"": 21})
    session = ort.InferenceSession(ir.to_proto(ir.Model(graph, ir_version=10)).SerializeToString())
    padding = torch.tensor([3, 0])
    for start, tokens in ((0, 9), (9, 1), (12, 2)):
        slots = torch.arange(start, start + tokens)
        valid = (torch.arange(cache_len)[None] >= padding[:, None]) & (torch.arange(cache_len)[None] <= slots[-1])
        (got,) = session.run(None, {"valid": valid.numpy(), "slots": slots.numpy()})
        expected = decode_mask(valid.long(), slots, window, chunk)
        assert torch.equal(torch.from_numpy(got), expected), (start, tokens)
