"""Test helpers over exported graphs (import as ``from graphs import count``)."""

from __future__ import annotations

from typing import Any


def count(program: Any, op: Any) -> int:
    """How many nodes of ``program``'s graph call ``op`` (an ``ExportedProgram`` or a
    ``GraphModule``; ``op`` an OpOverload such as ``torch.ops.aten.add.Tensor``, or any call target)."""
    return sum(1 for node in program.graph.nodes if node.target is op)
