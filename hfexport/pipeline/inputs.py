"""The keyword inputs of a capture: a plain dict of the model's keyword arguments, copied so that
tracing or running the model never changes the caller's tensors, and widened to two rows where the
sample has one (so torch.export keeps the batch axis dynamic)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from hfexport.errors import ConfigError


def as_input_dict(inputs: Any) -> dict[str, Any]:
    """The keyword inputs as a new plain dict (a tokenizer's ``BatchEncoding`` included), ``None``
    values dropped; anything but a mapping raises :class:`ConfigError`."""
    if not isinstance(inputs, Mapping):
        raise ConfigError(
            f"inputs must be a mapping of the model's keyword arguments (e.g. a tokenizer's "
            f"BatchEncoding or {{'input_ids': ...}}), got {type(inputs).__name__}"
        )
    return {str(k): v for k, v in inputs.items() if v is not None}


def copy_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of the inputs, so running or tracing never changes the caller's tensors or
    cache objects. A tensor given as a view with other strides (``mask.expand(batch, -1)``, whose
    rows share memory) is copied into its own dense memory: a traced program keeps its inputs'
    strides, and ExecuTorch cannot plan a stride of 0."""
    copied = copy.deepcopy(inputs)
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in copied.items()}


def widen_batch(inputs: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of ``inputs`` with two rows where the sample has one: every tensor of two or more
    dimensions repeated along axis 0. ``None`` unless all of them have one row (then axis 0 is
    unambiguously the batch: a position-ids tensor led by 3 rope sections is not)."""
    leaves = [leaf for leaf in pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2]
    if not leaves or any(leaf.shape[0] != 1 for leaf in leaves):
        return None
    return pytree.tree_map(
        lambda leaf: torch.cat([leaf, leaf]) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 else leaf,
        copy_inputs(inputs),
    )
