"""Cleanup passes: drop checks and no-op nodes that tracing leaves in the graph."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from hfexport.pipeline.pass_manager import graph_pass

aten = torch.ops.aten

_RUNTIME_ASSERTS = {
    aten._assert_scalar.default,
    aten._assert_tensor_metadata.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
}


@graph_pass()
def remove_tensor_metadata_asserts(graph_module: GraphModule) -> int:
    """Drop aten._assert_tensor_metadata checks: they restate dtypes the graph already fixes."""
    removed = 0
    for node in list(graph_module.graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default and not node.users:
            graph_module.graph.erase_node(node)
            removed += 1
    return removed


@graph_pass()
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


@graph_pass()
def remove_noop_conversions(graph_module: GraphModule) -> int:
    """Replace aten.to calls that keep dtype, device and layout by their input."""
    removed = 0
    for node in list(graph_module.graph.nodes):
        if _is_noop_conversion(node):
            node.replace_all_uses_with(node.args[0])
            graph_module.graph.erase_node(node)
            removed += 1
    return removed


@graph_pass(runs_after=("remove_tensor_metadata_asserts", "remove_runtime_asserts", "remove_noop_conversions"))
def dead_code_elimination(graph_module: GraphModule) -> int:
    """Remove nodes whose results are unused and that have no side effects."""
    before = len(graph_module.graph.nodes)
    graph_module.graph.eliminate_dead_code()
    return before - len(graph_module.graph.nodes)


@graph_pass()
def contiguous_as_copies(graph_module: GraphModule) -> int:
    """Turn aten.contiguous into an explicit contiguous copy (aten.clone).

    aten.contiguous is a no-op wherever the tensor's traced layout is already contiguous, and
    that layout can differ between retraces: ExecuTorch's to_edge decomposes in two passes,
    the first keeping SDPA whole (XNNPACK runs it), whose output may be laid out so that the
    transposed result counts as contiguous, the second decomposing it with the math backend,
    whose output does not; the first pass drops the contiguous and turns the reshape after it
    into a view, and the second pass then fails with "Cannot view a tensor with shape ... and
    strides ..." (pytorch/pytorch#136543; CLIP's attention output). The copy is what eager does
    whenever the tensor is not contiguous.
    """
    changed = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is aten.contiguous.default:
            source = node.args[0]
            node.target = aten.clone.default
            node.args, node.kwargs = (source,), {"memory_format": torch.contiguous_format}
            changed += 1
    return changed
