"""Static-cache layers that one exported graph can serve for every length it accepts.

- :class:`WindowedStaticLayer`, for sliding-window attention. transformers' ``StaticSlidingWindowLayer``
  keeps only ``sliding_window`` slots and picks its update path with a Python int (is the window full
  yet?), so a graph traced with the window not yet full is silently wrong once it is, and vice versa.
  This layer keeps the full ``max_cache_len`` slots, written at the token's cache position like a
  full-attention layer; the window is applied by the layer type's attention mask alone
  (``sliding_attention`` rows see the last ``sliding_window`` slots), which the model builds from the
  cache positions at prefill and :mod:`hfexport.generation` builds in its decode loops. The cost: a
  sliding layer holds ``max_cache_len`` tokens instead of ``sliding_window``.
- :class:`EncoderLengthStaticLayer`, for an encoder-decoder's cross attention. generate sizes the
  static cross-attention cache to the sample's encoder length, a Python int, so a prefill traced with
  it accepts only that source length; this layer takes its length from the encoder states it is
  written with, once, at prefill.
"""

from __future__ import annotations

from typing import Any

from transformers import cache_utils

from hfexport.pipeline.patches import register_patch


class WindowedStaticLayer(cache_utils.StaticLayer):
    """A full-length static layer of a sliding-window attention layer: its mask, not its size,
    limits attention to the last ``sliding_window`` positions."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs: Any) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.sliding_window = sliding_window


class WindowedHybridStaticLayer(cache_utils.LinearAttentionAndStaticFullAttentionLayer):
    """:class:`WindowedStaticLayer` for a ``hybrid_sliding`` layer, which also holds a linear
    attention's conv and recurrent states (the layer it stands for,
    ``LinearAttentionAndStaticSlidingWindowAttentionLayer``, does too)."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int, number_of_states: int = 1, **kwargs: Any) -> None:
        super().__init__(max_cache_len=max_cache_len, number_of_states=number_of_states)
        self.sliding_window = sliding_window


class ChunkedStaticLayer(WindowedStaticLayer):
    """:class:`WindowedStaticLayer` for a ``chunked_attention`` layer (Llama 4): its mask limits
    attention to the query's chunk of ``sliding_window`` (the config's ``attention_chunk_size``)
    positions."""


WINDOWED_LAYERS = {
    "sliding_attention": WindowedStaticLayer,
    "hybrid_sliding": WindowedHybridStaticLayer,
    "chunked_attention": ChunkedStaticLayer,
}


class EncoderLengthStaticLayer(cache_utils.StaticLayer):
    """A static cross-attention layer as long as the encoder states it is first written with
    (symbolic while tracing), not the sample's encoder length."""

    def __init__(self, **kwargs: Any) -> None:
        # 0 until written: the program's input structure does not carry the sample's length
        super().__init__(max_cache_len=0)

    def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
        self.max_cache_len = key_states.shape[-2]
        super().lazy_initialization(key_states, value_states)


def with_encoder_length_cross_attention(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` (a recorded prefill call, owned by the caller) with the cross-attention layers of an
    empty static ``EncoderDecoderCache`` replaced by :class:`EncoderLengthStaticLayer` s, in place."""
    cross = getattr(kwargs.get("cache"), "cross_attention_cache", None)
    layers = getattr(cross, "layers", [])
    if layers and all(type(layer) is cache_utils.StaticLayer and not layer.is_initialized for layer in layers):
        cross.layers = [EncoderLengthStaticLayer() for _ in layers]
    return kwargs


@register_patch(
    "transformers.cache_utils:STATIC_LAYER_TYPE_MAPPING",
    name="static_cache_full_length_sliding_layers",
    scope="generate",
    reason=(
        "StaticSlidingWindowLayer picks its update path with a Python int (is the window full?), so a decode "
        "graph traced on one side of the window is wrong on the other; while generate records the decode "
        "call, StaticCache builds a WindowedStaticLayer (full length, window applied by the mask) instead"
    ),
    upstream="https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/cache_utils.py",
)
def _full_length_sliding_layers(mapping: dict[str, type]) -> dict[str, type]:
    # layer types whose static layer is a window over the sequence (cache_utils.get_layer_types_and_kwargs
    # gives each a ``sliding_window``); chunked attention needs chunk masks and is not covered
    return {**mapping, **{name: layer for name, layer in WINDOWED_LAYERS.items() if name in mapping}}


def attention_windows(inputs: Any) -> dict[str, int]:
    """``{mask key: window}`` for the windowed layers of the caches in ``inputs`` (a dict of
    keyword inputs): what a decode loop needs to build each layer type's mask."""
    windows: dict[str, int] = {}
    values = inputs.values() if isinstance(inputs, dict) else ()
    for value in values:
        for cache in (value, getattr(value, "self_attention_cache", None)):
            for layer in getattr(cache, "layers", ()):
                if isinstance(layer, ChunkedStaticLayer):  # the span of a chunk, not of a window
                    windows["chunked_attention"] = int(layer.sliding_window)
                elif isinstance(layer, tuple(WINDOWED_LAYERS.values())):
                    windows["sliding_attention"] = int(layer.sliding_window)
    return windows
