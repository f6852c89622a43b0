"""The ``program_state`` stage: a static cache's keys and values become the ExecuTorch program's
own state (mutable buffers) instead of inputs it writes back.

It runs between ``to_edge`` and the ``edge_passes`` stage, as a stage and not a pass, since it
changes the program's inputs and outputs (a pass may not). ``ExecutorchConfig(cache_in_program=False)``
(or ``alloc_graph_input=False``) leaves it out.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.pipeline.pipeline import PipelineRun
from hfexport.targets.executorch.passes.edge import edge_op
from hfexport.targets.manifest import STATE_PREFIX


def program_state(edge: Any, run: PipelineRun) -> Any:
    """The stage: :func:`cache_as_program_state` on the edge program, with the sample's values as
    the state's initial ones; the report counts the state buffers."""
    state = cache_as_program_state(edge.exported_program(), run.inputs)
    run.current.counts["state_buffers"] = len(state)
    return edge


def cache_as_program_state(program: torch.export.ExportedProgram, sample: dict[str, Any]) -> list[str]:
    """Keep a static cache's keys and values inside the program as mutable buffers (its state)
    instead of inputs it writes back, and return their input paths.

    The Python runtime copies every input into the program's planned memory and clones every
    output, so a cache passed in and returned costs three copies of every layer's keys and values
    per decode step; as state it stays where the program writes it. An input qualifies when the
    program writes it, it is a floating-point tensor with a static batch axis (its other axes take
    the sample's sizes: a static cache's are fixed), and only the ops writing it read it (a
    delegate takes a buffer it reads as a constant). Token counters stay inputs, so a decode loop
    still starts a sequence by zeroing them.

    A buffer's initial value is the sample's (stored in the .pte and copied in when the program
    loads), so verification on the sample is exact; any finite values serve, since a decode step
    reads only the slots its attention mask marks written."""
    from torch.export import graph_signature as gs

    from hfexport.pipeline.io_names import program_io_names
    from hfexport.targets.runner import flat_inputs

    signature = program.graph_signature
    written = {s.target for s in signature.output_specs if s.kind == gs.OutputKind.USER_INPUT_MUTATION}
    user = [s for s in signature.input_specs if s.kind == gs.InputKind.USER_INPUT]
    paths = dict(zip((id(s) for s in user), program_io_names(program)[0], strict=True))
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    values = flat_inputs(sample)
    state: dict[str, str] = {}  # placeholder name -> input path
    for spec in user:
        name = getattr(spec.arg, "name", None)
        node = nodes.get(name)
        value = node.meta.get("val") if node is not None else None
        if name not in written or not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            continue
        if value.dim() < 2 or not isinstance(value.shape[0], int):
            continue  # a dynamic batch: one buffer cannot hold every batch size
        if not all(edge_op(reader, "aten::index_put") or edge_op(reader, "aten::copy") for reader in node.users):
            continue
        if not isinstance(values.get(paths[id(spec)]), torch.Tensor):
            continue
        state[name] = paths[id(spec)]
    if not state:
        return []
    inputs = []
    for spec in signature.input_specs:
        if spec.kind == gs.InputKind.USER_INPUT and getattr(spec.arg, "name", None) in state:
            target = STATE_PREFIX + state[spec.arg.name]
            initial = values[state[spec.arg.name]].detach().clone().contiguous()
            program.state_dict[target] = initial
            node = nodes[spec.arg.name]
            # a buffer has the sample's sizes, not the symbolic ones of a dynamic input (the
            # cache length is one): memory planning would size it by their upper bounds
            node.meta["val"] = node.meta["val"].fake_mode.from_tensor(initial, static_shapes=True)
            node.meta["et_init_buffer"] = True  # serialise the initial value
            spec = gs.InputSpec(gs.InputKind.BUFFER, gs.TensorArgument(spec.arg.name), target, persistent=True)
        inputs.append(spec)
    outputs = [
        gs.OutputSpec(gs.OutputKind.BUFFER_MUTATION, spec.arg, STATE_PREFIX + state[spec.target])
        if spec.kind == gs.OutputKind.USER_INPUT_MUTATION and spec.target in state
        else spec
        for spec in signature.output_specs
    ]
    written_in_place = _write_state_in_place(program, inputs, outputs)
    output = program.graph.output_node()
    results = list(output.args[0])
    # the model also returns the cache: the state's new values need not leave the program (the
    # runtime would hand each one over every step); the flat output spec keeps their names, as ()
    state_values = {results[i] for i in written_in_place}
    names = iter(program_io_names(program)[1])
    kept_names: dict[str, Any] = {}
    kept = []
    for index, spec in enumerate(outputs):
        if spec.kind != gs.OutputKind.USER_OUTPUT:
            kept.append(index)
            continue
        name = next(names)
        returned = results[index] not in state_values
        kept_names[name] = 0 if returned else ()
        if returned:
            kept.append(index)
    # ExecuTorch's write-back pass puts the mutations it copies before the ones written in place,
    # and its emitter then drops buffer mutations by position: order the outputs that way first
    order = sorted(kept, key=lambda i: (outputs[i].kind == gs.OutputKind.USER_OUTPUT, i in written_in_place))
    output.args = (type(output.args[0])(results[i] for i in order),)
    program._graph_signature = gs.ExportGraphSignature(inputs, [outputs[i] for i in order])
    program.graph_module.recompile()
    # the user inputs left, by their paths: a flat keyword spec replaces the cache's pytree
    left = [paths[id(spec)] for spec in user if getattr(spec.arg, "name", None) not in state]
    call = program.module_call_graph[0].signature
    call.in_spec = torch.utils._pytree.tree_flatten(((), dict.fromkeys(left, 0)))[1]
    call.out_spec = torch.utils._pytree.tree_flatten(kept_names)[1]
    call.inputs = [i for i in call.inputs if getattr(i, "name", None) not in state]
    dropped = {node.name for node in state_values}
    call.outputs = [o for o in call.outputs if getattr(o, "name", None) not in dropped]
    call.forward_arg_names = None
    return sorted(state.values())


def _write_state_in_place(program: torch.export.ExportedProgram, inputs: list[Any], outputs: list[Any]) -> set[int]:
    """Make each state buffer's write (``index_put``, functional after decomposition) an
    ``index_put_`` on the buffer itself, so the new rows land in the state with no copy of it; the
    indices of the buffer-mutation outputs now written in place."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from torch.export import graph_signature as gs

    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    values = program.graph.output_node().args[0]
    in_place = set()
    for index, spec in enumerate(outputs):
        if spec.kind != gs.OutputKind.BUFFER_MUTATION:
            continue
        write = values[index]
        buffer = placeholders.get(next(s.arg.name for s in inputs if s.target == spec.target))
        # ExecuTorch's own edge conversion writes it back through copy(buffer, copy(buffer, write)):
        # the copies keep the write's values, and drop_same_layout_copies removes them later
        while edge_op(write, "aten::copy") and write.args[0] is buffer and isinstance(write.args[1], torch.fx.Node):
            write = write.args[1]
        if not edge_op(write, "aten::index_put") or write.args[0] is not buffer:
            continue
        if any(user is not write and not edge_op(user, "aten::copy") for user in write.args[0].users):
            continue
        write.target = exir_ops.edge.aten.index_put_.default
        in_place.add(index)
    return in_place
