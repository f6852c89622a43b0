"""Tiny random models for tests (no downloads): the library's presets plus test helpers."""

from __future__ import annotations

import torch

from hfexport.presets import PRESETS, sample_inputs

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
