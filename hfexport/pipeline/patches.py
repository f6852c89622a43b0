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
