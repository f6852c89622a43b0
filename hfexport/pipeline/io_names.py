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


def leaf_names(tree: Any) -> list[str]:
    """Names of the leaves of ``tree`` in flattening order."""
    return [path_name(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]


def program_io_names(program: torch.export.ExportedProgram) -> tuple[list[str], list[str]]:
    """The user input and output leaf names of an ``ExportedProgram``, in its flat order."""
    in_spec, out_spec = program.call_spec.in_spec, program.call_spec.out_spec
    args, kwargs = _placeholder_tree(in_spec)
    names = [f"arg{name}" for name in leaf_names(args)] + leaf_names(kwargs)
    outputs = leaf_names(_placeholder_tree(out_spec))
    return names, [name or "output" for name in outputs]


def user_input_names(program: torch.export.ExportedProgram) -> dict[str, str]:
    """``{placeholder name: readable name}`` for the program's user inputs."""
    from torch.export.graph_signature import InputKind

    placeholders = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    return dict(zip(placeholders, program_io_names(program)[0], strict=False))


def _placeholder_tree(spec: pytree.TreeSpec) -> Any:
    # Tensor leaves, so custom nodes (caches) flatten back into the same structure.
    return pytree.tree_unflatten([torch.empty(0) for _ in range(spec.num_leaves)], spec)
