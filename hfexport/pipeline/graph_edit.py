"""Editing an ExportedProgram's FX graph while keeping every node's ``meta["val"]`` valid.

Later stages (torch.onnx, ExecuTorch's to_edge) read shapes and dtypes from ``meta["val"]``, so a
rewrite that inserts nodes computes their values by running the op on the fake tensors of its
arguments, in the program's own fake mode (symbolic sizes included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node


class GraphEditor:
    """Insert ATen calls before ``anchor`` with their fake values computed."""

    def __init__(self, graph: Graph, anchor: Node) -> None:
        self.graph = graph
        self.anchor = anchor
        values = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake_mode = detect_fake_mode(values)

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        return node


def arguments(node: Node) -> dict[str, Any]:
    """A call's arguments by schema name (positional and keyword)."""
    schema = node.target._schema
    bound = dict(zip((a.name for a in schema.arguments), node.args, strict=False))
    bound.update(node.kwargs)
    return bound
