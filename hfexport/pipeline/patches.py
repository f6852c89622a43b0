"""Registry of reversible patches applied only inside capture.

A patch replaces one attribute (a torch or transformers function) for the duration of
``torch.export`` to work around an upstream bug that cannot be fixed on the graph afterwards.
Each carries its reason and the upstream issue. :func:`patches_applied` restores every target on
every path, errors included. A workaround that can be done on the graph is a pass, not a patch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """Replace ``target`` (``"package.module:Owner.attribute"``) by ``make(original)`` during capture."""

    name: str
    target: str
    make: Callable[[Any], Any]
    reason: str
    upstream: str

    def owner_and_attribute(self) -> tuple[Any, str]:
        module, _, path = self.target.partition(":")
        owner: Any = importlib.import_module(module)
        *parents, attribute = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, attribute


PATCHES: dict[str, Patch] = {}


def register_patch(target: str, *, name: str, reason: str, upstream: str) -> Callable:
    """Decorator registering ``make(original) -> replacement`` as a capture patch."""

    def register(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
        PATCHES[name] = Patch(name=name, target=target, make=make, reason=reason, upstream=upstream)
        return make

    return register


@contextlib.contextmanager
def patches_applied(names: list[str] | None = None) -> Iterator[list[Patch]]:
    """Apply the named patches (all registered ones by default); restore them on exit."""
    selected = [PATCHES[n] for n in (names if names is not None else PATCHES)]
    applied: list[tuple[Any, str, Any]] = []
    try:
        for patch in selected:
            owner, attribute = patch.owner_and_attribute()
            # Read the owner's own __dict__ so a class attribute inherited from a base class is
            # deleted (not shadowed) on restore, and descriptors come back unchanged.
            original = vars(owner).get(attribute, _MISSING) if hasattr(owner, "__dict__") else _MISSING
            current = getattr(owner, attribute)
            setattr(owner, attribute, patch.make(current))
            applied.append((owner, attribute, original))
        yield selected
    finally:
        for owner, attribute, original in reversed(applied):
            if original is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)


@register_patch(
    "torch.nn.functional:scaled_dot_product_attention",
    name="sdpa_math_backend_on_cpu",
    reason=(
        "CPU SDPA's fused kernels check the mask shape with Eq(batch, 1), which fails the trace "
        "with GuardOnDataDependentSymNode when the batch axis is data-dependent (vision towers "
        "that select patches with a boolean mask); the math backend has no such check"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/180202",
)
def _sdpa_math_backend_on_cpu(original: Callable) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    @functools.wraps(original)
    def scaled_dot_product_attention(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if query.device.type != "cpu":
            return original(query, *args, **kwargs)
        with sdpa_kernel(SDPBackend.MATH):
            return original(query, *args, **kwargs)

    return scaled_dot_product_attention


def segment_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, length]`` boolean mask letting position ``i`` attend to ``j`` only when both
    lie in the same segment of the packed sequence ``cu_seqlens`` (``[0, end_0, end_1, …]``)."""
    positions = torch.arange(length, device=cu_seqlens.device)
    segment = (positions[:, None] >= cu_seqlens[None, 1:]).sum(-1)
    return segment[:, None] == segment[None, :]


@register_patch(
    "transformers.models.qwen2_vl.modeling_qwen2_vl:VisionAttention.forward",
    name="qwen2_vl_vision_attention_as_one_masked_sdpa",
    reason=(
        "the vision tower attends within each image by splitting the packed patches with "
        "cu_seqlens.tolist() and running one attention per image; the split sizes are data-dependent "
        "and the trace fails (GuardOnDataDependentSymNode). One SDPA over all patches with a "
        "block-diagonal mask built from cu_seqlens computes the same attention"
    ),
    upstream="https://github.com/pytorch/pytorch/issues/158786",
)
def _qwen2_vl_vision_attention(original: Callable) -> Callable:
    import sys

    @functools.wraps(original)
    def forward(
        self: Any,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        length = hidden_states.shape[0]
        # [length, 3 * dim] -> three [length, heads, head_dim]
        query, key, value = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).unbind(1)
        cos, sin = position_embeddings
        query, key = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision(query, key, cos, sin)
        query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        mask = segment_mask(cu_seqlens, length)[None, None]
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scaling)
        return self.proj(output[0].transpose(0, 1).reshape(length, -1))

    return forward
