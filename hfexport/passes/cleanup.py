"""Cleanup passes: drop checks and no-op nodes that tracing leaves in the graph."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from hfexport.pipeline.graph_edit import GraphEditor
from hfexport.pipeline.pass_manager import graph_pass

aten = torch.ops.aten

_RUNTIME_ASSERTS = {
    aten._assert_scalar.default,
    aten._assert_tensor_metadata.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
}


@graph_pass(
    remove_when=(
        "Never needed by a target: it drops checks of dtypes the graph fixes anyway. Leave it out to "
        "keep torch.export's graph as traced."
    )
)
def remove_tensor_metadata_asserts(graph_module: GraphModule) -> int:
    """Drop aten._assert_tensor_metadata checks: they restate dtypes the graph already fixes."""
    removed = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default and not node.users:
            graph_module.graph.erase_node(node)
            removed += 1
    return removed


@graph_pass(
    remove_when=(
        "Not in any default list: without the asserts an out-of-range input is no longer refused by "
        "the graph itself. Add it only when a runtime cannot run them."
    )
)
def remove_runtime_asserts(graph_module: GraphModule) -> int:
    """Drop runtime shape asserts (aten._assert_scalar, sym_constrain_range*); out-of-range
    inputs are then no longer rejected by the graph itself."""
    removed = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target in _RUNTIME_ASSERTS and not node.users:
            graph_module.graph.erase_node(node)
            removed += 1
    return removed


def _is_noop_conversion(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (aten.to.dtype, aten.to.device, aten.to.dtype_layout):
        return False
    source, result = node.args[0], node.meta.get("val")
    before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(before, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    arguments = dict(zip((a.name for a in node.target._schema.arguments), node.args, strict=False))
    arguments.update(node.kwargs)
    if arguments.get("copy") or arguments.get("memory_format") not in (None, torch.preserve_format):
        return False
    return (before.dtype, before.device, before.layout) == (result.dtype, result.device, result.layout)


@graph_pass(remove_when="Safe to leave out: the conversions it removes change nothing.")
def remove_noop_conversions(graph_module: GraphModule) -> int:
    """Replace aten.to calls that keep dtype, device and layout by their input."""
    removed = 0
    for node in list(graph_module.graph.nodes):
        if _is_noop_conversion(node):
            node.replace_all_uses_with(node.args[0])
            graph_module.graph.erase_node(node)
            removed += 1
    return removed


@graph_pass(
    remove_when=(
        "Only for a runtime that squeezes like torch (Dynamo): ONNX's Squeeze fails on an axis that "
        "is not 1 (Parakeet's decoder did, for every batch of more than one token)."
    )
)
def remove_noop_squeezes(graph_module: GraphModule) -> int:
    """Replace squeezes that removed no axis when traced (the axis was not of size 1, as a
    symbolic axis never is under torch.export) by their input. torch squeezes an axis only when
    it is 1, ONNX's Squeeze fails on any other size: Parakeet's ``.squeeze(2)`` of its decoder
    token axis failed in ONNX Runtime for every batch of more than one token."""
    removed = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.squeeze.dim, aten.squeeze.dims):
            continue
        source = node.args[0]
        before = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        after = node.meta.get("val")
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dim() == after.dim():
            node.replace_all_uses_with(source)
            graph_module.graph.erase_node(node)
            removed += 1
    return removed


@graph_pass(
    runs_after=(
        "remove_tensor_metadata_asserts",
        "remove_runtime_asserts",
        "remove_noop_conversions",
        "remove_noop_squeezes",
    ),
    remove_when=("Safe to leave out: the nodes it removes are unused; the graph, dumps and lowering then carry them."),
)
def dead_code_elimination(graph_module: GraphModule) -> int:
    """Remove nodes whose results are unused and that have no side effects."""
    before = len(graph_module.graph.nodes)
    graph_module.graph.eliminate_dead_code()
    return before - len(graph_module.graph.nodes)


_TRANSPOSES = (aten.transpose.int, aten.permute.default, aten.t.default)
_RESHAPES = (aten.reshape.default, aten.view.default)


@graph_pass(
    remove_when=(
        "Without it, a lowering that retraces (to_edge, torch.onnx) can fail with 'Cannot view a "
        "tensor with shape ... and strides ...' (pytorch/pytorch#136543)."
    )
)
def explicit_contiguous_copies(graph_module: GraphModule) -> int:
    """Make the copies that depend on a tensor's memory layout explicit: ``aten.contiguous``
    becomes ``aten.clone(memory_format=contiguous_format)``, and a reshape of a transposed tensor
    reshapes a contiguous clone of it.

    Whether ``contiguous`` copies and whether a reshape is a view depends on the layout traced,
    and SDPA lays its output out differently per backend: the fused CPU kernel's transposed output
    is contiguous, the math decomposition's is not. Lowerings that decompose in several retraces
    (ExecuTorch's to_edge keeps SDPA whole for XNNPACK, then decomposes it; torch.onnx's
    decomposition) drop the copy or record a view in one retrace and then fail in the next with
    "Cannot view a tensor with shape ... and strides ..." (pytorch/pytorch#136543; CLIP and T5
    attention outputs). An explicit clone is a copy in every retrace: what eager does whenever
    the layout needs one, and one extra copy of the attention output otherwise.
    """
    changed = 0
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.contiguous.default:
            node.target = aten.clone.default
            node.args, node.kwargs = (node.args[0],), {"memory_format": torch.contiguous_format}
            changed += 1
        elif node.target in _RESHAPES and _is_transpose(node.args[0]):
            source = node.args[0]
            copy = GraphEditor(graph, node).call(aten.clone.default, source, memory_format=torch.contiguous_format)
            node.replace_input_with(source, copy)
            changed += 1
    return changed


def _is_transpose(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _TRANSPOSES
