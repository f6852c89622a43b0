"""ONNX initializers made from a torch tensor only when they are read or written: a weight the
model stores narrower than it computes, in the program's dtype; a transposed weight, row-major.

Written to a file, each goes out a slice of rows at a time through one buffer
(:class:`MadeWhenWritten`), so a save never holds a second whole copy of a weight: Llama-3.2-1B's
128,256 × 2,048 output projection alone is 1 GB in float32. Read (a pass that quantizes or packs
weights), each is made whole, for as long as the reader holds it."""

from __future__ import annotations

import re
from typing import Any

import onnx_ir as ir
import torch

from hfexport.precision import write_converted

TORCH_DTYPES = {
    ir.DataType.FLOAT: torch.float32,
    ir.DataType.FLOAT16: torch.float16,
    ir.DataType.DOUBLE: torch.float64,
}


class MadeWhenWritten(ir.LazyTensor):
    """``source`` (a torch tensor of any strides and floating-point dtype) as a row-major tensor
    of ``dtype``, made when read and written a slice of rows at a time."""

    def __init__(self, source: torch.Tensor, dtype: torch.dtype, name: str | None = None) -> None:
        self.source, self.torch_dtype = source.detach(), dtype
        ir_dtype = next(key for key, value in TORCH_DTYPES.items() if value == dtype)
        super().__init__(self._made, ir_dtype, ir.Shape(list(source.shape)), name=name)

    def _made(self) -> ir.Tensor:
        return ir.tensor(self.source.to(self.torch_dtype).contiguous().numpy())

    def tofile(self, file: Any) -> None:
        write_converted(self.source, self.torch_dtype, file)


def stored_weights_made_when_written(graph: ir.Graph) -> None:
    """Fold each ``Cast`` of a floating-point initializer (a weight the model stores narrower than
    it computes: :class:`~hfexport.computed_weights.ComputedIn`), and a ``Transpose`` that is its only
    reader, into an initializer of the cast's dtype that is converted (and transposed) when written
    (:class:`MadeWhenWritten`).

    onnxscript's optimizer would leave a large weight's ``Cast`` for ONNX Runtime to run at every
    step (it folds no input over 8,192 elements), or fold it whole, in memory."""
    casts: dict[tuple[str, torch.dtype], list[ir.Node]] = {}
    for node in graph:
        stored = node.inputs[0] if node.op_type == "Cast" and node.domain == "" and node.inputs else None
        source = getattr(getattr(stored, "const_value", None), "raw", None)
        if stored is None or not stored.is_initializer() or stored.is_graph_input():
            continue
        dtype = TORCH_DTYPES.get(ir.DataType(node.attributes.get_int("to")))
        if isinstance(source, torch.Tensor) and source.is_floating_point() and dtype is not None:
            casts.setdefault((stored.name, dtype), []).append(node)
    for (stored_name, dtype), nodes in casts.items():
        stored = graph.initializers[stored_name]
        source = stored.const_value.raw
        # one cast of each weight (a tied weight is cast by each of its modules)
        cast = nodes[0].outputs[0]
        for other in nodes[1:]:
            other.outputs[0].replace_all_uses_with(cast, replace_graph_outputs=True)
            graph.remove(other, safe=True)
        name = re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", stored_name)
        consumers = {use.node for use in cast.uses()}
        # a transpose that is the weight's only reader, as onnxscript folds one: a weight read
        # both ways (an embedding table tied to the output projection) is written once, and
        # ONNX Runtime folds its transpose when it loads the file
        transpose = consumers.pop() if len(consumers) == 1 and not cast.is_graph_output() else None
        perm = transpose.attributes.get_ints("perm") if transpose and transpose.op_type == "Transpose" else None
        if transpose is not None and transpose.domain == "" and perm is not None and len(perm) == source.dim():
            made = _initializer(graph, f"{name}.T", MadeWhenWritten(source.permute(*perm), dtype))
            transpose.outputs[0].replace_all_uses_with(made, replace_graph_outputs=True)
            graph.remove(transpose, safe=True)
        if cast.uses() or cast.is_graph_output():
            made = _initializer(graph, name, MadeWhenWritten(source, dtype))
            cast.replace_all_uses_with(made, replace_graph_outputs=True)
        graph.remove(nodes[0], safe=True)
        if not stored.uses():
            graph.initializers.pop(stored_name)


def _initializer(graph: ir.Graph, name: str, tensor: ir.TensorProtocol) -> ir.Value:
    unique, n = name, 1
    while unique in graph.initializers:
        unique, n = f"{name}_{n}", n + 1
    tensor.name = unique
    value = ir.Value(name=unique, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value
