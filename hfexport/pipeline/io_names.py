"""Readable names for a program's flattened inputs and outputs, from their pytree paths:
``input_ids``, ``logits``, ``cache.layers.0.keys``."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        if isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key).strip(".[]'\""))
    return ".".join(parts)


def program_io_names(program: torch.export.ExportedProgram) -> tuple[list[str], list[str]]:
    """The user input and output leaf names of an ``ExportedProgram``, in its flat order."""
    in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
    # in_spec is (args, kwargs): a positional leaf is named arg0, arg1, ...
    names = [("arg" if path[0].idx == 0 else "") + path_name(path[1:]) for path, _ in _placeholder_leaves(in_spec)]
    return names, [path_name(path) or "output" for path, _ in _placeholder_leaves(out_spec)]


def _placeholder_leaves(spec: pytree.TreeSpec) -> list[tuple[tuple[Any, ...], Any]]:
    # empty tensor leaves, so custom nodes (caches, deferred splits) rebuild as with real tensors
    return leaves_in_spec_order(spec, pytree.tree_unflatten([torch.empty(0) for _ in range(spec.num_leaves)], spec))


def leaves_in_spec_order(spec: pytree.TreeSpec, tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(key path, leaf)`` for the leaves of ``tree``, an object rebuilt from ``spec`` (what
    ``program.module()`` returns), in the spec's flat order. Flattening ``tree`` again is not
    enough: transformers rebuilds a ``ModelOutput`` from its fields in declaration order, while the
    spec keeps eager's order, in which a field set after construction comes last (Aya Vision's
    ``image_outputs.pooler_output``); such a node's children are matched to the spec's by name."""
    try:
        return _in_spec_order(spec, tree, ())
    except (KeyError, TypeError, ValueError):  # not rebuilt from spec: its own order is all there is
        return pytree.tree_flatten_with_path(tree)[0]


def _in_spec_order(spec: pytree.TreeSpec, tree: Any, path: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], Any]]:
    if spec.is_leaf():
        return [(path, tree)]
    if type(tree) is not spec.type:  # a node that rebuilds as another type (a deferred split's pieces)
        return [((*path, *subpath), leaf) for subpath, leaf in pytree.tree_flatten_with_path(tree)[0]]
    node = pytree.SUPPORTED_NODES[spec.type]
    if node.flatten_with_keys_fn is not None:
        keyed, context = node.flatten_with_keys_fn(tree)
    else:
        children, context = node.flatten_fn(tree)
        keyed = [(pytree.SequenceKey(index), child) for index, child in enumerate(children)]
    if context != spec.context and isinstance(context, list) and sorted(context) == sorted(spec.context):
        by_name = dict(zip(context, keyed, strict=True))
        keyed = [by_name[name] for name in spec.context]
    if len(keyed) != spec.num_children:
        raise ValueError(f"{spec.type.__name__} rebuilt with {len(keyed)} children, its spec has {spec.num_children}")
    found = []
    for (key, child), child_spec in zip(keyed, spec.children(), strict=True):
        found += _in_spec_order(child_spec, child, (*path, key))
    return found


def user_input_names(program: torch.export.ExportedProgram) -> dict[str, str]:
    """``{placeholder name: readable name}`` for the program's user inputs."""
    from torch.export.graph_signature import InputKind

    placeholders = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    return dict(zip(placeholders, program_io_names(program)[0], strict=False))
