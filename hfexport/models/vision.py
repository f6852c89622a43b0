"""Vision encoders whose indices are inputs.

transformers' ``vision_utils`` helpers derive a vision encoder's rotary ``position_ids`` and its
per-image boundaries ``cu_seqlens`` from ``grid_thw`` with data-dependent ops (``.tolist()``,
``repeat_interleave``). Traced, these are unbacked sizes that ExecuTorch cannot plan memory for
(pytorch/pytorch#158786), so an exported encoder takes them as inputs instead: while the generation
decomposition runs ``generate``, the ``"generate"``-scope patches below record what each helper
returned, and the encoder is exported as a :class:`VisionEncoderWithIndices`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from hfexport.pipeline.patches import register_patch

# helper -> the keyword under which the encoder's forward accepts its result precomputed (each
# helper pops that keyword from the kwargs it is given)
VISION_INDEX_HELPERS = {"get_vision_position_ids": "position_ids", "get_vision_attention_seqlens": "cu_seqlens"}

_recorded: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("hfexport_vision_indices", default=None)


class VisionEncoderWithIndices(torch.nn.Module):
    """A vision encoder taking the indices transformers derives from ``grid_thw`` (rotary
    ``position_ids`` and the per-image boundaries ``cu_seqlens``) as inputs rather than computing
    them: compute them with ``transformers.vision_utils.get_vision_position_ids`` /
    ``get_vision_cu_seqlens`` from the same ``grid_thw``. Its outputs are the encoder's."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.train(encoder.training)

    def forward(
        self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> Any:
        return self.encoder(hidden_states, grid_thw, position_ids=position_ids, cu_seqlens=cu_seqlens)


@contextmanager
def recording_vision_indices() -> Iterator[dict[str, torch.Tensor]]:
    """While active (and the ``"generate"`` patches are applied), the first result of each of
    :data:`VISION_INDEX_HELPERS` is recorded in the yielded dict under its keyword."""
    indices: dict[str, torch.Tensor] = {}
    token = _recorded.set(indices)
    try:
        yield indices
    finally:
        _recorded.reset(token)


def _recorder(keyword: str) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def helper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            indices = _recorded.get()
            if indices is not None:
                value = result[0] if isinstance(result, tuple) else result  # (cu_seqlens, max_seqlen)
                indices.setdefault(keyword, value.clone())
            return result

        return helper

    return make


for _helper, _keyword in VISION_INDEX_HELPERS.items():
    # modeling files import the helpers by name, so each imported modeling file's binding is patched
    register_patch(
        f"transformers.models.*.modeling_*:{_helper}",
        name=f"record_{_helper}",
        scope="generate",
        reason=(
            f"records the {_keyword!r} that {_helper} derives from grid_thw during generate, so the exported "
            "vision encoder takes it as an input instead of tracing its data-dependent computation"
        ),
        upstream="https://github.com/pytorch/pytorch/issues/158786",
    )(_recorder(_keyword))
