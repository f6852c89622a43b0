"""The ``genai_io`` stage: a decoder-only decode graph in the interface ONNX Runtime GenAI's
``og.Generator`` drives (``input_ids``, a 2-D ``attention_mask``, ``position_ids``, the cache pairs
``past_key_values.N.key`` → ``present.N.key``, ``logits``), and what goes with it: the manifest
entry of such a graph, its sample feed and its ``genai_config.json``.

ONNX Runtime GenAI feeds nothing else (any other input fails at its first step: "Missing Input"),
so what hfexport's decode graph takes besides is derived inside the graph from the 2-D mask, whose
width ``T`` is the sequence so far: the cache slot of the first new token is ``start = T - S``
(``S`` new tokens), which every layer's token counter was; a token's slot is its column in the
mask, so left padding (hfexport's loops), right padding (ORT GenAI's batches) and one row all
read the same graph. Each 4-D mask is :func:`~hfexport.generation.decode_mask`'s rule over those
slots. Reference: ORT GenAI 0.18's inputs and the builder's own graphs
(docs/plans/deployable-exports.md)."""

from __future__ import annotations

import json
import re
from typing import Any

from hfexport.errors import RuntimeInterfaceError
from hfexport.targets.onnx.passes.domains import MS_DOMAIN

INTERFACE = "onnxruntime-genai"
INTERFACE_KEY = "hfexport.interface"  # the ONNX model's metadata_props: the interface it was given
WINDOWS_KEY = "hfexport.attention_windows"  # {mask key: window}, recorded by to_onnx from the capture
MASK = "attention_mask"
PAST = "past_key_values.{}.{}"
PRESENT = "present.{}.{}"
_CACHE = re.compile(r"^(input|output)\.cache\.layers\.(\d+)\.(keys|values|cumulative_length)$")
_KIND = {"keys": "key", "values": "value"}


def _refuse(what: str) -> RuntimeInterfaceError:
    return RuntimeInterfaceError(
        f"ONNX Runtime GenAI cannot run this decode graph: {what}; export it in hfexport's own interface "
        "(OnnxConfig(genai=False), --spec-io) to run it with hfexport generate"
    )


def _io(graph: Any) -> tuple[dict[tuple[int, str], Any], list[Any], dict[str, Any]]:
    """``({(layer, key|value): input}, counters, masks by name)``, refusing any input ORT GenAI
    does not feed and cannot be derived from its mask."""
    caches: dict[tuple[int, str], Any] = {}
    counters: list[Any] = []
    masks: dict[str, Any] = {}
    others = []
    for value in graph.inputs:
        name = value.name
        found = _CACHE.match(name)
        if found and found[3] == "cumulative_length" and value.shape is not None and value.shape.rank() == 0:
            counters.append(value)
        elif found and value.shape is not None and value.shape.rank() == 4:
            caches[int(found[2]), _KIND[found[3]]] = value
        elif name == MASK or name.startswith(f"{MASK}."):
            masks[name] = value
        elif name == "position_ids" and (value.shape is None or value.shape.rank() != 2):
            rank = value.shape.rank() if value.shape is not None else "unknown"
            raise _refuse(f"its position_ids have {rank} axes (multimodal rotary positions), ORT GenAI feeds 2")
        elif name not in ("input_ids", "position_ids"):
            others.append(name)
    if others:
        state = " (a recurrent or convolution state)" if any(n.startswith("input.cache.") for n in others) else ""
        raise _refuse(f"it takes {', '.join(others)}{state}, which ORT GenAI does not feed")
    if not caches or not masks:
        raise _refuse("it has no static key/value cache with an attention mask (it runs the whole sequence each step)")
    for layer in {layer for layer, _ in caches}:
        keys, values = caches.get((layer, "key")), caches.get((layer, "value"))
        if keys is None or values is None:
            raise _refuse(f"layer {layer} has {'values' if keys is None else 'keys'} in its cache but no twin")
        if keys.shape[3] != values.shape[3]:
            raise _refuse(
                f"layer {layer}'s keys and values have different head sizes ({keys.shape[3]} and {values.shape[3]}: "
                "latent attention), ORT GenAI's cache has one"
            )
    return caches, counters, masks


class _Builder:
    """Nodes added at the top of the graph, in order."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def __call__(self, op_type: str, *inputs: Any, **attributes: Any) -> Any:
        import onnx_ir as ir

        node = ir.node(op_type, list(inputs), attributes=attributes)
        self.nodes.append(node)
        return node.outputs[0]

    def constant(self, array: Any) -> Any:
        import onnx_ir as ir

        return self("Constant", value=ir.tensor(array))


def _attention_over_written_slots(graph: Any, total: Any) -> None:
    """Each ``GroupQueryAttention`` attends over the ``total`` slots written so far (the
    attention mask's width), as ONNX Runtime GenAI's builder has it, instead of the whole cache,
    its bias cut to them (the slots after are never visible). SmolLM2's int4 folder in
    ``og.Generator``: 193.3 tok/s over the whole cache of 256, 195.8 cut to the written slots (the
    same tokens; the builder's folder 209.6; six alternating rounds, a quiet machine)."""
    import numpy as np
    import onnx_ir as ir

    attentions = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    if not attentions:
        return
    op = _Builder()
    written = op("Squeeze", op("Cast", total, to=ir.DataType.INT32))
    zero, last = op.constant(np.array([0], np.int64)), op.constant(np.array([3], np.int64))
    graph.insert_before(next(iter(graph)), op.nodes)
    cut: dict[Any, Any] = {}
    for node in attentions:
        node.replace_input_with(6, written)
        bias = node.inputs[10] if len(node.inputs) > 10 else None
        if bias is None:
            continue
        if bias not in cut:
            piece = ir.node("Slice", [bias, zero, total, last])
            # after the bias, or (a bias that is no node's output) after the nodes made above
            graph.insert_after(bias.producer() or op.nodes[-1], piece)
            cut[bias] = piece.outputs[0]
        node.replace_input_with(10, cut[bias])


def _derived_mask(op: _Builder, valid: Any, slots: Any, cache_len: int, window: int | None, chunk: int | None) -> Any:
    """``decode_mask``'s rule, in-graph: bool ``[batch, 1, S, C]`` from ``valid`` [batch, C] and
    the new tokens' ``slots`` [S]. Windows and chunks count a row's tokens, not columns: ORT
    GenAI's right-padded batches leave the padding as holes between a row's prompt and its new
    tokens (with hfexport's left padding the two counts are the same)."""
    import numpy as np

    columns = op.constant(np.arange(cache_len, dtype=np.int64)[None, :])  # [1, C]
    queries = op("Unsqueeze", slots, op.constant(np.array([1], np.int64)))  # [S, 1]
    visible = op("Unsqueeze", op("LessOrEqual", columns, queries), op.constant(np.array([0], np.int64)))  # [1, S, C]
    if window is not None or chunk is not None:
        rank = op("CumSum", op("Cast", valid, to=7), op.constant(np.array(1, np.int64)))  # [batch, C]: tokens so far
        key_rank = op("Unsqueeze", rank, op.constant(np.array([1], np.int64)))  # [batch, 1, C]
        query_rank = op("Unsqueeze", op("Gather", rank, slots, axis=1), op.constant(np.array([2], np.int64)))
        if window is not None:  # [batch, S, C]
            visible = op("And", visible, op("Less", op("Sub", query_rank, key_rank), op.constant(np.array(window))))
        else:  # one chunk of ``chunk`` tokens, counted from the row's first
            one, size = op.constant(np.array(1, np.int64)), op.constant(np.array(chunk, np.int64))
            key_chunk = op("Div", op("Sub", key_rank, one), size)
            query_chunk = op("Div", op("Sub", query_rank, one), size)
            visible = op("And", visible, op("Equal", key_chunk, query_chunk))
    rows = op("Unsqueeze", valid, op.constant(np.array([1], np.int64)))  # [batch, 1, C]
    return op("Unsqueeze", op("And", visible, rows), op.constant(np.array([1], np.int64)))


def _typed(op: _Builder, mask: Any, like: Any) -> Any:
    """``mask`` as the input it replaces took it: boolean, or additive float (eager attention)."""
    import numpy as np
    import onnx_ir as ir

    if like.dtype == ir.DataType.BOOL:
        return mask
    numpy_type = like.dtype.numpy().type
    zero, lowest = np.array(0, numpy_type), np.array(np.finfo(numpy_type).min, numpy_type)
    return op("Where", mask, op.constant(zero), op.constant(lowest))


def genai_io(program: Any) -> Any:
    """A decoder-only decode graph's inputs and outputs as ONNX Runtime GenAI feeds and reads them.

    The token counters and the 4-D attention masks leave the inputs; a 2-D int64
    ``attention_mask`` [batch, T] (T: the tokens so far, as ORT GenAI feeds it) comes in, and
    from it the graph derives the first written slot ``start = T - S`` (which replaces every
    counter), each slot's validity and each mask (causal, padding, the layer type's sliding
    window or chunk; windows as recorded from the capture). The cache inputs are renamed
    ``past_key_values.N.key`` / ``.value`` and their write-backs ``present.N.key`` / ``.value``;
    the counters' write-backs go. A graph with an input ORT GenAI does not feed (a recurrent
    state, multimodal positions, token types), no key/value cache, or keys and values of different
    head sizes is refused with :class:`~hfexport.errors.RuntimeInterfaceError` naming it.

    A stage, not a pass: it changes the graph's inputs and outputs (as ExecuTorch's
    ``program_state`` does), which no pass may; it runs after the ONNX passes, so the attention
    fusions match the spec-form graph and then read the derived masks."""
    import numpy as np
    import onnx_ir as ir

    model = program.model
    graph = model.graph
    if model.metadata_props.get(INTERFACE_KEY) == INTERFACE:
        return program
    caches, counters, masks = _io(graph)
    windows = json.loads(model.metadata_props.get(WINDOWS_KEY, "{}"))
    from hfexport.generation import DecodeMasks

    shapes = {name: list(value.shape) for name, value in masks.items()}
    rules = DecodeMasks.from_input_paths(list(masks), windows, shapes=shapes).rules()
    keys = next(iter(caches.values()))
    cache_len = keys.shape[2]
    if not isinstance(cache_len, int):
        raise _refuse("its cache has no fixed length (a static cache's)")
    batch = next(value for value in graph.inputs if value.name == "input_ids").shape[0]
    for value in masks.values():
        value.name = f"hfexport_replaced_{value.name}"
    mask = ir.Value(name=MASK, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([batch, "total_sequence_length"]))

    op = _Builder()
    ids = next(value for value in graph.inputs if value.name == "input_ids")
    new = op("Shape", ids, start=1, end=2)  # [1]: S
    total = op("Shape", mask, start=1, end=2)  # [1]: T
    start = op("Sub", total, new)
    padding = op("Sub", op.constant(np.array([cache_len], np.int64)), total)
    pads = op("Concat", op.constant(np.zeros(3, np.int64)), padding, axis=0)
    valid = op("Not", op("Equal", op("Pad", mask, pads), op.constant(np.array(0, np.int64))))  # [batch, C]
    first = op("Squeeze", start)
    slots = op("Range", first, op("Squeeze", total), op.constant(np.array(1, np.int64)))  # [S]
    for name, value in masks.items():
        if value.shape.rank() == 2:  # a 2-D mask over the cache's slots (BLOOM's ALiBi): the validity
            replacement = op("Cast", valid, to=value.dtype) if value.dtype != ir.DataType.BOOL else valid
        else:
            window, chunk = rules.get(name, (None, None))
            replacement = _typed(op, _derived_mask(op, valid, slots, cache_len, window, chunk), value)
        value.replace_all_uses_with(replacement)
    for counter in counters:
        counter.replace_all_uses_with(first)
    removed = set(masks.values()) | set(counters)
    kept = [value for value in graph.inputs if value not in removed]
    graph.inputs.clear()
    after_ids = kept.index(ids) + 1
    graph.inputs.extend([*kept[:after_ids], mask, *kept[after_ids:]])
    graph.insert_before(next(iter(graph)), op.nodes)
    _attention_over_written_slots(graph, total)

    counter_outputs = set()
    for index, value in enumerate(list(graph.outputs)):
        found = _CACHE.match(value.name or "")
        if found and found[3] == "cumulative_length":
            counter_outputs.add(index)
        elif found:
            value.name = PRESENT.format(found[2], _KIND[found[3]])
    kept = [value for index, value in enumerate(graph.outputs) if index not in counter_outputs]
    graph.outputs.clear()
    graph.outputs.extend(kept)
    for (layer, kind), value in caches.items():
        value.name = PAST.format(layer, kind)
    import onnx_ir.passes.common as common

    # each layer derived its attention's key count from its own counter; from one start they are
    # one computation (SmolLM2: 30 Add + Cast pairs, run at every step, become one)
    common.CommonSubexpressionEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)
    model.metadata_props[INTERFACE_KEY] = INTERFACE
    return program


def _counter_path(path: str) -> bool:
    return path.startswith("cache.layers.") and path.endswith(".cumulative_length")


def _mask_path(path: str) -> bool:
    return path == MASK or path.startswith(f"{MASK}.")


def _genai_name(path: str, prefix: str) -> str:
    found = _CACHE.match(f"input.{path}")
    return (PAST if prefix == "input" else PRESENT).format(found[2], _KIND[found[3]])


def genai_component(spec: Any) -> Any:
    """The manifest entry of a decode graph :func:`genai_io` rewrote, from the entry of the
    graph it was (``spec``): the counters and 4-D masks gone, the cache pairs renamed, the 2-D
    ``attention_mask`` [batch, T] (T from 1 to the cache length) fed after ``input_ids``."""
    from dataclasses import replace

    from hfexport.targets.manifest import InputSpec, OutputSpec

    # without the capture's record (a program read back), the inputs have no sample shapes
    cache_len = next((i.shape[2] for i in spec.inputs if _CACHE.match(f"input.{i.path}") and len(i.shape) == 4), None)
    ids = next(i for i in spec.inputs if i.path == "input_ids")
    inputs = []
    for given in spec.inputs:
        if _counter_path(given.path) or _mask_path(given.path):
            continue
        if given.written and _CACHE.match(f"input.{given.path}"):
            given = replace(given, name=_genai_name(given.path, "input"))
        inputs.append(given)
        if given.path == "input_ids":
            inputs.append(
                InputSpec(
                    name=MASK,
                    path=MASK,
                    dtype="int64",
                    shape=list(given.shape),
                    dynamic={**({0: ids.dynamic[0]} if 0 in ids.dynamic else {}), 1: [1, cache_len]}
                    if given.shape
                    else {},
                    dims={**({0: ids.dims[0]} if 0 in ids.dims else {}), 1: "total_sequence_length"},
                )
            )
    outputs = [
        OutputSpec(_genai_name(o.writes, "output"), o.path, o.kind, o.writes) if o.kind == "write_back" else o
        for o in spec.outputs
        if not (o.kind == "write_back" and _counter_path(o.writes or ""))
        and not (o.kind == "scalar" and _counter_path(o.path))
    ]
    gone = {i.path for i in spec.inputs if _counter_path(i.path) or _mask_path(i.path)}
    relations = [
        relation
        for relation in spec.shape_relations
        if not any(axis[0] in gone for axis in relation.get("axes", {}).values())
    ]
    return replace(spec, inputs=inputs, outputs=outputs, shape_relations=relations, interface=INTERFACE)


def genai_feed(inputs: dict[str, Any]) -> dict[str, Any]:
    """A decode sample in the spec's form (the model's keyword inputs: 4-D masks, a cache with its
    token counters) as a graph :func:`genai_io` rewrote takes it, by input path: the 2-D mask
    of the slots so far (those any query sees) in place of the masks, no counters."""
    import torch

    from hfexport.targets.runner import flat_inputs

    flat = flat_inputs(inputs)
    counter = next(int(value) for path, value in flat.items() if _counter_path(path))
    tokens = flat["input_ids"].shape[1]
    masks = [value for path, value in flat.items() if _mask_path(path)]
    seen = None
    for mask in masks:
        visible = mask != 0 if mask.dtype == torch.bool or not mask.is_floating_point() else mask == 0
        visible = visible.any(dim=-2)[:, 0] if visible.dim() == 4 else visible
        seen = visible if seen is None else seen | visible
    feed = {path: value for path, value in flat.items() if not (_counter_path(path) or _mask_path(path))}
    feed[MASK] = seen[:, : counter + tokens].long().contiguous()
    return feed


GENAI_CONFIG = "genai_config.json"


def genai_config(manifest: Any) -> dict[str, Any]:
    """The ``genai_config.json`` of an export folder whose ``decode`` has ONNX Runtime GenAI's
    interface: the generic ``decoder`` model type over the file, its cache's layers, heads and
    length (``context_length`` and ``search.max_length`` are the static cache's slots: ORT GenAI
    shares the past and present buffers, which it detects from their fixed length, so it writes
    in place as hfexport's own loop does), and the special tokens the manifest recorded from the
    model (eos ids past the vocabulary, which ORT GenAI refuses, left out)."""
    decode = manifest.components["decode"]
    generation = manifest.generation or {}
    facts = generation.get("model", {})
    keys = [i for i in decode.fed if i.name.startswith("past_key_values.") and i.name.endswith(".key")]
    cache_len, kv_heads, head_size = keys[0].shape[2], keys[0].shape[1], keys[0].shape[3]
    vocab = facts.get("vocab_size")
    eos = [i for i in facts.get("eos_token_id", []) if vocab is None or 0 <= i < vocab]
    inputs = {"input_ids": "input_ids", "attention_mask": MASK}
    if any(i.name == "position_ids" for i in decode.fed):
        inputs["position_ids"] = "position_ids"
    inputs |= {"past_key_names": PAST.format("%d", "key"), "past_value_names": PAST.format("%d", "value")}
    outputs = {
        "logits": "logits",
        "present_key_names": PRESENT.format("%d", "key"),
        "present_value_names": PRESENT.format("%d", "value"),
    }
    model: dict[str, Any] = {"type": "decoder"}
    tokens = {"bos_token_id": facts.get("bos_token_id"), "eos_token_id": eos or None}
    tokens["pad_token_id"] = facts.get("pad_token_id", eos[0] if eos else None)
    model |= {key: value for key, value in tokens.items() if value is not None}
    if vocab is not None:
        model["vocab_size"] = vocab
    model["context_length"] = cache_len
    heads = facts.get("num_attention_heads", kv_heads)
    model["decoder"] = {
        "filename": decode.file,
        "session_options": {"log_id": "hfexport", "provider_options": []},
        "head_size": head_size,
        "hidden_size": facts.get("hidden_size", heads * head_size),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": len(keys),
        "inputs": inputs,
        "outputs": outputs,
    }
    search = {
        "max_length": cache_len,
        "past_present_share_buffer": True,
        "num_beams": 1,
        "do_sample": False,
        "top_k": 50,
        "top_p": 1.0,
        "temperature": 1.0,
        "repetition_penalty": 1.0,
        "min_length": 0,
    }
    if not generation.get("multi_token_decode", True):
        search["chunk_size"] = 1  # a decode graph of one token: ORT GenAI feeds the prompt a token at a time
    return {"model": model, "search": search}
