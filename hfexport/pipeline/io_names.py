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
    names = [("arg" if path[0].idx == 0 else "") + path_name(path[1:]) for path in spec_leaf_paths(in_spec)]
    return names, [path_name(path) or "output" for path in spec_leaf_paths(out_spec)]


def spec_leaf_paths(spec: pytree.TreeSpec) -> list[tuple[Any, ...]]:
    """The key path of every leaf of ``spec``, in the spec's own flat order."""
    paths: list[Any] = [None] * spec.num_leaves
    for (path, _), index in _rebuilt_order(spec):
        paths[index] = path
    return paths


def leaves_in_spec_order(spec: pytree.TreeSpec, tree: Any) -> list[Any]:
    """The leaves of ``tree``, an object rebuilt from ``spec`` (what ``program.module()`` returns),
    in the spec's flat order. Flattening ``tree`` again is not enough: see :func:`_rebuilt_order`."""
    leaves = pytree.tree_leaves(tree)
    if len(leaves) != spec.num_leaves:
        return leaves
    in_order: list[Any] = [None] * len(leaves)
    for leaf, (_, index) in zip(leaves, _rebuilt_order(spec), strict=True):
        in_order[index] = leaf
    return in_order


def _rebuilt_order(spec: pytree.TreeSpec) -> list[tuple[tuple[Any, Any], int]]:
    """``((path, leaf), index in spec)`` for the leaves of an object rebuilt from ``spec``, in the
    order that object flattens to. The two orders differ where rebuilding reorders: transformers
    rebuilds a ``ModelOutput`` from its fields, in declaration order, while the spec keeps eager's
    order, in which a field set after construction comes last (Aya Vision's
    ``image_outputs.pooler_output``). Numbered tensor marks (so custom nodes such as caches rebuild
    as with real tensors) tell each rebuilt leaf's index."""
    marks = pytree.tree_unflatten([torch.tensor(i) for i in range(spec.num_leaves)], spec)
    rebuilt = pytree.tree_flatten_with_path(marks)[0]
    if len(rebuilt) != spec.num_leaves:
        return [(leaf, index) for index, leaf in enumerate(rebuilt)]
    return [((path, mark), int(mark)) for path, mark in rebuilt]


def user_input_names(program: torch.export.ExportedProgram) -> dict[str, str]:
    """``{placeholder name: readable name}`` for the program's user inputs."""
    from torch.export.graph_signature import InputKind

    placeholders = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    return dict(zip(placeholders, program_io_names(program)[0], strict=False))
