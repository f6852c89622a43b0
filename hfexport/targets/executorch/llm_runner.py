"""The ``llm_runner_io`` stage: a decoder-only decode program in the interface ExecuTorch's LLM
runner drives (``TextLLMRunner``, ``llama_main``, the demo apps; optimum-executorch's
``ExecuTorchModelForCausalLM`` reads the same): a method ``forward(tokens [1, S] int64,
input_pos [S] int64) → logits``, the cache kept inside as the program's state, and the constant
methods the runner reads (``get_max_seq_len``, ``get_eos_ids``, ``enable_dynamic_shape``, …).

Everything else hfexport's decode took is derived in the program from ``input_pos`` (the cache
slots of the new tokens, one row): each layer's token counter is ``input_pos[0]``, the positions
are ``input_pos``, and each 4-D mask is :func:`~hfexport.generation.decode_mask`'s rule with
every slot up to the last one written (a runner fills its one row without gaps). Reference:
ExecuTorch 1.4.1's ``extension/llm/runner`` (docs/plans/deployable-exports.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hfexport.errors import RuntimeInterfaceError

if TYPE_CHECKING:
    from hfexport.pipeline.pipeline import PipelineRun

INTERFACE = "executorch-llm-runner"
POSITIONS = "cache_position"  # the method's second input: the new tokens' cache slots (the runner's input_pos)
# meta of a derived mask that is causal from the first new token's slot (no window, no chunk): that slot's node
CAUSAL_FROM = "hfexport.causal_from"
_MASK = "attention_mask"


def _counter(path: str) -> bool:
    return path.startswith("cache.layers.") and path.endswith(".cumulative_length")


def _refuse(what: str) -> RuntimeInterfaceError:
    return RuntimeInterfaceError(
        f"ExecuTorch's LLM runner cannot run this decode program: {what}; export it in hfexport's own interface "
        "(ExecutorchConfig(llm_runner=False), --spec-io) to run it with hfexport generate"
    )


class _Graph:
    """Edge-dialect nodes inserted at one point of ``graph``, each with its fake value."""

    def __init__(self, graph: torch.fx.Graph, fake_mode: Any) -> None:
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.graph.call_function(op, args, kwargs)
        values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = op(*values[0], **values[1])
        return node


def _mask(op: _Graph, positions: Any, cache_len: int, window: int | None, chunk: int | None, like: Any) -> Any:
    """bool (or additive float, as ``like``) ``[1, 1, S, C]``: slot ``j`` is visible to the query
    at slot ``s`` when ``j <= s`` (every earlier slot of the one row is written), within the
    window or the chunk."""
    from executorch.exir.dialects._ops import ops as exir_ops

    aten = exir_ops.edge.aten
    columns = op(aten.arange.start_step, 0, cache_len, 1, dtype=torch.long)  # [C]
    queries = op(aten.unsqueeze_copy.default, positions, 1)  # [S, 1]
    visible = op(aten.le.Tensor, columns, queries)  # [S, C]
    if window is not None:
        distance = op(aten.sub.Tensor, queries, columns)
        visible = op(aten.logical_and.default, visible, op(aten.lt.Scalar, distance, window))
    if chunk is not None:
        same = op(
            aten.eq.Tensor,
            op(aten.div.Tensor_mode, columns, chunk, rounding_mode="floor"),
            op(aten.div.Tensor_mode, queries, chunk, rounding_mode="floor"),
        )
        visible = op(aten.logical_and.default, visible, same)
    mask = op(aten.unsqueeze_copy.default, op(aten.unsqueeze_copy.default, visible, 0), 0)
    if like.dtype == torch.bool:
        return mask
    # eager attention adds its mask: 0 where visible, the dtype's minimum where not
    as_float = op(aten._to_copy.default, mask, dtype=like.dtype)
    return op(aten.mul.Scalar, op(aten.sub.Scalar, as_float, 1), -torch.finfo(like.dtype).min)


def llm_runner_io(edge: Any, run: PipelineRun) -> Any:
    """The stage (after ``program_state``, which keeps the keys and values inside): the method
    takes ``input_ids`` and ``cache_position`` and returns the logits alone, and the program gets
    the runner's constant methods (:func:`runner_metadata`). Refuses, in one line, a program whose
    other inputs the runner cannot feed (a recurrent state, multimodal positions, token types),
    whose cache is not kept inside, or that takes several rows."""
    from torch.export import graph_signature as gs

    from hfexport.generation import DecodeMasks
    from hfexport.pipeline.io_names import program_io_names

    program = edge.exported_program()
    signature = program.graph_signature
    user = [s for s in signature.input_specs if s.kind == gs.InputKind.USER_INPUT]
    paths = dict(zip((s.arg.name for s in user), program_io_names(program)[0], strict=True))
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    by_path = {path: nodes[name] for name, path in paths.items()}
    ids = by_path.get("input_ids")
    masks = {path: node for path, node in by_path.items() if path == _MASK or path.startswith(f"{_MASK}.")}
    counters = [node for path, node in by_path.items() if _counter(path)]
    others = [p for p in by_path if p not in masks and not _counter(p) and p not in ("input_ids", "position_ids")]
    if others:
        raise _refuse(f"it takes {', '.join(others)}, which the runner does not feed")
    kept_inside = any(s.kind == gs.InputKind.BUFFER and s.persistent for s in signature.input_specs)
    if ids is None or not masks or not kept_inside:
        raise _refuse("it keeps no static key/value cache inside (its decode takes the whole sequence or a state)")
    if ids.meta["val"].shape[0] != 1:
        raise _refuse(f"it takes {ids.meta['val'].shape[0]} rows; the runner feeds one")
    positions_node = by_path.get("position_ids")
    if positions_node is not None and positions_node.meta["val"].dim() != 2:
        raise _refuse("its positions have more than one row per token (multimodal rotary positions)")
    cache_len = next(int(node.meta["val"].shape[-1]) for node in masks.values() if node.meta["val"].dim() in (2, 4))
    shapes = {path: list(node.meta["val"].shape) for path, node in masks.items()}
    windows = run.captured.attention_windows if run.captured else {}
    rules = DecodeMasks.from_input_paths(list(masks), windows, shapes=shapes).rules()

    fake_mode = ids.meta["val"].fake_mode
    graph = program.graph
    with graph.inserting_after(ids):
        cache_position = graph.placeholder(POSITIONS)
    with fake_mode:
        cache_position.meta["val"] = torch.empty(ids.meta["val"].shape[1], dtype=torch.long)
    from executorch.exir.dialects._ops import ops as exir_ops

    aten = exir_ops.edge.aten
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_op):
        op = _Graph(graph, fake_mode)
        start = op(aten.select_copy.int, cache_position, 0, 0)
        for counter in counters:
            counter.replace_all_uses_with(start)
        if positions_node is not None:
            positions_node.replace_all_uses_with(op(aten.unsqueeze_copy.default, cache_position, 0))
        for path, node in masks.items():
            value = node.meta["val"]
            if value.dim() == 2:  # a 2-D mask over the slots (BLOOM's): written up to the last new one
                last = op(aten.select_copy.int, cache_position, 0, -1)
                columns = op(aten.arange.start_step, 0, cache_len, 1, dtype=torch.long)
                valid = op(aten.unsqueeze_copy.default, op(aten.le.Tensor, columns, last), 0)
                derived = valid if value.dtype == torch.bool else op(aten._to_copy.default, valid, dtype=value.dtype)
            else:
                window, chunk = rules.get(path, (None, None))
                derived = _mask(op, cache_position, cache_len, window, chunk, value)
                if window is None and chunk is None:
                    derived.meta[CAUSAL_FROM] = start
            node.replace_all_uses_with(derived)
    removed = {*counters, *masks.values(), *([positions_node] if positions_node is not None else [])}
    removed_names = {node.name for node in removed}

    # outputs: the logits alone (and the state's buffer mutations); the counters' write-backs go
    output = graph.output_node()
    results = list(output.args[0])
    names = iter(program_io_names(program)[1])
    kept_outputs, kept_specs, logits = [], [], None
    for value, spec in zip(results, signature.output_specs, strict=True):
        if spec.kind == gs.OutputKind.USER_INPUT_MUTATION and spec.target in removed_names:
            continue
        if spec.kind == gs.OutputKind.USER_OUTPUT:
            if next(names) != "logits":
                continue
            logits = value
        kept_outputs.append(value)
        kept_specs.append(spec)
    if logits is None:
        raise _refuse("it returns no logits")
    output.args = (type(output.args[0])(kept_outputs),)
    for node in removed:
        graph.erase_node(node)
    inputs = []
    for spec in signature.input_specs:
        if spec.kind == gs.InputKind.USER_INPUT and spec.arg.name in removed_names:
            continue
        inputs.append(spec)
        if spec.kind == gs.InputKind.USER_INPUT and spec.arg.name == ids.name:
            inputs.append(gs.InputSpec(gs.InputKind.USER_INPUT, gs.TensorArgument(POSITIONS), None))
    graph.eliminate_dead_code()
    program._graph_signature = gs.ExportGraphSignature(inputs, kept_specs)
    program.graph_module.recompile()
    call = program.module_call_graph[0].signature
    left = ["input_ids", POSITIONS]
    call.in_spec = torch.utils._pytree.tree_flatten(((), dict.fromkeys(left, 0)))[1]
    # the logits, and the outputs kept inside as the state (empty leaves, as program_state left them)
    kept_names = {
        name: 0 if name == "logits" else ()
        for name, child in zip(call.out_spec.context, call.out_spec.children(), strict=True)
        if name == "logits" or (child.type is tuple and child.num_leaves == 0)
    }
    call.out_spec = torch.utils._pytree.tree_flatten(kept_names)[1]
    call.inputs = [i for i in call.inputs if getattr(i, "name", None) not in removed_names]
    call.forward_arg_names = None
    # EdgeProgramManager keeps its constant methods here and serialises them in to_executorch
    # (executorch/exir/program/_program.py, EdgeProgramManager.__init__)
    from hfexport.models.generation import runtime_facts

    several = not isinstance(ids.meta["val"].shape[1], int) or ids.meta["val"].shape[1] > 1
    metadata = runner_metadata(runtime_facts(run.model), cache_len, several)
    edge._config_methods = {**(edge._config_methods or {}), **metadata}
    run.current.counts["inputs"] = len(left)
    run.reinterface(runner_feed)
    return edge


def runner_feed(inputs: dict[str, Any]) -> dict[str, Any]:
    """A decode sample in the spec's form (masks, positions, a cache with its token counters) as
    the runner's interface takes it: ``input_ids`` and the new tokens' slots."""
    from hfexport.targets.runner import flat_inputs

    flat = flat_inputs(inputs)
    counter = next(int(value) for path, value in flat.items() if _counter(path))
    ids = flat["input_ids"]
    return {"input_ids": ids, POSITIONS: torch.arange(counter, counter + ids.shape[1])}


def runner_metadata(facts: dict[str, Any], cache_len: int, several_tokens: bool) -> dict[str, Any]:
    """The constant methods ExecuTorch's LLM runner reads (``get_max_seq_len`` is required; the
    runner takes bos and the vocabulary from its tokenizer and ``get_eos_ids`` in place of the
    tokenizer's eos) and those optimum-executorch's ``ExecuTorchModelForCausalLM`` reads, from the
    model's :func:`~hfexport.models.generation.runtime_facts` and the static cache's length."""
    metadata: dict[str, Any] = {
        "get_max_seq_len": cache_len,
        "get_max_context_len": cache_len,
        "get_max_batch_size": 1,
        "enable_dynamic_shape": several_tokens,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
    }
    vocab = facts.get("vocab_size")
    eos = [i for i in facts.get("eos_token_id", []) if vocab is None or 0 <= i < vocab]
    if eos:
        metadata["get_eos_ids"] = eos
        metadata["get_eos_id"] = eos[0]
    if facts.get("bos_token_id") is not None:
        metadata["get_bos_id"] = facts["bos_token_id"]
    if vocab is not None:
        metadata["get_vocab_size"] = vocab
    return metadata
