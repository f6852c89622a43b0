"""Cache passes: find and record the in-place writes a static cache makes to its input tensors."""

from __future__ import annotations

import json
from typing import Any

import torch

from hfexport.pipeline.graph_edit import GraphEditor, replace_node
from hfexport.pipeline.io_names import user_input_names
from hfexport.pipeline.pass_manager import PassResult, register_pass

CACHE_MUTATIONS_KEY = "hfexport.cache_mutations"


def mutated_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node an in-place op writes (its first argument the schema marks written), or None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for argument, value in zip(schema.arguments, node.args, strict=False):
        if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.fx.Node):
            return value
    return None


def input_mutations(program: torch.export.ExportedProgram) -> dict[str, list[str]]:
    """``{user input name: [in-place ops writing it]}`` for an ``ExportedProgram``, from in-place
    ops in the graph (training IR) and from the signature's input-mutation outputs (after
    functionalisation)."""
    by_placeholder = user_input_names(program)
    found: dict[str, list[str]] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target = mutated_argument(node)
        if target is not None and target.name in by_placeholder:
            found.setdefault(by_placeholder[target.name], []).append(str(node.target))
    for spec in program.graph_signature.output_specs:
        if spec.kind == torch.export.graph_signature.OutputKind.USER_INPUT_MUTATION and spec.target in by_placeholder:
            found.setdefault(by_placeholder[spec.target], []).append("functional write-back")
    return found


@register_pass(
    name="mark_cache_mutations",
    remove_when=(
        "Keep it for any program that writes its inputs (a static cache): the lowering stages read "
        "what it records; without one it changes nothing."
    ),
)
def mark_cache_mutations(program: Any) -> PassResult:
    """Find the user inputs the program writes in place (a static cache's keys, values and
    counters), record them in ``graph_module.meta["hfexport.cache_mutations"]`` for the lowering
    stages, and list them in the dump (``cache_mutations.json``)."""
    mutations = input_mutations(program)
    program.graph_module.meta[CACHE_MUTATIONS_KEY] = sorted(mutations)
    result = PassResult(program, modified=False, counts={"mutated_inputs": len(mutations)})
    result.files["cache_mutations.json"] = json.dumps(mutations, indent=2) + "\n"
    return result


@register_pass(
    name="cache_writes_as_scatter",
    runs_after=("mark_cache_mutations",),
    remove_when=(
        "Without it, torch.onnx writes each layer's cache through a Transpose, ScatterND and "
        "Transpose back: three cache copies per decode step."
    ),
)
def cache_writes_as_scatter(program: Any) -> PassResult:
    """Rewrite a static cache's write ``cache.index_copy_(axis, slots, new)`` as
    ``cache.scatter_(axis, slots broadcast to new's shape, new)``.

    torch.onnx lowers ``index_copy_`` along an inner axis as ``Transpose`` (the whole cache) →
    ``ScatterND`` → ``Transpose`` back: three copies of every layer's keys and values per decode
    step. ``scatter_`` lowers to one ``ScatterElements`` on that axis, which writes the new rows
    into the cache buffer in place. The same values land in the same slots."""
    aten = torch.ops.aten
    rewritten = 0
    indices: dict[tuple[Any, ...], torch.fx.Node] = {}  # a layer's keys and values share one index
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index_copy_.default:
            continue
        cache, axis, slots, new = node.args
        if slots.meta["val"].dim() != 1:
            continue
        rank = new.meta["val"].dim()
        axis = axis % rank
        edit = GraphEditor(program.graph, node)
        key = (slots, axis, *(str(size) for size in new.meta["val"].shape))
        if key not in indices:
            shape = [1] * rank
            shape[axis] = -1
            indices[key] = edit.call(
                aten.add.Tensor,
                edit.call(aten.zeros_like.default, new, dtype=torch.int64),
                edit.call(aten.view.default, slots, shape),
            )
        replace_node(program, node, edit.call(aten.scatter_.src, cache, axis, indices[key], new))
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return PassResult(program, modified=rewritten > 0, counts={"rewritten": rewritten})
