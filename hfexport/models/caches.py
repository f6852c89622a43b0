"""Pytree registration for transformers cache objects.

``torch.export`` only accepts inputs and outputs it can flatten into tensors. transformers' caches
(``DynamicCache``, ``StaticCache``, ``EncoderDecoderCache``, …) are plain Python objects holding
layer objects, so we register each cache class and each cache-layer class as a pytree node:

- the children are the attributes holding tensors, layers, nested caches, or lists / dicts of
  those (``layers``, ``keys``, ``values``, ``cumulative_length``, ``self_attention_cache``, an SSM
  layer's ``conv_states``, …);
- every other attribute (``max_cache_len``, ``is_initialized``, ``dtype``, …) goes into the context,
  encoded as JSON-compatible values so ``torch.export.save`` / ``load`` round-trip the spec.

Leaves are named by attribute path (``past_key_values.layers.0.keys``), which later stages use for
readable input and output names.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.dynamic_shapes import _IntWrapper

_REGISTERED: dict[str, type] = {}  # qualified name -> class
_REGISTERED_TYPES: set[type] = set()


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _is_child(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or type(value) in _REGISTERED_TYPES:
        return True
    if isinstance(value, (list, tuple)) and value:
        # an empty list holds a skipped layer's place (MiniMax's linear_cache: [] for attention layers)
        return all(_is_child(v) or (isinstance(v, list) and not v) for v in value) and any(
            not isinstance(v, list) or v for v in value
        )
    if type(value) is dict and value:  # e.g. an SSM layer's {state index: tensor}
        return all(_is_child(v) for v in value.values())
    return False


def _encode(value: Any) -> Any:
    """Encode a non-tensor attribute as a JSON-compatible, hashable value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.SymInt) and value.node.hint is not None:
        # Shape metadata a cache records while tracing (a static layer initialised in the traced
        # call stores its batch size): the context must be constant, so it keeps the sample's
        # value; the tensors themselves stay symbolic.
        return int(value.node.hint)
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, type):
        return {"class": _qualified(value)}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_encode(v) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k), _encode(v)] for k, v in value.items()]}
    raise TypeError(
        f"cannot flatten attribute of type {type(value).__name__} into a pytree context; "
        "register a custom flatten function for this cache class"
    )


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    ((kind, payload),) = value.items()
    if kind == "dtype":
        return getattr(torch, payload)
    if kind == "device":
        return torch.device(payload)
    if kind == "class":
        return _resolve(payload)
    if kind == "list":
        return [_decode(v) for v in payload]
    if kind == "tuple":
        return tuple(_decode(v) for v in payload)
    if kind == "dict":
        return {_decode(k): _decode(v) for k, v in payload}
    raise ValueError(f"unknown encoded context entry {kind!r}")


# Token counters that change with the input length: during tracing they are SymInts, so they are
# children (leaves) rather than context, which must be a constant.
_COUNTERS = frozenset({"cumulative_length"})
# torch.export wraps every int input leaf (a counter of an empty cache, 0) in an _IntWrapper while
# it works out which are dynamic, and rebuilds the cache with it: still a counter, still a child.
_COUNTER_TYPES = (int, torch.SymInt, _IntWrapper)


def _split(obj: Any) -> tuple[list[str], list[Any], str]:
    names, children, static = [], [], {}
    for name, value in vars(obj).items():
        if _is_child(value) or (name in _COUNTERS and isinstance(value, _COUNTER_TYPES)):
            names.append(name)
            children.append(list(value) if isinstance(value, tuple) else value)
        else:
            static[name] = _encode(value)
    # The context is a JSON string: hashable, comparable and directly serialisable.
    context = json.dumps({"class": _qualified(type(obj)), "children": names, "static": static}, sort_keys=True)
    return names, children, context


def _flatten(obj: Any) -> tuple[list[Any], str]:
    _, children, context = _split(obj)
    return children, context


def _flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], str]:
    names, children, context = _split(obj)
    return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children, strict=True)], context


def _unflatten(values: Any, context: str) -> Any:
    spec = json.loads(context)
    cls = _REGISTERED.get(spec["class"]) or _resolve(spec["class"])
    obj = object.__new__(cls)
    state = {name: _decode(value) for name, value in spec["static"].items()}
    state.update(zip(spec["children"], values, strict=True))
    obj.__dict__.update(state)
    return obj


class EncoderStates(tuple):
    """An encoder-decoder's ``encoder_outputs`` as its prefill and decode components take them:
    the encoder's output tensors in order, as a tuple (what every encoder-decoder forward accepts),
    that also answers their names as attributes (``.last_hidden_state``, Cohere ASR's
    ``.attention_mask``; None for the output class's fields left unset, as a ``ModelOutput``
    answers). generate
    hands a ``ModelOutput``, which a weights-only load cannot rebuild from a saved program's
    example inputs; this can, and it flattens to ``encoder_outputs.<index>``."""

    def __new__(cls, values: Any = (), names: Any = (), unset: Any = ()) -> EncoderStates:
        states = super().__new__(cls, values)
        states.names, states.unset = tuple(names), tuple(unset)
        return states

    def __getattr__(self, name: str) -> Any:
        if name in ("names", "unset") or name not in (*self.names, *self.unset):
            raise AttributeError(name)
        return self[self.names.index(name)] if name in self.names else None


def _register_encoder_states() -> None:
    if EncoderStates in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        EncoderStates,
        lambda states: (list(states), (states.names, states.unset)),
        lambda values, context: EncoderStates(values, *context),
        serialized_type_name=_qualified(EncoderStates),
        flatten_with_keys_fn=lambda states: (
            [(pytree.SequenceKey(i), v) for i, v in enumerate(states)],
            (states.names, states.unset),
        ),
        to_dumpable_context=lambda context: json.dumps([list(part) for part in context]),
        from_dumpable_context=lambda dumped: tuple(tuple(part) for part in json.loads(dumped)),
    )
    torch.serialization.add_safe_globals([EncoderStates])


def register_pytree_node(cls: type) -> type:
    """Register ``cls`` (a cache, a cache layer, or any object holding tensors in attributes) as a
    pytree node so it can be an input or output of an exported program. For a transformers cache
    class, every cache and cache-layer class is registered (a saved program's spec names its
    layers too). Idempotent; returns ``cls``.
    """
    _register(cls)
    if cls.__module__.startswith("transformers.") and cls.__name__.endswith("Cache"):
        register_cache_pytrees()
    return cls


def _register(cls: type) -> None:
    already = cls in pytree.SUPPORTED_NODES
    _REGISTERED[_qualified(cls)] = cls
    _REGISTERED_TYPES.add(cls)
    # A saved program pickles its example inputs; let torch.load (weights_only) rebuild them.
    torch.serialization.add_safe_globals([cls])
    if already:
        return
    pytree.register_pytree_node(
        cls,
        _flatten,
        _unflatten,
        serialized_type_name=_qualified(cls),
        flatten_with_keys_fn=_flatten_with_keys,
        to_dumpable_context=lambda context: context,
        from_dumpable_context=lambda dumped: dumped,
    )


def _subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(current.__subclasses__())
    return found


def register_cache_pytrees() -> None:
    """Register every transformers cache and cache-layer class currently defined (idempotent).

    Called before each capture, so cache classes defined by modeling files imported since the
    last call are picked up too. Also imports ``transformers.modeling_outputs``, whose import
    registers the ``ModelOutput`` classes, so a saved program loads in a fresh process.
    """
    import transformers.modeling_outputs  # noqa: F401  (registers the ModelOutput pytree nodes)
    from transformers import cache_utils

    import hfexport.models.static_layers  # noqa: F401  (defines WindowedStaticLayer)

    _register_encoder_states()

    roots = [cache_utils.Cache, cache_utils.CacheLayerMixin, cache_utils.DummyLayer]
    roots += (
        [cache_utils.LinearAttentionCacheLayerMixin] if hasattr(cache_utils, "LinearAttentionCacheLayerMixin") else []
    )
    for root in roots:
        for cls in _subclasses(root):
            if not getattr(cls, "__abstractmethods__", None) and cls not in pytree.SUPPORTED_NODES:
                _register(cls)
    for cls in _model_caches():
        if cls not in pytree.SUPPORTED_NODES:
            _register(cls)


def _model_caches() -> list[type]:
    """Caches a modeling file defines outside ``Cache``'s hierarchy, by transformers' naming
    convention (``VoxtralRealtimeConv1dPaddingCache`` and its ``...CacheLayer``, ``xLSTMCache``): a
    model returning one failed capture ("Found <class ...> in output, which is not a known type")."""
    import sys

    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("transformers.models.") or ".modeling_" not in name:
            continue
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and value.__module__ == name
                and value.__name__.endswith(("Cache", "CacheLayer"))
                and not issubclass(value, (torch.nn.Module, torch.Tensor))
            ):
                found.append(value)
    return found
