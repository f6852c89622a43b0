"""Tiny random models for tests (no downloads): the library's presets plus test helpers."""

from __future__ import annotations

import torch

from hfexport.presets import PRESETS, TINY_DECODER, sample_inputs

__all__ = ["PRESETS", "build", "eager", "sample_inputs"]


def build(name: str, **overrides) -> torch.nn.Module:
    """A tiny random model from a preset (``tiny-llama`` …), eval mode, seed 0."""
    return PRESETS[name].build(**overrides)


def eager(model: torch.nn.Module, inputs: dict) -> dict:
    with torch.no_grad():
        return model(**inputs)


def main_output(outputs) -> torch.Tensor:
    """logits for LMs, last_hidden_state for encoders."""
    return outputs["logits"] if "logits" in outputs else outputs["last_hidden_state"]


def build_encoder_decoder(kind: str) -> tuple[torch.nn.Module, dict]:
    """A tiny random Bart, T5 or Whisper and sample generate inputs."""
    import transformers

    torch.manual_seed(0)
    if kind == "whisper":
        config = transformers.WhisperConfig(
            vocab_size=128,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            num_mel_bins=16,
            max_source_positions=32,
            max_target_positions=64,
            decoder_start_token_id=1,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        )
        model = transformers.WhisperForConditionalGeneration(config)
        inputs = {"input_features": torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0))}
    elif kind == "t5":
        config = transformers.T5Config(
            vocab_size=128,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        model = transformers.T5ForConditionalGeneration(config)
    else:
        config = transformers.BartConfig(
            vocab_size=128,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
        )
        model = transformers.BartForConditionalGeneration(config)
    if kind != "whisper":  # a text prompt, above the special token ids
        inputs = {
            "input_ids": torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0)),
            "attention_mask": torch.ones(2, 7, dtype=torch.long),
        }
    config._attn_implementation = "sdpa"
    return model.eval(), inputs


def build_mamba() -> tuple[torch.nn.Module, dict]:
    """A tiny random Mamba and a sample prompt."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MambaConfig(
        vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    )
    model = transformers.MambaForCausalLM(config).eval()
    return model, {"input_ids": torch.randint(0, 128, (2, 6)), "attention_mask": torch.ones(2, 6, dtype=torch.long)}


# families whose static decode must apply a sliding window past it: (config, model class, attention)
SLIDING_WINDOW_FAMILIES = {
    # every layer slides; the mask function applies the window only to 2-D masks
    "mistral": ("MistralConfig", {"sliding_window": 4}, "MistralForCausalLM", "sdpa"),
    # sliding above max_window_layers, full below
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        "Qwen2ForCausalLM",
        "sdpa",
    ),
    # eager attention adds a float mask to the scores
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        "Gemma2ForCausalLM",
        "eager",
    ),
    "cohere2": (
        "Cohere2Config",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        "Cohere2ForCausalLM",
        "eager",
    ),
}


def build_sliding_window(family: str) -> torch.nn.Module:
    """A tiny random decoder of ``family`` (:data:`SLIDING_WINDOW_FAMILIES`) with a 4-token window."""
    import transformers

    config_class, overrides, model_class, attention = SLIDING_WINDOW_FAMILIES[family]
    config = getattr(transformers, config_class)(**{**TINY_DECODER, **overrides})
    config._attn_implementation = attention
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def build_llava() -> tuple[torch.nn.Module, dict]:
    """A tiny random LLaVA (CLIP vision tower + Llama) and a one-image prompt."""
    import transformers

    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14
    )
    text = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=100, projector_hidden_act="gelu", vision_feature_layer=-1
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    ids = torch.cat(
        [torch.full((1, 4), 100), torch.randint(0, 99, (1, 5), generator=torch.Generator().manual_seed(0))], 1
    )
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def build_qwen2_vl() -> tuple[torch.nn.Module, dict]:
    """A tiny random Qwen2-VL and a one-image prompt (a 4x4 patch grid merged into 4 tokens)."""
    import transformers

    torch.manual_seed(0)
    vision = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_chans": 3,
        "mlp_ratio": 2,
    }
    text = {**TINY_DECODER, "vocab_size": 160, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    config = transformers.Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=151,
        vision_start_token_id=152,
        vision_end_token_id=153,
        video_token_id=154,
    )
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    grid = torch.tensor([[1, 4, 4]])  # 16 patches, merged 2x2 into 4 image tokens
    text_ids = torch.randint(0, 150, (1, 5), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([torch.tensor([[152, 151, 151, 151, 151, 153]]), text_ids], 1)
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(0))
    return model, {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": pixels,
        "image_grid_thw": grid,
    }
