"""Built-in tiny random models (no download): for the command line, the demo, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Preset:
    """A tiny model: a transformers config class name, its kwargs, and the model class."""

    config_class: str
    config_kwargs: dict[str, Any]
    model_class: str

    def build_config(self, **overrides: Any) -> Any:
        import transformers

        return getattr(transformers, self.config_class)(**{**self.config_kwargs, **overrides})

    def build(self, seed: int = 0, **overrides: Any) -> torch.nn.Module:
        """A randomly initialised model in eval mode (same weights for the same seed)."""
        import transformers

        torch.manual_seed(seed)
        config = self.build_config(**overrides)
        config._attn_implementation = "sdpa"
        return getattr(transformers, self.model_class)(config).eval()


# the shape of every tiny decoder-only preset (2 layers, hidden 64)
TINY_DECODER = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("LlamaConfig", TINY_DECODER, "LlamaForCausalLM"),
    "tiny-qwen3": Preset("Qwen3Config", {**TINY_DECODER, "head_dim": 16}, "Qwen3ForCausalLM"),
    "tiny-qwen3-moe": Preset(
        "Qwen3MoeConfig",
        {**TINY_DECODER, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
        "Qwen3MoeForCausalLM",
    ),
    "tiny-mistral": Preset("MistralConfig", TINY_DECODER, "MistralForCausalLM"),
    "tiny-phi3": Preset("Phi3Config", {**TINY_DECODER, "num_key_value_heads": 4, "pad_token_id": 0}, "Phi3ForCausalLM"),
    "tiny-gemma3": Preset(
        "Gemma3TextConfig",
        {**TINY_DECODER, "head_dim": 16, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        "Gemma3ForCausalLM",
    ),
    "tiny-gpt2": Preset(
        "GPT2Config",
        {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
        "GPT2LMHeadModel",
    ),
    "tiny-bert": Preset(
        "BertConfig",
        {
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 512,
        },
        "BertModel",
    ),
}


def sample_inputs(model: torch.nn.Module, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids in the model's vocabulary and an all-ones attention mask."""
    generator = torch.Generator().manual_seed(seed)
    vocab = int(getattr(model.config, "vocab_size", 128))
    return {
        "input_ids": torch.randint(0, vocab, (batch, seq), generator=generator),
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
    }
