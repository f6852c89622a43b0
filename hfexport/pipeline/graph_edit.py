"""Editing an ExportedProgram's FX graph while keeping every node's ``meta["val"]`` valid.

Later stages (torch.onnx, ExecuTorch's to_edge) read shapes and dtypes from ``meta["val"]``, so a
rewrite that inserts nodes computes their values by running the op on the fake tensors of its
arguments, in the program's own fake mode (symbolic sizes included).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node

SLICE_TO_END = 2**62  # an aten.slice end at least this large is "to the end" (torch writes sys.maxsize)


class GraphEditor:
    """Insert ATen calls before ``anchor`` with their fake values computed."""

    def __init__(self, graph: Graph, anchor: Node) -> None:
        self.graph = graph
        self.anchor = anchor
        # every fake value of a program shares one fake mode: the first one found says which
        # (checking them all made each edit cost a walk over the graph)
        value = next((n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)), None)
        self.fake_mode = detect_fake_mode([value] if value is not None else [])

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


def add_constant(program: torch.export.ExportedProgram, name: str, value: torch.Tensor) -> Node:
    """Add ``value`` to ``program`` as a lifted tensor constant called ``name``: a placeholder
    before the user inputs, an input spec in the same position, and ``program.constants[name]``."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, TensorArgument

    graph = program.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    specs = list(program.graph_signature.input_specs)
    index = next((i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT), len(specs))
    if index < len(placeholders):
        insertion = graph.inserting_before(placeholders[index])
    else:
        insertion = graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None)
    with insertion:
        node = graph.placeholder("c_" + name.replace(".", "_"))
    fake_mode = detect_fake_mode([n.meta["val"] for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)])
    node.meta["val"] = fake_mode.from_tensor(value, static_shapes=True)
    specs.insert(index, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), name))
    program.constants[name] = value
    program._graph_signature = ExportGraphSignature(specs, program.graph_signature.output_specs)
    return node


def remove_unused_parameter(program: torch.export.ExportedProgram, node: Node) -> bool:
    """Remove a parameter placeholder nothing uses any more, with its input spec and its
    ``state_dict`` entry (the tensor itself is not touched: it may be the user's model's)."""
    from torch.export.graph_signature import ExportGraphSignature

    target = program.graph_signature.inputs_to_parameters.get(node.name)
    if node.users or target is None:
        return False
    program.graph.erase_node(node)
    specs = [spec for spec in program.graph_signature.input_specs if getattr(spec.arg, "name", None) != node.name]
    program._graph_signature = ExportGraphSignature(specs, program.graph_signature.output_specs)
    program.state_dict.pop(target, None)
    return True


def replace_node(program: torch.export.ExportedProgram, node: Node, replacement: Node) -> None:
    """Make every user of ``node`` use ``replacement`` and erase ``node``. When ``node`` was a
    program output (a static cache's in-place write is one), the graph signature names
    ``replacement`` instead, so the program keeps its outputs."""
    redirect_users(program, node, replacement, set(node.users))
    program.graph.erase_node(node)


def redirect_users(program: torch.export.ExportedProgram, node: Node, replacement: Node, users: set[Node]) -> None:
    """Make ``users`` (``node``'s users before ``replacement`` was built from it) read
    ``replacement`` instead; where one of them is the program's output, the graph signature names
    ``replacement`` instead."""
    node.replace_all_uses_with(replacement, delete_user_cb=lambda user: user in users)
    synced_output_specs(program)


def synced_output_specs(program: torch.export.ExportedProgram) -> None:
    """Name in the graph signature the nodes the graph's output actually returns. A rewrite of the
    graph alone (``node.replace_all_uses_with``) leaves an output spec naming the node it replaced;
    the specs follow the output node's arguments in order (a size returned as an output, a
    ``SymIntArgument``, too: Moshi returns one, which torch.onnx then could not find)."""
    from torch.export.graph_signature import (
        ExportGraphSignature,
        SymBoolArgument,
        SymFloatArgument,
        SymIntArgument,
        TensorArgument,
    )

    named = (TensorArgument, SymIntArgument, SymFloatArgument, SymBoolArgument)
    returned = program.graph.output_node().args[0]
    specs = list(program.graph_signature.output_specs)
    if len(returned) != len(specs):
        return
    synced = [
        dataclasses.replace(spec, arg=type(spec.arg)(name=value.name))
        if isinstance(spec.arg, named) and isinstance(value, Node) and value.name != spec.arg.name
        else spec
        for spec, value in zip(specs, returned, strict=True)
    ]
    if synced != specs:
        program._graph_signature = ExportGraphSignature(program.graph_signature.input_specs, synced)
