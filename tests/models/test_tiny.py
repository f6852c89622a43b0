"""Tiny random models of any architecture (hfexport.models.tiny) and config-driven sample inputs
(hfexport.models.samples): the configs keep their invariants, a fixed set of types builds and runs
eagerly at two sample shapes."""

from __future__ import annotations

import pytest
import torch

from hfexport.models.samples import config_sample_inputs
from hfexport.models.tiny import build_tiny, model_class, model_kind, shrink_config_dict, tiny_config
from tests.models import build

TYPES = {
    # type: (class, kind, inputs the sample must hold)
    "llama": ("LlamaForCausalLM", "decoder LM", {"input_ids", "attention_mask"}),
    "bert": ("BertForSequenceClassification", "encoder", {"input_ids", "attention_mask", "token_type_ids"}),
    "vit": ("ViTForImageClassification", "vision", {"pixel_values"}),
    "convnext": ("ConvNextForImageClassification", "vision", {"pixel_values"}),
    "clip": ("CLIPModel", "multimodal", {"input_ids", "pixel_values"}),
    "whisper": ("WhisperForConditionalGeneration", "audio", {"input_features", "decoder_input_ids"}),
    "t5": ("T5ForConditionalGeneration", "encoder-decoder", {"input_ids", "decoder_input_ids"}),
    "hubert": ("HubertForCTC", "audio", {"input_values"}),
    "mamba": ("MambaForCausalLM", "SSM / hybrid", {"input_ids"}),
    "llava": ("LlavaForConditionalGeneration", "multimodal", {"input_ids", "pixel_values"}),
}


@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_tiny_model_runs_at_two_shapes(model_type):
    cls, kind, names = TYPES[model_type]
    model = build_tiny(model_type)
    assert type(model).__name__ == cls and not model.training
    assert model_kind(model, model_class(model_type)[0]) == kind
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    first = config_sample_inputs(model)
    second = config_sample_inputs(model, batch=3, seq=12, seed=1)
    assert names <= set(first) and set(first) == set(second)
    with torch.no_grad():
        out1, out2 = model(**first), model(**second)
    main1, main2 = out1[0], out2[0]
    assert main1.shape[0] == 2 and main2.shape[0] == 3
    assert torch.isfinite(main1).all() and torch.isfinite(main2).all()
    # the same seed gives the same inputs; text scales with seq
    again = config_sample_inputs(model)
    assert all(torch.equal(first[k], again[k]) for k in first)
    if "input_ids" in first and "pixel_values" not in first:
        assert first["input_ids"].shape == (2, 8) and second["input_ids"].shape == (3, 12)


def test_tiny_configs_keep_their_invariants():
    for model_type in ("llama", "qwen3", "gemma3", "mistral", "bert", "swin", "qwen2_vl", "jamba", "whisper", "vit"):
        config = tiny_config(model_type)
        for sub in [config, *(getattr(config, k) for k in vars(config) if k.endswith("_config"))]:
            if sub is None or not hasattr(sub, "to_dict"):
                continue
            hidden, heads = getattr(sub, "hidden_size", None), getattr(sub, "num_attention_heads", None)
            if isinstance(hidden, int) and isinstance(heads, int):
                assert hidden <= 64 and hidden % heads == 0, model_type
            kv = getattr(sub, "num_key_value_heads", None)
            if isinstance(kv, int) and isinstance(heads, int):
                assert heads % kv == 0, model_type
            layers = getattr(sub, "num_hidden_layers", None)
            types = getattr(sub, "layer_types", None)
            if isinstance(layers, int) and isinstance(types, list):
                assert len(types) == layers <= 4, model_type
            vocab = getattr(sub, "vocab_size", None)
            if isinstance(vocab, int):
                assert vocab <= 256
            image, patch = getattr(sub, "image_size", None), getattr(sub, "patch_size", None)
            if isinstance(image, int) and isinstance(patch, int):
                assert image % patch == 0 and image <= 128, model_type
    # Gemma 3 keeps a sliding and a full attention layer; special ids lie in the vocabulary
    gemma = tiny_config("gemma3").text_config
    assert set(gemma.layer_types) == {"sliding_attention", "full_attention"}
    qwen = tiny_config("qwen2_vl")
    assert qwen.image_token_id < qwen.text_config.vocab_size
    section = qwen.text_config.rope_parameters["mrope_section"]
    assert sum(section) == qwen.text_config.hidden_size // qwen.text_config.num_attention_heads // 2


def test_shrink_rules():
    shrunk = shrink_config_dict(
        {
            "model_type": "x",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 6,
            "layer_types": ["a", "a", "b", "a", "a", "b"],
            "vocab_size": 50000,
            "eos_token_id": 49999,
            "pad_token_id": 0,
            "depths_of_nothing": 7,
            "hidden_sizes": [96, 192, 384, 768],
            "num_heads": [3, 6, 12, 24],
        }
    )
    assert shrunk["hidden_size"] == 64 and shrunk["num_attention_heads"] == 4 and shrunk["num_key_value_heads"] == 2
    assert shrunk["num_hidden_layers"] == 2 and shrunk["layer_types"] == ["a", "b"]
    assert shrunk["vocab_size"] == 256 and shrunk["eos_token_id"] == 255 and shrunk["pad_token_id"] == 0
    assert shrunk["hidden_sizes"] == [16, 32, 64, 128] and shrunk["num_heads"] == [1, 2, 4, 8]


def test_a_word_as_long_as_the_layer_count_is_not_cut_as_a_layer_pattern():
    # a string with one character per layer was cut with the layers: BigBird's attention_type
    # "block_sparse" (12 layers) became "bloc" (build_error), Mimi's pad_mode "constant" "cons"
    shrunk = shrink_config_dict(
        {
            "model_type": "x",
            "num_hidden_layers": 8,
            "pad_mode": "constant",
            "hidden_act": "gelu_new",
        }
    )
    assert shrunk["num_hidden_layers"] == 2
    assert shrunk["pad_mode"] == "constant" and shrunk["hidden_act"] == "gelu_new"
    assert tiny_config("big_bird").attention_type == "block_sparse"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bert"])
def test_presets_get_text_inputs(name):
    model = build(name)
    inputs = config_sample_inputs(model, batch=2, seq=8)
    expected = {"input_ids", "attention_mask"} | ({"token_type_ids"} if name == "tiny-bert" else set())
    assert set(inputs) == expected
    assert inputs["input_ids"].shape == (2, 8) and int(inputs["input_ids"].max()) < model.config.vocab_size
    if name == "tiny-bert":  # a sentence pair: two segments
        assert inputs["token_type_ids"][:, :4].eq(0).all() and inputs["token_type_ids"][:, 4:].eq(1).all()


def test_no_weight_matrix_is_all_zero():
    # AFMoE initialises its router's gate to zero: every expert tied, and torch and ONNX Runtime
    # break a top-k tie differently (a 0.19 ONNX "mismatch" no trained checkpoint shows)
    model = build_tiny("afmoe")
    zero = [name for name, p in model.named_parameters() if p.dim() >= 2 and not p.any()]
    assert not zero, zero


def test_a_one_channel_waveform_model_gets_a_channel_axis():
    # PE-Audio's encoder reads (batch, 1, samples): a (batch, samples) waveform was taken as two channels
    model = build_tiny("pe_audio_encoder")
    inputs = config_sample_inputs(model)
    assert inputs["input_values"].shape[1] == 1
    with torch.no_grad():
        model(**inputs)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "codegen", "qwen2_5_vl_text"])
def test_shrunk_rotary_sizes_fit_the_shrunk_head(model_type):
    # each failed eagerly: MLA's head_dim (equal to qk_rope_head_dim) shrunk apart from it;
    # CodeGen's rotary_dim 64 over a 16-wide head; Qwen2.5-VL's text model defaulting its rotary
    # sections to the original head's [16, 24, 24]
    model = build_tiny(model_type)
    with torch.no_grad():
        model(**config_sample_inputs(model))


def test_a_video_model_gets_frames():
    # ViViT reads (batch, frames, channels, height, width): a 4-D image batch failed to unpack
    model = build_tiny("vivit")
    inputs = config_sample_inputs(model)
    assert inputs["pixel_values"].dim() == 5
    with torch.no_grad():
        model(**inputs)


def test_a_bert_style_causal_lm_is_built_as_a_decoder():
    # BertGenerationDecoder attends both ways unless config.is_decoder (its causal-LM checkpoints set
    # it): built without, it returned no cache and its generation export was refused
    decoder = build_tiny("bert-generation")
    assert decoder.config.is_decoder
    ids = torch.randint(5, 50, (1, 6))
    changed = ids.clone()
    changed[0, -1] = 51
    with torch.no_grad():  # causal: a later token does not change earlier logits
        torch.testing.assert_close(decoder(changed).logits[0, :-1], decoder(ids).logits[0, :-1])
    assert not build_tiny("gpt_neox").config.is_decoder  # declares the flag, but attends causally anyway


def test_kosmos_2_5_gets_its_image_as_flattened_patches_where_its_mask_marks():
    model = build_tiny("kosmos-2.5")
    inputs = config_sample_inputs(model)
    marked = inputs["image_embeds_position_mask"]
    assert int(marked[0].sum()) == model.config.latent_query_num == 8
    assert inputs["flattened_patches"].shape[:2] == (2, 16)
    other = {**inputs, "flattened_patches": inputs["flattened_patches"].clone()}
    other["flattened_patches"][:, :, 2:] += 1.0
    with torch.no_grad():  # the image reaches the logits
        assert not torch.allclose(model(**inputs).logits, model(**other).logits)
