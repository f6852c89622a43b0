"""ExecuTorch memory planning for hfexport's programs: ExecuTorch's planner, with the views of a
buffer written in place planned over that buffer."""

from __future__ import annotations

from typing import Any

import torch


def planning_pass(alloc_graph_input: bool, alloc_graph_output: bool, alloc_mutable_buffers: bool) -> Any:
    """ExecuTorch's ``MemoryPlanningPass`` with these flags, planning a view of an in-place
    write's result (a static cache kept as the program's state, read by ``attention_as_matmuls``'
    reshapes) over the written buffer itself (:func:`views_over_written_buffers`)."""
    from executorch.exir.passes import MemoryPlanningPass

    class _Planning(MemoryPlanningPass):
        def run(self, graph_module: torch.fx.GraphModule, graph_signature: Any = None) -> Any:
            views_over_written_buffers(graph_module)
            return super().run(graph_module, graph_signature)

    return _Planning(
        alloc_graph_input=alloc_graph_input,
        alloc_graph_output=alloc_graph_output,
        alloc_mutable_buffers=alloc_mutable_buffers,
    )


def views_over_written_buffers(graph_module: torch.fx.GraphModule) -> int:
    """Make each view of an in-place op's result (``index_put_`` on a state buffer) share the
    written input's memory, and return how many views were moved.

    ExecuTorch's planner gives an in-place op's result the spec of the input it writes
    (``_alias_inplace_result_specs``, from pytorch/executorch#19482), but the views made earlier
    (``ReplaceViewCopyWithViewPass``: a ``memory.view`` whose spec shares its base's memory
    fields) keep the result's former spec as their base. That spec is then planned as a separate,
    never-written slot, and the view reads it: in executorch 1.4.1 a decode step whose attention
    reads the state cache through a reshape returned all-zero logits (bf16 on XNNPACK, NaN on
    portable kernels, fp32 too once its attention is not ``custom_sdpa``). Giving those views the
    written input's spec before planning makes them read the buffer the op wrote."""
    try:
        from executorch.exir.passes.replace_view_copy_with_view_pass import _ViewSpec
    except ImportError:  # a later executorch without the class has another view scheme
        return 0
    from executorch.exir.memory_planning import _is_inplace_node
    from executorch.exir.operator.convert import output_to_aliased_input_map, unwrap_op_overload
    from executorch.exir.tensor import TensorSpec

    written: dict[int, Any] = {}  # id(the in-place result's spec) -> the written input's spec
    for node in graph_module.graph.nodes:
        if not _is_inplace_node(node) or not isinstance(node.meta.get("spec"), TensorSpec):
            continue
        aliased = output_to_aliased_input_map(unwrap_op_overload(node.target)._schema)
        index = aliased.get(0)
        source = node.args[index] if index is not None and index < len(node.args) else None
        result, input_spec = node.meta.get("spec"), getattr(source, "meta", {}).get("spec")
        if isinstance(input_spec, TensorSpec) and result is not input_spec:
            written[id(result)] = input_spec
    moved = 0
    for node in graph_module.graph.nodes:
        spec = node.meta.get("spec")
        if isinstance(spec, _ViewSpec):
            base = object.__getattribute__(spec, "_base")
            if id(base) in written:
                object.__setattr__(spec, "_base", written[id(base)])
                moved += 1
    return moved
