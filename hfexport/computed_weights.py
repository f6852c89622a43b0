"""Weights a model stores narrower than it computes in: the cast that gives them in the compute
dtype (:class:`ComputedIn`), and the buffers hfexport's own eager forwards cast them into
(:func:`conversions_reused`). :mod:`hfexport.precision` decides which weights stay stored."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

# this thread's pool of cast buffers, inside conversions_reused
_pools = threading.local()


class ComputedIn(torch.nn.Module):
    """A parametrization (``torch.nn.utils.parametrize``) that gives a weight stored in a narrower
    floating-point dtype as ``dtype``: what the model computes with, and what its capture reads
    (the program casts each stored weight; a target folds the casts into its own weights)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        pool = getattr(_pools, "current", None)
        if pool is None or torch.is_grad_enabled() or type(stored) not in (torch.Tensor, torch.nn.Parameter):
            return stored.to(self.dtype)
        return pool.converted(stored, self.dtype)


class _ConversionPool:
    """The float32 (or other) copies :class:`ComputedIn` makes in eager forwards, kept to be
    converted into again once nothing holds them (a linear layer drops its weight's copy as soon
    as it has multiplied by it): one buffer per shape instead of a fresh allocation, whose every
    page the kernel zeroes, per weight and forward."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def converted(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(stored.shape), stored.stride(), dtype)
        buffers = self._buffers.setdefault(key, [])
        for buffer in buffers:
            # held by the buffer and the temporary storage object alone: every view handed out
            # (and any tensor made from one, in Python or not) holds the storage too
            if torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) == 2:
                break
        else:
            buffer = stored.to(dtype)
            buffers.append(buffer)
            return buffer.view(buffer.shape)
        return buffer.copy_(stored).view(buffer.shape)


@contextlib.contextmanager
def conversions_reused() -> Iterator[None]:
    """Within it, the eager forwards of this thread convert the weights :class:`ComputedIn`
    computes in float32 into buffers reused from weight to weight and forward to forward (not
    under autograd; a trace always converts). hfexport's own eager runs of a model (``generate``
    recording the generation components, the checks of the sample, the capture's reference)
    converted Llama-3.2-1B's 3.6 GB of linear weights afresh in each of six forwards."""
    outer = getattr(_pools, "current", None)
    _pools.current = outer or _ConversionPool()
    try:
        yield
    finally:
        _pools.current = outer
