"""Generation: decompose_for_generation, export_for_generation, and greedy decoding over the
exported static-cache decode graph, token for token against model.generate."""

import collections
import copy
import logging
import re
import subprocess
import sys

import pytest
import torch
from models import build, sample_inputs
from transformers import GenerationConfig

from hfexport import DynamoConfig, DynamoExporter, decompose_for_generation
from hfexport.generation import greedy_decode
from hfexport.targets.dynamo import DynamoDecoder

STATIC = GenerationConfig(cache_implementation="static", max_cache_len=32)
# tiny-gemma3 alternates sliding-window (window 4) and full attention: 6 + 16 tokens go well past the window
DECODER_ONLY = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-gemma3"]


def reference_tokens(model, prompt, new_tokens=16):
    with torch.no_grad():
        return model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def assert_a_second_generation_matches(decoder, model, batch=2):
    """One decoder serves a later, different prompt: the graph writes at its cache's token
    counters, so a stale counter from the first generation would write the wrong slots (and,
    past the cache's end, fail)."""
    prompt = sample_inputs(model, batch, 9, seed=7)
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, decoder.max_cache_len, prompt["attention_mask"])
    assert torch.equal(tokens, reference_tokens(model, prompt))


def test_decompose_decoder_only_keeps_a_stable_signature():
    model = build("tiny-llama")
    prompt = sample_inputs(model, 2, 6)
    generation_config = GenerationConfig(max_new_tokens=5)
    before = {k: v.clone() for k, v in prompt.items()}
    components = decompose_for_generation(model, prompt, generation_config)
    assert set(components) == {"prefill", "decode"}
    _, decode = components["decode"]
    # generate drops an all-ones mask; the decode kwargs carry one anyway
    assert decode["attention_mask"].shape == (2, 7) and decode["input_ids"].shape == (2, 1)
    assert decode["cache"].get_seq_length() == 6
    assert generation_config.max_new_tokens == 5  # the caller's config is untouched
    assert all(torch.equal(prompt[k], before[k]) for k in before)


@pytest.mark.parametrize("padded", [False, True])
def test_prefill_takes_the_2d_prompt_mask_with_or_without_padding(padded):
    # with a static cache generate hands Qwen3's prefill {"full_attention": None} for an unpadded
    # prompt and 4-D masks for a padded one; the exported prefill takes the 2-D mask either way
    model = build("tiny-qwen3")
    prompt = sample_inputs(model, 2, 6)
    if padded:
        prompt["attention_mask"][0, :2] = 0
    components = decompose_for_generation(model, prompt, STATIC, multi_token_decode=True)
    assert torch.equal(components["prefill"][1]["attention_mask"], prompt["attention_mask"])


def test_decode_mask_is_one_tensor_for_one_layer_type_and_a_dict_for_several():
    qwen3 = build("tiny-qwen3")
    mask = decompose_for_generation(qwen3, sample_inputs(qwen3, 1, 6), STATIC, True)["decode"][1]["attention_mask"]
    assert isinstance(mask, torch.Tensor) and mask.dim() == 4
    gemma3 = build("tiny-gemma3")
    masks = decompose_for_generation(gemma3, sample_inputs(gemma3, 1, 6), STATIC, True)["decode"][1]["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention"}


@pytest.mark.parametrize("preset", DECODER_ONLY[:3])  # tiny-gemma3: test_sliding_window_decode_...
def test_static_multi_token_decode_generates_the_same_tokens(preset):
    model = build(preset)
    prompt = sample_inputs(model, 2, 6)
    # verify=True: each component within 1e-4 of its eager module on the captured inputs
    programs = DynamoExporter().export_for_generation(
        model, prompt, DynamoConfig(dynamic=True, verify=True), STATIC, multi_token_decode=True
    )
    assert set(programs) == {"prefill", "decode"}
    decoder = DynamoDecoder(programs["decode"], batch_size=2)
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, decoder.max_cache_len, prompt["attention_mask"])
    assert torch.equal(tokens, reference_tokens(model, prompt))
    assert int(decoder.cache.get_seq_length()) == 6 + 15  # the cache was written in place
    assert_a_second_generation_matches(decoder, model)


def test_sliding_window_decode_applies_the_window_past_it():
    from transformers import cache_utils

    from hfexport.models.static_layers import WindowedStaticLayer

    model = build("tiny-gemma3")
    prompt = sample_inputs(model, 2, 6)
    programs = DynamoExporter().export_for_generation(
        model, prompt, DynamoConfig(dynamic=True), STATIC, multi_token_decode=True
    )
    assert cache_utils.STATIC_LAYER_TYPE_MAPPING["sliding_attention"] is cache_utils.StaticSlidingWindowLayer
    decoder = DynamoDecoder(programs["decode"], batch_size=2)
    layers = decoder.cache.layers
    assert [type(layer) for layer in layers] == [WindowedStaticLayer, cache_utils.StaticLayer]
    assert layers[0].keys.shape[2] == 32  # full length: the mask applies the window
    assert decoder.masks.windows == {"sliding_attention": 4}
    expected = reference_tokens(model, prompt)
    assert torch.equal(greedy_decode(decoder, prompt["input_ids"], 16, 32, prompt["attention_mask"]), expected)
    # the same graph with full-attention masks on the sliding layers generates other tokens
    unwindowed = DynamoDecoder(programs["decode"], batch_size=2)
    unwindowed.masks.windows = {}
    tokens = greedy_decode(unwindowed, prompt["input_ids"], 16, 32, prompt["attention_mask"])
    assert not torch.equal(tokens, expected)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "cohere2"])
def test_sliding_window_families_decode_past_the_window_token_for_token(family):
    # tiny-gemma3 (sdpa, sliding + full) is covered above; these add a model whose layers all slide
    # (one mask, windowed), a layer-count split, and two on eager attention (additive float masks)
    from models import SLIDING_WINDOW_FAMILIES, build_sliding_window

    model = build_sliding_window(family)
    prompt = sample_inputs(model, 2, 6)
    programs = DynamoExporter().export_for_generation(
        model, prompt, DynamoConfig(dynamic=True), STATIC, multi_token_decode=True
    )
    decoder = DynamoDecoder(programs["decode"], batch_size=2)
    assert decoder.masks.windows == {"sliding_attention": 4}
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, 32, prompt["attention_mask"])  # 6 + 16 tokens > 4
    assert torch.equal(tokens, reference_tokens(model, prompt))
    if SLIDING_WINDOW_FAMILIES[family][3] == "eager":
        assert all(dtype == torch.float32 for dtype in decoder.masks.dtypes.values())


def test_decode_masks_apply_the_window_and_reject_other_layer_types():
    from hfexport import HfExportError
    from hfexport.generation import DecodeMasks

    masks = DecodeMasks(["full_attention", "sliding_attention"], {"sliding_attention": 2})
    valid = torch.tensor([[0, 1, 1, 1, 0]])  # slot 0 is padding, slot 4 not written yet
    built = masks.by_input_path(valid, torch.tensor([3]))
    assert built["attention_mask.full_attention"][0, 0, 0].tolist() == [False, True, True, True, False]
    assert built["attention_mask.sliding_attention"][0, 0, 0].tolist() == [False, False, True, True, False]
    with pytest.raises(HfExportError, match="chunked_attention"):
        DecodeMasks(["full_attention", "chunked_attention"], {})


def test_decode_exported_from_unpadded_prompt_runs_a_padded_batch():
    model = build("tiny-llama")
    programs = DynamoExporter().export_for_generation(
        model, sample_inputs(model, 2, 6), DynamoConfig(dynamic=True), STATIC, multi_token_decode=True
    )
    prompt = sample_inputs(model, 3, 7, seed=11)
    prompt["attention_mask"][0, :3] = 0  # left padding
    prompt["attention_mask"][2, :1] = 0
    decoder = DynamoDecoder(programs["decode"], batch_size=3)
    tokens = greedy_decode(decoder, prompt["input_ids"], 8, decoder.max_cache_len, prompt["attention_mask"])
    assert torch.equal(tokens, reference_tokens(model, prompt, 8))


def test_multi_token_decode_accepts_query_lengths_1_2_4():
    model = build("tiny-llama")
    prompt = sample_inputs(model, 2, 6)
    components = decompose_for_generation(model, prompt, STATIC, multi_token_decode=True)
    module, kwargs = components["decode"]
    program = DynamoExporter().export(module, kwargs, DynamoConfig(dynamic=True))
    for query in (1, 2, 4):
        step = {
            "input_ids": sample_inputs(model, 2, query, seed=query)["input_ids"],
            "position_ids": torch.arange(6, 6 + query)[None].expand(2, -1),
            "attention_mask": (torch.arange(32)[None, :] <= torch.arange(6, 6 + query)[:, None])[None, None].expand(
                2, 1, -1, -1
            ),
        }
        cache_for_program, cache_for_eager = copy.deepcopy(kwargs["cache"]), copy.deepcopy(kwargs["cache"])
        with torch.no_grad():
            got = program.module()(**step, cache=cache_for_program).logits
            expected = model(**step, cache=cache_for_eager).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert int(cache_for_program.get_seq_length()) == int(cache_for_eager.get_seq_length())


SPEC_DECODE_LOOP = """
import copy, sys
import torch
from transformers import StaticCache
from hfexport import register_pytree_node

prompt_ids = torch.tensor([{prompt}])
prompt_len, max_cache_len, new_tokens = prompt_ids.shape[1], {max_cache_len}, 16

register_pytree_node(StaticCache)
exported = torch.export.load(sys.argv[1])
decode = exported.module()

# the artifact carries an initialised StaticCache: reuse it (reset to empty)
_, example_kwargs = exported.example_inputs
past_key_values = copy.deepcopy(example_kwargs["cache"])  # transformers 5.24 names it `cache`
past_key_values.reset()

def causal_mask(positions, cache_len):
    return (torch.arange(cache_len)[None, :] <= positions[:, None])[None, None]

positions = torch.arange(prompt_len)
logits = decode(input_ids=prompt_ids, attention_mask=causal_mask(positions, max_cache_len),
                position_ids=positions[None], cache=past_key_values).logits
next_token = logits[:, -1:].argmax(-1)
generated = [next_token]

input_ids = torch.empty((1, 1), dtype=torch.long)
position_ids = torch.empty((1, 1), dtype=torch.long)
attention_mask = torch.empty((1, 1, 1, max_cache_len), dtype=torch.bool)
slots = torch.arange(max_cache_len)
for position in range(prompt_len, prompt_len + new_tokens - 1):
    input_ids.copy_(next_token)
    position_ids.fill_(position)
    attention_mask[0, 0, 0].copy_(slots <= position)
    logits = decode(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids, cache=past_key_values).logits
    next_token = logits[:, -1:].argmax(-1)
    generated.append(next_token)
print(torch.cat(generated, 1)[0].tolist())
"""


# Qwen3 (the spec's model family): generate hands its decode a {"full_attention": mask} dict, the
# spec's loop a 4-D tensor
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_spec_decode_loop_on_a_saved_program(tmp_path, preset):
    model = build(preset)
    prompt = sample_inputs(model, 1, 6)
    programs = DynamoExporter().export_for_generation(
        model, prompt, DynamoConfig(dynamic=True), STATIC, multi_token_decode=True
    )
    torch.export.save(programs["decode"], tmp_path / "decode.pt2")
    code = SPEC_DECODE_LOOP.format(prompt=prompt["input_ids"][0].tolist(), max_cache_len=32)
    # a fresh process: only what the artifact and register_pytree_node provide
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "decode.pt2")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    generated = eval(result.stdout.strip().splitlines()[-1])
    assert generated == reference_tokens(model, prompt)[0, 6:].tolist()

    # exported from one prompt, the decode graph takes three (its batch axis was widened at capture)
    prompts = sample_inputs(model, 3, 7, seed=4)
    decoder = DynamoDecoder(programs["decode"], batch_size=3)
    tokens = greedy_decode(decoder, prompts["input_ids"], 8, decoder.max_cache_len, prompts["attention_mask"])
    assert torch.equal(tokens, reference_tokens(model, prompts, 8))


def export_folder(model, prompt, config, folder):
    """Export the generation components, save them with their manifest, and open the folder."""
    from hfexport import ExportFolder, run_for_generation, save_export

    results = run_for_generation(model, prompt, [config], STATIC, multi_token_decode=True)
    save_export(folder, {name: by_target[config.export_format] for name, by_target in results.items()})
    return ExportFolder(folder)


@pytest.mark.parametrize("preset", DECODER_ONLY)
def test_onnx_static_decode_with_io_binding_generates_the_same_tokens(preset, tmp_path, monkeypatch):
    from hfexport import HfExportError, OnnxConfig

    model = build(preset)
    prompt = sample_inputs(model, 2, 6)
    retraces = []  # torch.onnx's decomposition: the components' cache writes are made functional instead
    original = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(
        torch.export.ExportedProgram,
        "run_decompositions",
        lambda self, *args, **kwargs: retraces.append(1) or original(self, *args, **kwargs),
    )
    export = export_folder(model, prompt, OnnxConfig(dynamic=True, verify=True), tmp_path)
    assert retraces == []
    assert set(export.manifest.components) == {"prefill", "decode"}
    decoder = export.decoder(batch_size=2)
    session_inputs = [i.name for i in decoder.session.get_inputs()]
    session_outputs = [o.name for o in decoder.session.get_outputs()]
    assert "input.cache.layers.0.keys" in session_inputs and "output.cache.layers.0.keys" in session_outputs
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, decoder.max_cache_len, prompt["attention_mask"])
    assert torch.equal(tokens, reference_tokens(model, prompt))
    # IO binding wrote the cache in place: the counter in our own buffer advanced
    assert int(decoder.cache["cache.layers.0.cumulative_length"]) == 6 + 15
    # the logits go to a tensor bound for each step: its shape from the inputs' axes, never reused
    assert decoder.logits_dims == [("input_ids", 0), ("input_ids", 1), model.config.vocab_size]
    monkeypatch.setattr(type(decoder.binding), "get_outputs", lambda self: pytest.fail("outputs wrapped"))
    valid = torch.ones(2, decoder.max_cache_len, dtype=torch.long)
    ids = prompt["input_ids"][:, :1]
    steps = [decoder(ids, valid, torch.tensor([i]), torch.full((2, 1), i)) for i in range(2)]
    assert steps[0].shape == (2, 1, model.config.vocab_size) and steps[0].data_ptr() != steps[1].data_ptr()
    monkeypatch.undo()
    assert_a_second_generation_matches(decoder, model)
    # a step past the cache's end is refused before ONNX Runtime runs it (it ran this one silently)
    end = decoder.max_cache_len
    with pytest.raises(HfExportError, match=f"writes cache slot {end}, past the static cache's {end} slots"):
        decoder(ids, valid, torch.tensor([end]), torch.full((2, 1), end))


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_onnx_decode_attends_through_group_query_attention_on_a_batch(family, tmp_path):
    # the static-cache attention becomes ONNX Runtime's GroupQueryAttention, fed the graph's own
    # mask as its bias: left padding and causality (qwen3's with its query and key norms), and
    # mistral's 4-token window stay exact
    import onnx
    from models import build_sliding_window

    from hfexport import OnnxConfig

    model = build_sliding_window(family) if family == "mistral" else build(f"tiny-{family}")
    export = export_folder(model, sample_inputs(model, 2, 6), OnnxConfig(dynamic=True, verify=True), tmp_path)
    graph = onnx.load(tmp_path / export.manifest.component("decode").file).graph
    ops = collections.Counter(node.op_type for node in graph.node)
    layers = model.config.num_hidden_layers
    assert ops["GroupQueryAttention"] == layers and ops["Softmax"] == ops["ScatterElements"] == 0
    assert ops["Transpose"] == 1  # heads are never split out
    # the op rotates its packed q / k / v itself; qwen3's per-head norms keep their rotations before it
    assert ops["RotaryEmbedding"] == (2 * layers if family == "qwen3" else 0)
    rotating = [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.input[1] == ""]
    assert len(rotating) == (0 if family == "qwen3" else layers)
    if family != "mistral":
        prompt = sample_inputs(model, 3, 7, seed=11)
        prompt["attention_mask"][0, :3] = 0
        prompt["attention_mask"][2, :1] = 0
    else:  # 6 + 16 tokens: past the window. (With 3 x 7 tokens, transformers' generate picks another
        # 21st token on row 2 than its own uncached forward over the same tokens, which every
        # target, Dynamo's too, matches to 1e-7: 0.3565 against 0.3480 for the two top logits)
        prompt = sample_inputs(model, 2, 6)
    decoder = export.decoder(batch_size=len(prompt["input_ids"]))
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, decoder.max_cache_len, prompt["attention_mask"])
    assert torch.equal(tokens, reference_tokens(model, prompt))


# make test keeps a plain decoder and the sliding-window one (the ExecuTorch lowering is the slow
# part); the Qwen3 pair runs under make test-all
ET_DECODERS = [
    "tiny-llama",
    pytest.param("tiny-qwen3", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3-moe", marks=pytest.mark.slow),
    "tiny-gemma3",
]


@pytest.mark.parametrize("preset", ET_DECODERS)
def test_executorch_static_decode_generates_the_same_tokens(preset, tmp_path):
    from hfexport import ExecutorchConfig, HfExportError

    model = build(preset)
    prompt = sample_inputs(model, 2, 6)
    config = ExecutorchConfig(dynamic=True, verify=True, max_batch_size=2)  # a batched decode program
    export = export_folder(model, prompt, config, tmp_path)
    ids = next(i for i in export.manifest.component("decode").inputs if i.path == "input_ids")
    assert ids.dynamic[1][1] == 32  # the memory plan is bounded by the static cache length
    decoder = export.decoder(batch_size=2)
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, decoder.max_cache_len, prompt["attention_mask"])
    assert torch.equal(tokens, reference_tokens(model, prompt))
    assert_a_second_generation_matches(decoder, model)
    with pytest.raises(HfExportError, match="exported with a batch of at most 2 and cannot decode 3 rows"):
        export.decoder(batch_size=3)


def test_executorch_decode_defaults_to_one_row_and_delegates_each_layer_whole(tmp_path):
    """With ``max_batch_size`` left to its default, a generation component's batch is one (the
    sample is cut to its first row): every reshape then has one dynamic axis, which XNNPACK infers,
    so a layer's work is delegated between its two cache writes instead of in nine pieces."""
    from hfexport import ExecutorchConfig, HfExportError

    model = build("tiny-llama")  # 2 layers
    prompt = sample_inputs(model, 2, 6)
    config = ExecutorchConfig(dynamic=True, verify=True, dump_dir=str(tmp_path / "dump"))
    export = export_folder(model, prompt, config, tmp_path / "out")
    delegation = (tmp_path / "dump" / "decode" / "05_delegate" / "delegation.md").read_text()
    subgraphs = int(delegation.splitlines()[0].split(":")[1])
    assert subgraphs <= 2 * 2 + 2, delegation  # 20 with a dynamic batch
    # the logits' last position; attention_as_custom_sdpa's first keys of the mask and of the two
    # layers' keys and values
    assert "| aten_slice_copy_tensor | 0 | 6 |" in delegation
    spec = export.manifest.component("decode")
    ids = next(i for i in spec.inputs if i.path == "input_ids")
    assert ids.shape[0] == 1
    # the keys and values are the program's state: not fed, not written back; the counters are
    held = sorted(i.path for i in spec.inputs if i.state)
    assert held == sorted(f"cache.layers.{i}.{leaf}" for i in range(2) for leaf in ("keys", "values"))
    assert all(i.shape == [1, 2, 32, 16] for i in spec.inputs if i.state)
    assert sorted(o.writes for o in spec.outputs if o.kind == "write_back") == [
        f"cache.layers.{i}.cumulative_length" for i in range(2)
    ]
    decoder = export.decoder(batch_size=1)
    assert decoder.max_cache_len == 32
    one_row = {name: value[:1] for name, value in prompt.items()}
    tokens = greedy_decode(decoder, one_row["input_ids"], 16, decoder.max_cache_len)
    assert torch.equal(tokens, reference_tokens(model, one_row))
    assert_a_second_generation_matches(decoder, model, batch=1)  # the state is reused, old slots masked
    with pytest.raises(HfExportError, match="exported with a static batch of 1 and cannot decode 2 rows"):
        export.decoder(batch_size=2)


def test_executorch_decode_attends_on_custom_sdpa(tmp_path):
    """``attention_as_custom_sdpa`` runs each layer's attention on ExecuTorch's
    ``llama::custom_sdpa``. The kernel takes ``[batch, length, heads, dim]``; the cache, as the
    program's state, is laid out that way, so the kernel reads the first rows of the buffers the
    step writes (no transposed copy), while the manifest keeps the model's layout; a fresh process
    runs the program too."""
    from hfexport import ExecutorchConfig

    model = build("tiny-llama")  # 2 layers, 2 key/value heads of 16, cache 32
    prompt = sample_inputs(model, 1, 6)
    config = ExecutorchConfig(dynamic=True, verify=True, dump_dir=str(tmp_path / "dump"))
    export = export_folder(model, prompt, config, tmp_path / "out")
    delegation = (tmp_path / "dump" / "decode" / "05_delegate" / "delegation.md").read_text()
    assert "| llama_custom_sdpa_default | 0 | 2 |" in delegation
    edge = (tmp_path / "dump" / "decode" / "04_edge_passes" / "graph.txt").read_text()  # the edge program delegated
    assert 'cache_layers_0_keys: "f32[1, 32, 2, 16]"' in edge  # [batch, length, heads, dim]
    # the kernel reads the written buffers' first rows, as many as the mask's last visible key
    first_rows = dict(
        re.findall(r"(\w+): \"f32\[1, u\d+, 2, 16\]\" = \w+slice_copy_Tensor\((aten_index_put_default\w*), 1, 0,", edge)
    )
    kernels = re.findall(r"llama_custom_sdpa_default\w*\(\w+, (\w+), (\w+),", edge)
    assert len(kernels) == 2 and all(read in first_rows for pair in kernels for read in pair)
    assert len({first_rows[read] for pair in kernels for read in pair}) == 4  # 2 layers' keys and values
    # the rotary embeddings and the outputs' row mask run in the kernel's layout: the model's
    # transposes to [batch, heads, length, dim] and back (six per layer) are gone; one transpose of
    # the mask's rows is left, for every layer
    assert edge.count("= executorch_exir_dialects_edge__ops_aten_permute_copy_default(") == 1
    state = [i for i in export.manifest.component("decode").inputs if i.state]
    assert {tuple(i.shape) for i in state} == {(1, 2, 32, 16)}
    decoder = export.decoder(batch_size=1)
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, decoder.max_cache_len)
    assert torch.equal(tokens, reference_tokens(model, prompt))
    assert_a_second_generation_matches(decoder, model, batch=1)
    script = (
        "import sys, torch; from hfexport import ExportFolder; from hfexport.generation import greedy_decode; "
        "d = ExportFolder(sys.argv[1]).decoder(batch_size=1); "
        f"print(greedy_decode(d, torch.tensor({prompt['input_ids'].tolist()}), 16, d.max_cache_len).tolist())"
    )
    fresh = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.strip().splitlines()[-1] == str(tokens.tolist())


def test_executorch_decode_keeps_the_cache_as_program_state_unless_switched_off(tmp_path):
    """The cache's keys and values stay inside the program (no copy in or out per step, and not
    returned either); a caller passing them is refused rather than ignored;
    ``cache_in_program=False`` feeds them again."""
    from hfexport import ExecutorchConfig, HfExportError
    from hfexport.targets.executorch.runner import ExecutorchRunner

    model = build("tiny-llama")
    prompt = sample_inputs(model, 1, 6)
    export = export_folder(model, prompt, ExecutorchConfig(dynamic=True), tmp_path / "state")
    decode_kwargs = decompose_for_generation(model, prompt, STATIC, multi_token_decode=True)["decode"][1]
    spec = export.manifest.component("decode")
    runner = ExecutorchRunner(tmp_path / "state" / spec.file, spec)
    assert runner.method.metadata.num_inputs() == 2 + 3  # two counters, ids, positions, mask
    # nor does the cache the model returns leave the program: the logits and the counters do
    assert sorted(o.path for o in spec.outputs if o.kind == "state") == sorted(
        f"cache.layers.{i}.{leaf}" for i in range(2) for leaf in ("keys", "values")
    )
    assert runner.method.metadata.num_outputs() == len(spec.returned) == 2 + 1 + 2
    with pytest.raises(HfExportError, match="keeps cache.layers.0.keys, .* inside as its state"):
        runner.run(decode_kwargs)

    export = export_folder(model, prompt, ExecutorchConfig(dynamic=True, cache_in_program=False), tmp_path / "in")
    spec = export.manifest.component("decode")
    assert not any(i.state for i in spec.inputs)
    assert len([o for o in spec.outputs if o.kind == "write_back"]) == 6
    decoder = export.decoder(batch_size=1)
    tokens = greedy_decode(decoder, prompt["input_ids"], 16, decoder.max_cache_len)
    assert torch.equal(tokens, reference_tokens(model, prompt))


def test_a_failing_component_is_named(monkeypatch):
    from hfexport import HfExportError

    model = build("tiny-llama")
    original = DynamoExporter.run

    def fail_on_decode(self, module, kwargs, config=None, *args, **options):
        if kwargs["input_ids"].shape[1] == 1:
            raise RuntimeError("boom")
        return original(self, module, kwargs, config, *args, **options)

    monkeypatch.setattr(DynamoExporter, "run", fail_on_decode)
    with pytest.raises(HfExportError, match="component 'decode' failed: RuntimeError: boom"):
        DynamoExporter().export_for_generation(model, sample_inputs(model, 2, 6), DynamoConfig(dynamic=True))


def test_mark_cache_mutations_records_the_static_cache_writes(tmp_path):
    import json

    model = build("tiny-llama")
    programs = DynamoExporter().export_for_generation(
        model,
        sample_inputs(model, 2, 6),
        DynamoConfig(dynamic=True, dump_dir=tmp_path),
        STATIC,
        multi_token_decode=True,
    )
    mutations = programs["decode"].graph_module.meta["hfexport.cache_mutations"]
    assert mutations == sorted(
        f"cache.layers.{i}.{leaf}" for i in range(2) for leaf in ("keys", "values", "cumulative_length")
    )
    dumped = json.loads(next((tmp_path / "decode").rglob("cache_mutations.json")).read_text())
    assert set(dumped) == set(mutations)
    assert "mutated_inputs=6" in (tmp_path / "decode" / "report.md").read_text()
    # the static cache's heads, length and head size are captured static, its batch axis dynamic
    from hfexport.pipeline.io_names import user_input_names

    paths = user_input_names(programs["decode"])
    shapes = [
        node.meta["val"].shape
        for node in programs["decode"].graph.nodes
        if node.op == "placeholder" and paths.get(node.name, "").endswith(("keys", "values"))
    ]
    assert len(shapes) == 4
    for batch, *rest in shapes:
        assert isinstance(batch, torch.SymInt) and all(type(size) is int for size in rest), (batch, rest)


@pytest.mark.parametrize("kind", ["bart", "t5", "whisper"])
def test_encoder_decoder_components_match_eager_on_dynamo_and_onnx(kind):
    from models import build_encoder_decoder

    from hfexport import OnnxConfig, OnnxExporter

    model, inputs = build_encoder_decoder(kind)
    components = decompose_for_generation(model, inputs)
    assert list(components) == ["encoder", "prefill", "decode"]
    assert components["encoder"][0] is model.get_encoder()
    # verify=True checks each component against its eager submodule on the captured kwargs
    # (ONNX: in a real ONNX Runtime session), failing above 1e-4
    for exporter, config in [
        (DynamoExporter(), DynamoConfig(dynamic=True, verify=True)),
        (OnnxExporter(), OnnxConfig(dynamic=True, verify=True)),
    ]:
        programs = exporter.export_for_generation(model, inputs, config)
        assert list(programs) == ["encoder", "prefill", "decode"]


def test_encoder_decoder_static_prefill_takes_another_source_length():
    # generate sizes the static cross-attention cache to the sample's source length (an int); the
    # prefill's cross-attention layers take their length from the encoder states instead
    from models import build_encoder_decoder

    from hfexport.models.static_layers import EncoderLengthStaticLayer

    model, inputs = build_encoder_decoder("t5")
    programs = DynamoExporter().export_for_generation(model, inputs, DynamoConfig(dynamic=True, verify=True), STATIC)
    longer = {"input_ids": torch.randint(3, 128, (3, 11)), "attention_mask": torch.ones(3, 11, dtype=torch.long)}
    longer["attention_mask"][0, 8:] = 0
    _, prefill = decompose_for_generation(model, longer, STATIC)["prefill"]
    assert all(isinstance(layer, EncoderLengthStaticLayer) for layer in prefill["cache"].cross_attention_cache.layers)
    with torch.no_grad():
        expected = model(**copy.deepcopy(prefill)).logits
        got = programs["prefill"].module()(**copy.deepcopy(prefill)).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


# the encoder-decoder components run on Dynamo and ONNX above in make test; their ExecuTorch
# lowerings take about a minute each: make test-all, to keep make test under 30 minutes
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) for k in ("bart", "t5", "whisper")])
def test_encoder_decoder_components_match_eager_on_executorch(kind):
    from models import build_encoder_decoder

    from hfexport import ExecutorchConfig, ExecutorchExporter

    model, inputs = build_encoder_decoder(kind)
    # no bound given: T5 has no length limit (the default bound), Whisper max_target_positions
    config = ExecutorchConfig(dynamic=True, verify=True)
    programs = ExecutorchExporter().export_for_generation(model, inputs, config)
    assert list(programs) == ["encoder", "prefill", "decode"]


@pytest.mark.slow  # 70 s: make test-all
def test_mamba_prefill_and_decode_with_its_recurrent_state_as_cache(caplog):
    from models import build_mamba

    from hfexport import ExecutorchConfig, ExecutorchExporter, OnnxConfig, OnnxExporter

    model, inputs = build_mamba()
    components = decompose_for_generation(model, inputs)
    assert set(components) == {"prefill", "decode"}
    _, decode = components["decode"]
    assert decode["cache"].layers[0].conv_states  # the recurrent state is the cache
    # Mamba masks this call's tokens only and generate passes none after the prompt: a [2, 7] mask
    # would broadcast the one new token to seven
    assert "attention_mask" not in decode

    # the command line's default (static cache, multi-token decode): Mamba's forward restarts from a
    # zero state for several tokens, so the decode graph takes one token per step
    caplog.set_level(logging.WARNING, logger="hfexport")
    decode = decompose_for_generation(model, inputs, STATIC, multi_token_decode=True)["decode"][1]
    assert decode["input_ids"].shape == (2, 1)
    assert "MambaForCausalLM's decode cannot take several new tokens at once" in caplog.text
    for exporter, config, generation in [
        (DynamoExporter(), DynamoConfig(dynamic=True, verify=True), (None, False)),
        (OnnxExporter(), OnnxConfig(dynamic=True, verify=True), (STATIC, True)),
        # no length limit in Mamba's config: the default bound
        (ExecutorchExporter(), ExecutorchConfig(dynamic=True, verify=True), (STATIC, True)),
    ]:
        assert set(exporter.export_for_generation(model, inputs, config, *generation)) == {"prefill", "decode"}
    # so the command line's default keeps its prefill, which a one-token decode cannot replace
    from hfexport import run_for_generation

    kept = run_for_generation(model, inputs, [DynamoConfig(dynamic=True)], STATIC, True, skip_unused_prefill=True)
    assert set(kept) == {"prefill", "decode"}


@pytest.mark.slow  # 80 s: make test-all (as Qwen2-VL's below, 60 s), to keep make test under 30 minutes
def test_llava_components_include_the_image_encoder_and_projector():
    from models import build_llava

    from hfexport import ExecutorchConfig, ExecutorchExporter, OnnxConfig, OnnxExporter

    model, inputs = build_llava()
    components = decompose_for_generation(model, inputs)
    assert list(components) == ["image_encoder", "multi_modal_projector", "language_model", "lm_head", "decode"]
    assert components["image_encoder"][0] is model.get_encoder(modality="image")
    assert components["multi_modal_projector"][0] is model.model.multi_modal_projector
    assert components["image_encoder"][1]["pixel_values"].shape == (1, 3, 28, 28)
    for exporter, config in [
        (DynamoExporter(), DynamoConfig(dynamic=True, verify=True)),
        (OnnxExporter(), OnnxConfig(dynamic=True, verify=True)),
        # the CLIP vision tower's config has no length limit: the default bound
        (ExecutorchExporter(), ExecutorchConfig(dynamic=True, verify=True)),
    ]:
        programs = exporter.export_for_generation(model, inputs, config)
        assert list(programs) == list(components)


@pytest.mark.slow
def test_qwen2_vl_components_have_an_image_encoder_and_no_separate_projector():
    from models import build_qwen2_vl
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    from hfexport import ExecutorchConfig, OnnxConfig, run_for_generation
    from hfexport.models.vision import VisionEncoderWithIndices

    model, inputs = build_qwen2_vl()
    components = decompose_for_generation(model, inputs)
    assert list(components) == ["image_encoder", "language_model", "lm_head", "decode"]
    encoder, kwargs = components["image_encoder"]
    # the indices Qwen2-VL derives from grid_thw with .tolist() are inputs, as transformers computes them
    assert isinstance(encoder, VisionEncoderWithIndices) and encoder.encoder is model.get_encoder(modality="image")
    assert set(kwargs) == {"hidden_states", "grid_thw", "position_ids", "cu_seqlens"}
    grid = inputs["image_grid_thw"]
    assert torch.equal(kwargs["position_ids"], get_vision_position_ids(grid, 2))
    assert torch.equal(kwargs["cu_seqlens"], get_vision_cu_seqlens(grid))
    assert components["language_model"][1]["inputs_embeds"].shape[1] == inputs["input_ids"].shape[1]

    # dynamic=True alone, one capture per component for the three targets: the patch width
    # (3 x 2 x 14 x 14) stays static, the patch count dynamic; verify: each within 1e-4 of eager
    configs = [config(dynamic=True, verify=True) for config in (DynamoConfig, OnnxConfig, ExecutorchConfig)]
    results = run_for_generation(model, inputs, configs)
    assert list(results) == list(components)
    axes = {(a.input, a.axis): a.dynamic for a in results["image_encoder"]["onnx"].input_axes}
    assert axes[("hidden_states", 0)] and not axes[("hidden_states", 1)]
    assert all(set(by_target) == {"dynamo", "onnx", "executorch"} for by_target in results.values())


def test_sliding_window_that_never_fills_exports_with_the_default_dynamic_cache():
    # Mistral's default window (4096) is never reached: its dynamic sliding layers start with an int
    # token counter, which torch.export wraps while tracing the empty prefill cache
    model = build("tiny-mistral")
    assert model.config.sliding_window == 4096
    programs = DynamoExporter().export_for_generation(
        model, sample_inputs(model, 2, 6), DynamoConfig(dynamic=True, verify=True)
    )
    assert set(programs) == {"prefill", "decode"}
    prompt = sample_inputs(model, 3, 9, seed=2)
    with torch.no_grad():
        cache = model(**prompt).cache
        step = {
            "input_ids": sample_inputs(model, 3, 1, seed=5)["input_ids"],
            "attention_mask": torch.ones(3, 10, dtype=torch.long),
            "position_ids": torch.full((3, 1), 9),
        }
        expected = model(**step, past_key_values=copy.deepcopy(cache)).logits
        got = programs["decode"].module()(**step, cache=copy.deepcopy(cache)).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_export_for_generation_runs_the_exporter_it_is_called_on():
    class OnlyDeadCodeElimination(DynamoExporter):
        def pass_list(self, config):
            return ["dead_code_elimination"]

    model = build("tiny-llama")
    programs = OnlyDeadCodeElimination().export_for_generation(
        model, sample_inputs(model, 2, 6), DynamoConfig(dynamic=True)
    )
    decode = programs["decode"]
    assert "hfexport.cache_mutations" not in decode.graph_module.meta  # mark_cache_mutations did not run
    assert any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in decode.graph.nodes)


def test_a_decode_graph_fixed_at_the_merged_tokens_is_exported_for_one_token(tmp_path, hfexport_logs):
    # a decode captured from two merged steps that came out taking exactly two tokens (a static
    # export here; MiniMax's code fixes the length in a dynamic one) could run in no loop: the
    # folder was refused ("takes exactly 2 query tokens"); the decode is exported from one step
    from hfexport import ExportFolder, run_for_generation, save_export

    model = build("tiny-llama")
    prompt = sample_inputs(model, 1, 6)
    results = run_for_generation(model, prompt, [DynamoConfig()], STATIC, multi_token_decode=True)
    assert "exporting it for one token per step" in hfexport_logs.text
    save_export(tmp_path, {name: by_target["dynamo"] for name, by_target in results.items()})
    decoder = ExportFolder(tmp_path).decoder(batch_size=1)
    got = greedy_decode(decoder, prompt["input_ids"], 10, decoder.max_cache_len)
    assert torch.equal(got, reference_tokens(model, prompt, 10)), got


def test_a_decode_graph_of_one_token_takes_the_prompt_token_by_token(tmp_path):
    # exported for one new token per step (static shapes): the decoder was refused ("takes
    # exactly 1 query tokens"); one token is what the prompt can be fed as, one call per token
    from hfexport import ExportFolder, run_for_generation, save_export

    model = build("tiny-llama")
    prompt = sample_inputs(model, 1, 6)
    results = run_for_generation(model, prompt, [DynamoConfig()], STATIC)
    save_export(tmp_path, {name: by_target["dynamo"] for name, by_target in results.items()})
    decoder = ExportFolder(tmp_path).decoder(batch_size=1)
    got = greedy_decode(decoder, prompt["input_ids"], 10, decoder.max_cache_len)
    expected = reference_tokens(model, prompt, 10)
    assert torch.equal(got, expected), (got, expected)


def _recurrent_export(tmp_path, model_type):
    from hfexport import run_for_generation, save_export
    from hfexport.models.tiny import build_tiny

    model = build_tiny(model_type).eval()
    prompt = {"input_ids": torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))}
    results = run_for_generation(model, prompt, [DynamoConfig(dynamic=True)], STATIC, multi_token_decode=True)
    save_export(tmp_path, {name: by_target["dynamo"] for name, by_target in results.items()})
    return model, prompt


def test_a_recurrent_model_generates_eagers_tokens_and_loads_in_a_fresh_process(tmp_path):
    # the decode loops ran attention caches only and refused the folder ("carries a recurrent
    # state"); the recurrent loop runs the prefill, then feeds the decode its states back by path.
    # Mamba's output class is a pytree node once its modeling module is imported, which a fresh
    # process had not done: "Deserializing ... MambaCausalLMOutput in pytree is not registered"
    import subprocess
    import sys

    from hfexport import ExportFolder

    model, prompt = _recurrent_export(tmp_path, "mamba")
    decoder = ExportFolder(tmp_path).decoder(batch_size=1)
    got = greedy_decode(decoder, prompt["input_ids"], 8, decoder.max_cache_len)
    assert torch.equal(got, reference_tokens(model, prompt, 8)), got
    load = "from hfexport.targets.dynamo import load_exported_program as load; load(__import__('sys').argv[1])"
    result = subprocess.run([sys.executable, "-c", load, str(tmp_path / "decode.pt2")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_model_whose_generate_fails_with_a_static_cache_is_one_line(tmp_path):
    # CPM-Ant adds 32 prompt ids of its own: generate overflowed the cache with an IndexError
    import subprocess
    import sys

    from hfexport.models.tiny import build_tiny

    build_tiny("cpmant").save_pretrained(tmp_path / "cpmant")
    command = ["export", str(tmp_path / "cpmant"), "--generation", "--format", "dynamo", "--out", str(tmp_path / "out")]
    done = subprocess.run(
        [sys.executable, "-m", "hfexport.cli", *command, "--max-cache-len", "32"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert "generate failed on the sample prompt with the static cache of 32 tokens" in done.stderr
    assert "rerun with --debug" not in done.stderr


def test_recording_the_components_runs_the_model_five_times_and_reuses_what_generate_returned():
    # generate's three calls (the prompt, two steps), the causal-prompt check's one (both prompts
    # as one batch) and the merged step's one: the single steps' logits and whether a cache came
    # back are generate's own (each forward of a bfloat16 checkpoint exported in float32 casts
    # every weight again)
    model = build("tiny-llama")
    inputs = sample_inputs(model)
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        components = decompose_for_generation(model, inputs, STATIC, multi_token_decode=True)
    finally:
        handle.remove()
    assert len(calls) == 5
    assert components["decode"][1]["input_ids"].shape[1] == 2  # the two steps merged: the check passed


def test_a_model_returning_no_cache_is_refused_by_name():
    # BertGenerationDecoder with is_decoder=False attends both ways and returns no cache, so
    # generate reruns the whole sequence; a cached decode step gave other tokens, silently
    from transformers import BertGenerationDecoder

    from hfexport import UnsupportedModelError
    from hfexport.models.tiny import tiny_config

    # the sweep builds it as its causal-LM checkpoints are (is_decoder=True): built without here
    model = BertGenerationDecoder._from_config(tiny_config("bert-generation"), attn_implementation="sdpa").eval()
    assert not model.config.is_decoder
    prompt = {"input_ids": torch.randint(0, 200, (1, 6), generator=torch.Generator().manual_seed(0))}
    with pytest.raises(UnsupportedModelError, match="returns no cache from its forward"):
        decompose_for_generation(model, prompt, STATIC, multi_token_decode=True)
    # the decoder a real checkpoint is (is_decoder in its config when built: its layers are causal): exported
    # as before. Flipping the flag on the built model leaves its layers bidirectional, which the
    # prompt-causality check refuses
    config = tiny_config("bert-generation")
    config.is_decoder = True
    decoder = type(model)._from_config(config, attn_implementation="sdpa").eval()
    assert set(decompose_for_generation(decoder, prompt, STATIC, multi_token_decode=True)) == {"prefill", "decode"}


def test_chunked_attention_generates_model_generate_tokens(tmp_path):
    # Llama 4's chunked layers: the decode loops refused their mask ("layer types
    # ['chunked_attention']"); with chunks of 4 tokens, 18 tokens span five of them, and a decode
    # without the chunk mask gives other tokens
    from transformers import AutoModelForCausalLM

    import hfexport
    from hfexport.cli import main as cli
    from hfexport.models.tiny import build_tiny

    model = build_tiny("llama4_text")
    model.config.attention_chunk_size = 4
    assert "chunked_attention" in model.config.layer_types
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    model.save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "out"
    assert cli(["export", str(tmp_path / "checkpoint"), "--generation", "--format", "dynamo", "--out", str(out)]) == 0
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval()
    expected = reference.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    assert len(set(expected)) >= 3
    assert list(hfexport.load(out).generate(ids[0].tolist(), 12).tokens) == expected


def test_a_hybrid_with_4d_recurrent_states_decodes_over_its_cache_length(tmp_path):
    # Nemotron-H's Mamba-2 states are 4-D beside the keys and values, 64 on axis 2 against a cache
    # of 32: the decoders took 64 for the cache length and built masks the program refused
    # ("Guard failed: attention_mask['full_attention'].size()[3] == 32"; ONNX Runtime's Add, ExecuTorch's bound)
    from hfexport import ExportFolder, run_for_generation, save_export
    from hfexport.models.tiny import build_tiny

    model = build_tiny("nemotron_h").eval()
    prompt = {"input_ids": torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))}
    results = run_for_generation(model, prompt, [DynamoConfig(dynamic=True)], STATIC, multi_token_decode=True)
    save_export(tmp_path, {name: by_target["dynamo"] for name, by_target in results.items()})
    decoder = ExportFolder(tmp_path).decoder(batch_size=1)
    assert decoder.max_cache_len == STATIC.max_cache_len
    got = greedy_decode(decoder, prompt["input_ids"], 8, decoder.max_cache_len)
    assert torch.equal(got, reference_tokens(model, prompt, 8)), got


def _padded_prompts() -> dict:
    """Two prompts of 7 and 5 tokens, the second left-padded."""
    return {
        "input_ids": torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(1)),
        "attention_mask": torch.tensor([[1] * 7, [0, 0] + [1] * 5]),
    }


def test_a_decoder_without_a_cache_generates_a_padded_batch(tmp_path):
    # GPT-1 has no cache: its decode graph takes the whole sequence, with the loop's mask and
    # positions (left padding included), as generate runs it
    from hfexport import ExportFolder, run_for_generation, save_export
    from hfexport.generation import WholeSequenceDecoder
    from hfexport.models.tiny import build_tiny

    model = build_tiny("openai-gpt").eval()
    prompt = {"input_ids": torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))}
    results = run_for_generation(model, prompt, [DynamoConfig(dynamic=True)], STATIC)
    assert set(results) == {"decode"}
    save_export(tmp_path, {"decode": results["decode"]["dynamo"]}, generation={"max_cache_len": 32})
    decoder = ExportFolder(tmp_path).decoder(batch_size=2)
    assert isinstance(decoder, WholeSequenceDecoder) and decoder.max_cache_len == 32
    padded = _padded_prompts()
    got = greedy_decode(decoder, padded["input_ids"], 10, decoder.max_cache_len, padded["attention_mask"])
    assert torch.equal(got, reference_tokens(model, padded, 10)), got


def test_a_model_making_its_masks_from_a_2d_one_generates_a_padded_batch(tmp_path):
    # BLOOM builds its ALiBi bias from a 2-D mask that generate pads to the static cache's length:
    # the prefill graph got the prompt's own mask, and capture failed ("The expanded size of the
    # tensor (32) must match the existing size (8)"); the decode loops built 4-D masks only
    from hfexport import ExportFolder, run_for_generation, save_export
    from hfexport.models.tiny import build_tiny

    model = build_tiny("bloom").eval()
    prompt = {"input_ids": torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))}
    results = run_for_generation(model, prompt, [DynamoConfig(dynamic=True)], STATIC, multi_token_decode=True)
    save_export(tmp_path, {name: by_target["dynamo"] for name, by_target in results.items()})
    decoder = ExportFolder(tmp_path).decoder(batch_size=2)
    padded = _padded_prompts()
    got = greedy_decode(decoder, padded["input_ids"], 10, decoder.max_cache_len, padded["attention_mask"])
    expected = model.generate(**padded, max_new_tokens=10, min_new_tokens=10, do_sample=False, generation_config=STATIC)
    assert torch.equal(got, expected), (got, expected)


def test_a_vision_encoder_naming_its_patches_pixel_values_is_wrapped_with_its_indices():
    # MiniMax-M3-VL's vision tower calls its patches pixel_values (Qwen2-VL's: hidden_states): the
    # image encoder's recorded inputs did not fit the wrapper that takes the rotary positions and
    # image boundaries as inputs ("VisionEncoderWithIndices.forward has no parameter 'pixel_values'")
    from hfexport.models.samples import config_sample_inputs
    from hfexport.models.tiny import build_tiny

    model = build_tiny("minimax_m3_vl").eval()
    sample = config_sample_inputs(model, batch=1)
    encoder, kwargs = decompose_for_generation(model, sample, STATIC)["image_encoder"]
    with torch.no_grad():
        wrapped = encoder(**kwargs).last_hidden_state
        own = encoder.encoder(sample["pixel_values"], sample["image_grid_thw"]).last_hidden_state
    assert torch.equal(wrapped, own)


def test_generate_failing_with_a_static_cache_is_one_line(tmp_path, capsys):
    # T5Gemma 2's generate fails with a static cache on an image prompt (its decoder finds no
    # cross-attention mask): transformers' bare TypeError reached the user
    from hfexport.cli import main as cli
    from hfexport.models.tiny import build_tiny

    build_tiny("t5gemma2").save_pretrained(tmp_path / "checkpoint")
    code = cli(
        ["export", str(tmp_path / "checkpoint"), "--generation", "--format", "dynamo", "--out", str(tmp_path / "out")]
    )
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hfexport: error")]
    assert code != 0 and len(errors) == 1, errors
    assert "generate failed on the sample prompt with the static cache" in errors[0], errors
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_vision_encoder_attending_in_windows_takes_its_window_indices_as_inputs():
    # Qwen2.5-VL's vision tower also orders its patches into windows from grid_thw with a Python loop
    # (get_vision_window_index): traced, "Could not extract specialized integer from data-dependent
    # expression" stopped the image encoder's export (Qwen2.5-VL, EXAONE 4.5, HyperCLOVA X Vision V2)
    from hfexport.models.samples import config_sample_inputs
    from hfexport.models.tiny import build_tiny

    model = build_tiny("qwen2_5_vl").eval()
    sample = config_sample_inputs(model, batch=1)
    encoder, kwargs = decompose_for_generation(model, sample, STATIC)["image_encoder"]
    assert {"window_index", "cu_window_seqlens"} <= set(kwargs)
    program = DynamoExporter().export(encoder, kwargs, DynamoConfig(dynamic=True))
    with torch.no_grad():
        got = program.module()(**kwargs).pooler_output
        own = encoder.encoder(sample["pixel_values"], sample["image_grid_thw"]).pooler_output
    torch.testing.assert_close(got, own, atol=1e-5, rtol=0)


def test_sampling_keeps_the_tokens_transformers_warpers_keep_and_repeats_with_a_seed():
    """``Sampling`` draws among the tokens transformers' temperature, top-k and top-p warpers
    leave, repeatably for one seed; top_k=1 is the argmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from hfexport import Sampling

    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in ((0.7, 10, None), (1.3, None, 0.8), (0.9, 20, 0.6)):
        scores = TemperatureLogitsWarper(temperature)(None, logits[:, -1].clone())
        if top_k is not None:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p is not None:
            scores = TopPLogitsWarper(top_p)(None, scores)
        allowed = torch.isfinite(scores)
        sampling = Sampling(temperature, top_k, top_p, seed=1)
        drawn = torch.cat([sampling(logits) for _ in range(200)], dim=1)
        assert allowed.gather(1, drawn).all()  # never a token the warpers drop
        assert any(len(set(row.tolist())) > 1 for row in drawn)  # a draw, not the argmax
        again = Sampling(temperature, top_k, top_p, seed=1)
        assert torch.equal(torch.cat([again(logits) for _ in range(200)], dim=1), drawn)
    assert torch.equal(Sampling(2.0, top_k=1)(logits), logits[:, -1].argmax(-1, keepdim=True))
    with pytest.raises(Exception, match="top_p"):
        Sampling(1.0, top_p=1.5)


def test_generate_samples_from_the_command_line_repeatably_and_takes_several_prompts(tmp_path, capsys):
    from hfexport.cli import main

    out = tmp_path / "out"
    assert main(["export", "tiny-llama", "--format", "onnx", "--generation", "--out", str(out)]) == 0
    generate = ["generate", str(out), "--prompt-ids", "5,6,7", "--max-new-tokens", "8"]
    answers = []
    for flags in (["--temperature", "0.9", "--seed", "1"], ["--temperature", "0.9", "--seed", "1"], []):
        capsys.readouterr()
        assert main([*generate, *flags]) == 0
        answers.append(capsys.readouterr().out.strip())
    assert answers[0] == answers[1] != answers[2]
    assert main([*generate, "--top-k", "3"]) == 2  # sampling flags without a temperature
    assert "--temperature" in capsys.readouterr().err
