"""Generation with exported programs: the backend-neutral greedy decode loop over a static-cache
decode graph, and the attention masks it feeds. Each target's decoder (``hfexport.targets.*``)
supplies the ``step`` function that runs its artifact.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.errors import HfExportError


def decode_mask(valid: torch.Tensor, query_slots: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The 4-D boolean mask ``[batch, 1, queries, cache_len]`` of a static-cache decode step:
    query at cache slot ``s`` sees slot ``j`` when ``j <= s`` and ``valid[b, j]`` (written and not
    padding), and, for a sliding-window layer type, ``s - j < window``."""
    cache_len = valid.shape[-1]
    slots = torch.arange(cache_len)[None, :]
    visible = slots <= query_slots[:, None]
    if window is not None:
        visible &= slots > query_slots[:, None] - window
    return (visible[None] & valid[:, None, :].bool())[:, None]


class DecodeMasks:
    """Builds a decode graph's attention masks in the structure it was exported with: one 4-D
    ``attention_mask`` (``layer_types`` None), or one per layer type (``attention_mask.<type>``
    inputs), each layer type in ``windows`` limited to its sliding window. Raises
    :class:`~hfexport.HfExportError` up front for a layer type it cannot build."""

    def __init__(self, layer_types: list[str] | None, windows: dict[str, int]) -> None:
        unsupported = sorted(set(layer_types or ()) - {"full_attention"} - set(windows))
        if unsupported:
            raise HfExportError(
                f"the decode graph takes attention masks for layer types {unsupported}; the decode loops "
                "build full-attention masks and the sliding-window masks of windowed static layers only "
                "(export with hfexport's export_for_generation and a static cache)"
            )
        self.layer_types = layer_types
        self.windows = windows

    @classmethod
    def from_input_paths(cls, paths: list[str], windows: dict[str, int]) -> DecodeMasks:
        """From a decode graph's input keyword paths: ``attention_mask.<layer type>`` for a
        per-layer-type mask dict, else one ``attention_mask``."""
        types = [path.split(".", 1)[1] for path in paths if path.startswith("attention_mask.")]
        return cls(types or None, windows)

    def structured(self, valid: torch.Tensor, query_slots: torch.Tensor) -> Any:
        """The mask, or ``{layer type: mask}``, as the model's ``attention_mask`` argument."""
        if self.layer_types is None:
            return decode_mask(valid, query_slots)
        return {key: decode_mask(valid, query_slots, self.windows.get(key)) for key in self.layer_types}

    def by_input_path(self, valid: torch.Tensor, query_slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The masks by flat input path (``attention_mask`` or ``attention_mask.<layer type>``)."""
        masks = self.structured(valid, query_slots)
        if isinstance(masks, dict):
            return {f"attention_mask.{key}": mask.contiguous() for key, mask in masks.items()}
        return {"attention_mask": masks.contiguous()}


def greedy_decode(
    step: Any,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    max_cache_len: int,
    prompt_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
) -> torch.Tensor:
    """Greedy generation with a static-cache decode graph that takes a whole prompt and then
    one token per call.

    ``step(input_ids, valid, query_slots, position_ids) -> logits`` runs the graph and keeps its
    cache; ``valid[b, j]`` says whether cache slot ``j`` holds a real token and ``query_slots``
    are the slots the new tokens are written to (see :func:`decode_mask`). Returns
    ``[batch, prompt + new]`` token ids, like ``model.generate(do_sample=False)``: left padding
    (``prompt_mask``) is honoured and rows that produced ``eos_token_id`` are padded with
    ``pad_token_id``.
    """
    batch, prompt_len = prompt_ids.shape
    if prompt_len + max_new_tokens > max_cache_len:
        raise HfExportError(
            f"prompt ({prompt_len}) + new tokens ({max_new_tokens}) exceed the cache length {max_cache_len}"
        )
    prompt_mask = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask.long()
    valid = torch.zeros(batch, max_cache_len, dtype=torch.long)
    valid[:, :prompt_len] = prompt_mask
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    logits = step(prompt_ids, valid, torch.arange(prompt_len), positions)
    tokens = [prompt_ids]
    finished = torch.zeros(batch, dtype=torch.bool)
    next_position = positions[:, -1:] + 1
    for index in range(max_new_tokens):
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        if eos_token_id is not None:
            next_token = torch.where(finished[:, None], torch.full_like(next_token, pad_token_id), next_token)
            finished |= next_token[:, 0] == eos_token_id
        tokens.append(next_token)
        if index == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
            break
        slot = prompt_len + index
        valid[:, slot] = 1
        logits = step(next_token, valid, torch.tensor([slot]), next_position)
        next_position = next_position + 1
    return torch.cat(tokens, dim=1)
