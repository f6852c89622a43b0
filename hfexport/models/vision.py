"""Vision encoders whose indices are inputs.

transformers' ``vision_utils`` helpers derive a vision encoder's rotary ``position_ids``, its
per-image boundaries ``cu_seqlens`` and, for windowed attention (Qwen2.5-VL), the windows' order
``window_index`` and boundaries ``cu_window_seqlens`` from ``grid_thw`` with data-dependent ops
(``.tolist()``, ``repeat_interleave``, Python loops over the images). Traced, these are unbacked
sizes that ExecuTorch cannot plan memory for (pytorch/pytorch#158786), or sizes the trace cannot
read at all (the windows), so an exported encoder takes them as inputs instead: while the
generation decomposition runs ``generate``, the ``"generate"``-scope patches below record what
each helper returned, and the encoder is exported as a :class:`VisionEncoderWithIndices`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from hfexport.pipeline.patches import register_patch

# helper -> the keywords under which the encoder's forward accepts its results precomputed (each
# helper pops them from the kwargs it is given); a helper returning a tuple gives one per leading item
VISION_INDEX_HELPERS = {
    "get_vision_position_ids": ("position_ids",),
    "get_vision_attention_seqlens": ("cu_seqlens",),  # (cu_seqlens, max_seqlen)
    "get_vision_window_index": ("window_index", "cu_window_seqlens"),
}
# what every such encoder derives; the windows only where it attends in windows
REQUIRED_VISION_INDICES = ("position_ids", "cu_seqlens")

_recorded: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("hfexport_vision_indices", default=None)


class VisionEncoderWithIndices(torch.nn.Module):
    """A vision encoder taking the indices transformers derives from ``grid_thw`` (rotary
    ``position_ids``, the per-image boundaries ``cu_seqlens`` and, for an encoder attending in
    windows, ``window_index`` and ``cu_window_seqlens``) as inputs rather than computing them:
    compute them with ``transformers.vision_utils.get_vision_position_ids`` /
    ``get_vision_cu_seqlens`` / ``get_vision_window_index`` from the same ``grid_thw``. Its outputs
    are the encoder's."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.train(encoder.training)

    def forward(
        self,
        hidden_states: torch.Tensor,
        grid_thw: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        window_index: torch.Tensor | None = None,
        cu_window_seqlens: torch.Tensor | None = None,
    ) -> Any:
        windows = {} if window_index is None else {"window_index": window_index, "cu_window_seqlens": cu_window_seqlens}
        return self.encoder(hidden_states, grid_thw, position_ids=position_ids, cu_seqlens=cu_seqlens, **windows)


@contextmanager
def recording_vision_indices() -> Iterator[dict[str, torch.Tensor]]:
    """While active (and the ``"generate"`` patches are applied), the first result of each of
    :data:`VISION_INDEX_HELPERS` is recorded in the yielded dict under its keywords."""
    indices: dict[str, torch.Tensor] = {}
    token = _recorded.set(indices)
    try:
        yield indices
    finally:
        _recorded.reset(token)


def _recorder(keywords: tuple[str, ...]) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def helper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            indices = _recorded.get()
            if indices is not None:
                values = result if isinstance(result, tuple) else (result,)
                for keyword, value in zip(keywords, values, strict=False):  # (cu_seqlens, max_seqlen)
                    indices.setdefault(keyword, value.clone())
            return result

        return helper

    return make


for _helper, _keywords in VISION_INDEX_HELPERS.items():
    # modeling files import the helpers by name, so each imported modeling file's binding is patched
    register_patch(
        f"transformers.models.*.modeling_*:{_helper}",
        name=f"record_{_helper}",
        scope="generate",
        reason=(
            f"records the {', '.join(_keywords)} that {_helper} derives from grid_thw during generate, so the exported "
            "vision encoder takes it as an input instead of tracing its data-dependent computation"
        ),
        upstream="https://github.com/pytorch/pytorch/issues/158786",
    )(_recorder(_keywords))
