"""The ``onnx_group_query_attention`` pass: a static cache's attention as ONNX Runtime's
``GroupQueryAttention`` (onnx_ir is imported when the pass runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfexport.pipeline.pass_manager import PassResult, register_pass
from hfexport.targets.onnx.passes.domains import MS_DOMAIN
from hfexport.targets.onnx.passes.graph import take_over


@dataclass
class _CacheWrite:
    """``ScatterElements(cache, index, rows, axis=2)``: a static cache input written at ``index``."""

    cache: Any  # the graph input, [batch, kv_heads, cache_len, head_dim]
    written: Any  # the written cache (a graph output)
    rows: Any  # the new keys or values, [batch, kv_heads, tokens, head_dim]
    index: Any


@dataclass
class _Attention:
    """One layer's ``softmax(q @ kᵀ · scale + bias) @ v`` over its static cache, as captured."""

    query: Any  # [batch, tokens, heads * head_dim] (or normalised [batch, tokens, heads, head_dim]), unrotated
    key: Any  # [batch, tokens, kv_heads * head_dim] (or [batch, tokens, kv_heads, head_dim]), unrotated
    value: Any  # [batch, tokens, kv_heads * head_dim] (or [batch, tokens, kv_heads, head_dim])
    query_rotation: Any  # the RotaryEmbedding nodes, or None for a model without rotary embeddings
    key_rotation: Any
    keys: _CacheWrite
    values: _CacheWrite
    counter: Any  # the scalar token counter: the rows are written from it on
    tokens: Any  # the number of new tokens (a scalar)
    scale: float
    mask: Any  # the boolean graph input [batch, 1, tokens, cache_len] the bias is made from
    guarded: bool  # fully masked rows are zeroed after (zero_fully_masked_attention_rows)
    dtype: Any  # the attention's float type (onnx_ir DataType: FLOAT or FLOAT16)
    output: Any  # [batch, tokens, heads * head_dim]
    last: Any  # the node computing ``output``
    heads: int
    kv_heads: int


def _producer(value: Any, op_type: str) -> Any:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain in ("", MS_DOMAIN) else None


def _only_user(value: Any) -> Any:
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 else None


def _constant(value: Any) -> Any:
    """The numpy value of a constant (an initializer or a ``Constant`` node's), else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].value.numpy()
    return None


def _perm(node: Any) -> tuple[int, ...] | None:
    return tuple(node.attributes["perm"].value) if node is not None and "perm" in node.attributes else None


def _cache_write(value: Any, graph_inputs: set[Any]) -> _CacheWrite | None:
    node = _producer(value, "ScatterElements")
    if (
        node is None
        or node.attributes.get_int("axis", 0) != 2
        or node.attributes.get_string("reduction", "none") != "none"
        or node.inputs[0] not in graph_inputs
    ):
        return None
    return _CacheWrite(node.inputs[0], node.outputs[0], node.inputs[2], node.inputs[1])


def _written_from(index: Any) -> tuple[Any, Any] | None:
    """``(counter, tokens)`` when ``index`` is ``zeros + reshape(range(0, tokens, 1) + counter,
    [1, 1, -1, 1])``: new rows written in consecutive slots from a scalar counter on, as
    ``cache_writes_as_scatter`` writes a static cache."""
    add = _producer(index, "Add")
    if add is None:
        return None
    for zeros, slots in (add.inputs, add.inputs[::-1]):
        expand, reshape = _producer(zeros, "Expand"), _producer(slots, "Reshape")
        fill = _constant(expand.inputs[0]) if expand is not None else None
        shape = _constant(reshape.inputs[1]) if reshape is not None else None
        if fill is None or fill.any() or shape is None or shape.tolist() != [1, 1, -1, 1]:
            continue
        offset = _producer(reshape.inputs[0], "Add")
        for positions, counter in (offset.inputs, offset.inputs[::-1]) if offset is not None else ():
            arange = _producer(positions, "Range")
            if (
                arange is not None
                and _constant(arange.inputs[0]) == 0
                and _constant(arange.inputs[2]) == 1
                and counter.shape is not None
                and counter.shape.rank() == 0
            ):
                return counter, arange.inputs[1]
    return None


def _heads(value: Any) -> tuple[Any, Any] | None:
    """``(x, rotation)`` when ``value`` is ``[rotation](transpose([norm](reshape(x)), [0, 2, 1,
    3]))``: ``x`` [batch, tokens, heads * head_dim] split into heads, each head RMS-normalised
    (Qwen3's query and key norms: then ``x`` is the normalised [batch, tokens, heads, head_dim])
    or not, rotated by ONNX Runtime's ``RotaryEmbedding`` or not at all."""
    rotation = _producer(value, "RotaryEmbedding")
    if rotation is not None:
        if rotation.domain != MS_DOMAIN:
            return None
        value = rotation.inputs[0]
    transpose = _producer(value, "Transpose")
    heads = transpose.inputs[0] if _perm(transpose) == (0, 2, 1, 3) else None
    norm = _producer(heads, "SimplifiedLayerNormalization")
    if norm is not None and norm.attributes.get_int("axis", -1) in (-1, 3) and heads.shape is not None:
        reshape = _producer(norm.inputs[0], "Reshape")
    else:
        norm, reshape = None, _producer(heads, "Reshape")
    if reshape is None or reshape.inputs[0].shape is None or reshape.inputs[0].shape.rank() != 3:
        return None
    if norm is not None and heads.shape.rank() != 4:
        return None
    return (heads if norm is not None else reshape.inputs[0]), rotation


def _mask_under(bias: Any, graph_inputs: set[Any]) -> Any:
    """The boolean graph input ``mask`` [batch, 1, tokens, cache_len] when ``bias`` is
    ``where(mask, 0, lowest)``, the mask repeated over the query groups
    (``reshape(expand(unsqueeze(mask, 2)))``, as ``grouped_query_attention`` lays them out) or not."""
    where = _producer(bias, "Where")
    if where is None or _constant(where.inputs[1]) != 0 or _constant(where.inputs[2]) is None:
        return None
    condition = where.inputs[0]
    if condition not in graph_inputs:
        reshape = _producer(condition, "Reshape")
        expand = _producer(reshape.inputs[0], "Expand") if reshape is not None else None
        unsqueeze = _producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
        axes = _constant(unsqueeze.inputs[1]) if unsqueeze is not None and len(unsqueeze.inputs) > 1 else None
        if axes is None or axes.reshape(-1).tolist() != [2]:
            return None
        condition = unsqueeze.inputs[0]
    shape = condition.shape
    if condition not in graph_inputs or shape is None or shape.rank() != 4 or shape[1] != 1:
        return None
    return condition


def _output_of(scores_times_values: Any) -> tuple[Any, Any, bool] | None:
    """``(output, its node, guarded)``: the attention's ``[batch, tokens, heads * head_dim]``
    result, after an optional guard ``Mul`` and the reshapes and one ``[0, 2, 1, 3]`` transpose
    that merge the heads."""
    value, guarded = scores_times_values, False
    node = _only_user(value)
    if node is not None and node.op_type == "Mul":
        value, guarded = node.outputs[0], True
    transposed = False
    while (node := _only_user(value)) is not None and node.op_type in ("Reshape", "Transpose"):
        if node.op_type == "Transpose":
            if transposed or _perm(node) != (0, 2, 1, 3):
                return None
            transposed = True
        value = node.outputs[0]
        if transposed and node.op_type == "Reshape" and value.shape is not None and value.shape.rank() == 3:
            return value, node, guarded
    return None


def _static_cache_attention(softmax: Any, graph_inputs: set[Any]) -> _Attention | None:
    """The layer's attention around ``softmax``, if it has the form hfexport's ONNX passes give a
    static cache's attention; else None (left as it is)."""
    import onnx_ir as ir

    add = _producer(softmax.inputs[0], "Add")
    mul = _producer(add.inputs[0], "Mul") if add is not None else None
    scale = _constant(mul.inputs[1]) if mul is not None else None
    scores = _producer(mul.inputs[0], "MatMul") if scale is not None and scale.size == 1 else None
    keys_t = _producer(scores.inputs[1], "Transpose") if scores is not None else None
    keys = _cache_write(keys_t.inputs[0], graph_inputs) if _perm(keys_t) == (0, 1, 3, 2) else None
    mixed = _only_user(softmax.outputs[0])
    if keys is None or mixed is None or mixed.op_type != "MatMul" or mixed.inputs[0] is not softmax.outputs[0]:
        return None
    values = _cache_write(mixed.inputs[1], graph_inputs)
    written = _written_from(keys.index) if values is not None and values.index is keys.index else None
    bias = add.inputs[1]
    cast = _producer(bias, "Cast")  # a half-precision model's bias: made in float32, cast to its dtype
    mask = _mask_under(cast.inputs[0] if cast is not None else bias, graph_inputs)
    output = _output_of(mixed.outputs[0])
    if written is None or mask is None or output is None:
        return None
    query = scores.inputs[0]
    grouped = _producer(query, "Reshape")  # [batch, heads, tokens, d] as [batch, kv_heads, groups * tokens, d]
    if grouped is not None and _heads(grouped.inputs[0]) is not None:
        query = grouped.inputs[0]
    q, k, v = _heads(query), _heads(keys.rows), _heads(values.rows)
    if q is None or k is None or v is None or v[1] is not None or (q[1] is None) != (k[1] is None):
        return None
    heads, kv_heads, cache_len = query.shape[1], keys.cache.shape[1], keys.cache.shape[2]
    if not all(isinstance(n, int) for n in (heads, kv_heads, cache_len)) or heads % kv_heads:
        return None
    if grouped is not None and grouped.outputs[0].shape[1] != kv_heads:
        return None
    # ONNX Runtime's CPU kernel runs float32 and float16 (not bfloat16)
    dtypes = {x.dtype for x in (q[0], k[0], v[0], keys.cache, bias)}
    if mask.shape[3] != cache_len or len(dtypes) != 1 or not dtypes <= {ir.DataType.FLOAT, ir.DataType.FLOAT16}:
        return None
    return _Attention(
        query=q[0],
        key=k[0],
        value=v[0],
        query_rotation=q[1],
        key_rotation=k[1],
        keys=keys,
        values=values,
        counter=written[0],
        tokens=written[1],
        scale=float(scale.reshape(-1)[0]),
        mask=mask,
        guarded=output[2],
        dtype=dtypes.pop(),
        output=output[0],
        last=output[1],
        heads=heads,
        kv_heads=kv_heads,
    )


class _Nodes:
    """New nodes (in order) and the pass's shared constants and masks."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.added: list[Any] = []
        self.constants: dict[str, Any] = {}
        self.biases: dict[tuple[Any, Any], tuple[Any, Any, Any]] = {}
        self.query_lengths: dict[tuple[Any, Any], tuple[Any, Any]] = {}

    def op(self, op_type: str, inputs: list[Any], domain: str = "", outputs: int = 1, **attributes: Any) -> Any:
        import onnx_ir as ir

        node = ir.node(op_type, inputs, attributes=attributes, domain=domain, num_outputs=outputs)
        self.added.append(node)
        return node.outputs if outputs > 1 else node.outputs[0]

    def constant(self, name: str, array: Any) -> Any:
        import onnx_ir as ir

        if name not in self.constants:
            self.constants[name] = ir.Value(name=f"hfexport_gqa_{name}", const_value=ir.tensor(array))
            self.graph.register_initializer(self.constants[name])
        return self.constants[name]

    def bias(self, mask: Any, dtype: Any) -> tuple[Any, Any, Any]:
        """``(where(mask, 0, lowest), whether each query row sees a key [batch, tokens, 1], the
        batch size [1])`` in ``dtype`` (the op takes its bias in the query's type), made once per
        mask and dtype."""
        import numpy as np

        if (mask, dtype) not in self.biases:
            numpy_type = dtype.numpy().type
            name = numpy_type.__name__
            lowest = self.constant(f"lowest_{name}", np.array(np.finfo(numpy_type).min, numpy_type))
            bias = self.op("Where", [mask, self.constant(f"zero_{name}", np.array(0.0, numpy_type)), lowest])
            as_float = self.op("Cast", [mask], to=dtype)
            sees = self.op("ReduceMax", [as_float, self.constant("last_axis", np.array([3], np.int64))], keepdims=0)
            sees = self.op("Transpose", [sees], perm=[0, 2, 1])
            self.biases[mask, dtype] = (bias, sees, self.op("Shape", [mask], start=0, end=1))
        return self.biases[mask, dtype]

    def rotated(self, x: Any, rotation: Any, heads: int) -> Any:
        """``rotation`` (a ``RotaryEmbedding`` on ``x``'s heads) on ``x`` [batch, tokens, heads * d]."""
        interleaved = rotation.attributes.get_int("interleaved", 0)
        inputs = [x, *rotation.inputs[1:]]
        return self.op("RotaryEmbedding", inputs, domain=MS_DOMAIN, interleaved=interleaved, num_heads=heads)

    def group_query_attention(self, found: _Attention) -> tuple[Any, Any, Any]:
        """The op's output [batch, tokens, heads * d] (guarded as the layer's was), keys, values."""
        import numpy as np
        import onnx_ir as ir

        bias, sees, batch = self.bias(found.mask, found.dtype)
        # [batch] copies of the number of new tokens (every row of every entry is a valid query:
        # given, ONNX Runtime's CPU kernel also takes several new tokens for a batch of more than
        # one over a cache already written) and of one less
        if (found.tokens, batch) not in self.query_lengths:
            lengths = self.op("Expand", [found.tokens, batch])
            less_one = self.op("Sub", [lengths, self.constant("one", np.array(1, np.int64))])
            self.query_lengths[found.tokens, batch] = (self.op("Cast", [lengths], to=ir.DataType.INT32), less_one)
        query_lengths, less_one = self.query_lengths[found.tokens, batch]
        seqlens_k = self.op("Cast", [self.op("Add", [found.counter, less_one])], to=ir.DataType.INT32)  # last slot
        flat = self.constant("tokens_major", np.array([0, 0, -1], np.int64))
        query, key, value = (
            self.op("Reshape", [x, flat]) if x.shape.rank() == 4 else x for x in (found.query, found.key, found.value)
        )
        if found.query_rotation is not None:  # the same rotations, on the projections before the head split
            query = self.rotated(query, found.query_rotation, found.heads)
            key = self.rotated(key, found.key_rotation, found.kv_heads)
        cache_len = found.keys.cache.shape[2]
        total = self.constant(f"total_{cache_len}", np.array(cache_len, np.int32))
        caches = [found.keys.cache, found.values.cache]
        output, keys, values = self.op(
            "GroupQueryAttention",
            [query, key, value, *caches, seqlens_k, total, None, None, None, bias] + [None] * 5 + [query_lengths],
            domain=MS_DOMAIN,
            outputs=3,
            num_heads=found.heads,
            kv_num_heads=found.kv_heads,
            scale=found.scale,
        )
        return (self.op("Mul", [output, sees]) if found.guarded else output), keys, values


@register_pass(
    name="onnx_group_query_attention",
    stage="onnx_passes",
    runs_after=["onnx_ort_fusions"],
    remove_when=(
        "For a runtime other than ONNX Runtime (GroupQueryAttention is a com.microsoft kernel); "
        "without it, attention reads the whole cache as matmuls."
    ),
)
def onnx_group_query_attention(program: Any) -> PassResult:
    """Each layer's attention over a static cache as one ONNX Runtime ``GroupQueryAttention``,
    which writes the new keys and values into the cache and attends over the written slots.

    Matched: ``softmax(q @ kᵀ · scale + where(mask, 0, lowest)) @ v`` where the keys and values
    are the cache inputs with the new rows scattered in from the layer's token counter on (the
    form ``cache_writes_as_scatter``, ``grouped_query_attention`` and ``onnx_ort_fusions`` leave).
    About 29 nodes per layer (head splits and merges, the cache-write index, both scatters, the
    keys' transpose, the scores, the softmax) become the op, its two rotations on the projections
    before the head split, and 2 nodes making its last written slot from the counter;
    SmolLM2-135M's decode graph went from 1,237 nodes to 598. The mask becomes the op's
    ``attention_bias`` (made once for all layers reading it), so padding, causality and sliding
    windows stay the graph's own; ``zero_fully_masked_attention_rows``'s guard stays, a ``Mul``
    on the output. The op is causal (ONNX Runtime takes its query lengths only so): a mask that
    let a query see a later slot than its own would be cut to causal; the decode loops' masks
    never do. Per-head query and key norms (Qwen3's, fused to ``SimplifiedLayerNormalization``)
    stay before the op. A layer of another form (Gemma3's unfused norms, an additive float mask, a
    windowed cache's wrapped writes) is left as it is. float32 and float16 graphs are fused (ONNX
    Runtime's CPU kernel runs both; a float16 model's bias, made in float32 and cast, is read
    through the cast, and the op's own bias is made in float16).

    ``GroupQueryAttention`` writes the cache in place when the present keys and values are bound
    to the past ones' buffers (:class:`~hfexport.targets.onnx.runner.OnnxDecoder` binds them);
    otherwise it returns a new cache whose slots past the written ones are zeros. Counts:
    ``group_query_attention``, ``nodes_removed``."""
    import onnx_ir.passes.common as common

    model = program.model
    graph = model.graph
    graph_inputs = set(graph.inputs)
    before = sum(1 for _ in graph)
    nodes = _Nodes(graph)
    fused = 0
    for softmax in [node for node in graph if node.op_type == "Softmax"]:
        found = _static_cache_attention(softmax, graph_inputs)
        if found is None:
            continue
        output, keys, values = nodes.group_query_attention(found)
        graph.insert_before(found.last, nodes.added)
        nodes.added = []
        take_over(found.keys.written, keys)
        take_over(found.values.written, values)
        found.output.replace_all_uses_with(output)
        fused += 1
    if fused:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
        common.RemoveUnusedNodesPass()(model)
    counts = {"group_query_attention": fused, "nodes_removed": before - sum(1 for _ in graph)}
    return PassResult(program, modified=fused > 0, counts=counts)


# the ops a rotary table may be computed with from the positions, as numpy (torch for cos and sin:
# eager's own functions, so the tables hold eager's values)
def _unsqueeze(x: Any, axes: Any) -> Any:
    import numpy as np

    rank = x.ndim + len(axes)
    for axis in sorted(int(a) % rank for a in axes):
        x = np.expand_dims(x, axis)
    return x


def _reshape(x: Any, shape: Any) -> Any:
    shape = [x.shape[i] if s == 0 else int(s) for i, s in enumerate(shape.tolist())]
    return x.reshape(shape)


def _by_torch(name: str, x: Any) -> Any:
    import torch

    return getattr(torch.from_numpy(x.copy()), name)().numpy()


def _table_ops() -> dict[str, Any]:
    import numpy as np
    import onnx_ir as ir

    return {
        "Unsqueeze": lambda node, x, axes: _unsqueeze(x, axes.reshape(-1)),
        "Cast": lambda node, x: x.astype(ir.DataType(node.attributes.get_int("to")).numpy()),
        "Mul": lambda node, a, b: a * b,
        "MatMul": lambda node, a, b: np.matmul(a, b),
        "Reshape": lambda node, x, shape: _reshape(x, shape),
        "Transpose": lambda node, x: np.transpose(x, node.attributes.get_ints("perm", None)),
        "Concat": lambda node, *xs: np.concatenate(xs, axis=node.attributes.get_int("axis")),
        "Cos": lambda node, x: _by_torch("cos", x),
        "Sin": lambda node, x: _by_torch("sin", x),
    }


def _constant_array(value: Any) -> Any:
    """``value``'s array when it is an initializer or a ``Constant`` node's output, else None."""
    import numpy as np

    found = _constant(value)
    if found is not None:
        return found
    node = value.producer()
    if node is None or node.op_type != "Constant":
        return None
    for name, attribute in node.attributes.items():
        if name.startswith("value_"):
            return np.array(attribute.value)
    return None


def _rotary_table(rows: Any, graph_inputs: set[Any], slots: int) -> tuple[Any, Any] | None:
    """``(positions, table)``: ``rows`` (a ``RotaryEmbedding``'s cos or sin rows for this call's
    tokens, computed from one integer graph input ``positions`` [batch, tokens]) computed for the
    positions ``0 … slots - 1``, ``[slots, rotary_dim / 2]``; None when ``rows`` is computed from
    anything else or by an op the evaluation does not know."""
    import numpy as np

    ops = _table_ops()
    leaves: list[Any] = []

    def evaluate(value: Any, positions: Any, values: dict[Any, Any]) -> Any:
        if value in values:
            return values[value]
        constant = _constant_array(value)
        node = value.producer()
        if constant is not None:
            result = constant
        elif value in graph_inputs:
            if value.dtype is None or not value.dtype.is_integer() or value.shape is None or value.shape.rank() != 2:
                return None
            if leaves and leaves[0] is not value:
                return None
            leaves[:] = [value]
            result = positions.astype(value.dtype.numpy())[None, :]
        elif node is None or node.op_type not in ops or node.domain != "" or len(node.outputs) != 1:
            return None
        else:
            inputs = [evaluate(x, positions, values) for x in node.inputs]
            if any(x is None for x in inputs):
                return None
            result = ops[node.op_type](node, *inputs)
        values[value] = result
        return result

    slot = np.arange(slots)
    table = evaluate(rows, slot, {})
    if table is None or not leaves or table.ndim != 2 or table.shape[0] != slots:
        return None
    # each row a function of its own position alone (the op reads rows by position): the positions
    # reversed give the rows reversed
    if not np.array_equal(evaluate(rows, slot[::-1].copy(), {}), table[::-1]):
        return None
    return leaves[0], np.ascontiguousarray(table)


@register_pass(
    name="onnx_packed_attention_inputs",
    stage="onnx_passes",
    runs_after=["onnx_packed_projections"],
    remove_when=(
        "For an ONNX Runtime whose GroupQueryAttention takes no position_ids (its tenth input); without it "
        "each layer keeps a Split and its two RotaryEmbedding nodes before the attention."
    ),
)
def onnx_packed_attention_inputs(program: Any) -> PassResult:
    """Each ``GroupQueryAttention`` whose query, key and value are the three parts of one packed
    projection (``onnx_packed_projections``'s ``Split``), rotated by ``RotaryEmbedding`` or not,
    reads the packed projection itself and rotates the query and key inside (``do_rotary``), as
    ONNX Runtime GenAI's model builder lays a layer out: three nodes fewer per layer.

    The op reads its cos / sin from tables indexed by position (at least as many rows as the
    cache has slots, which it checks), so the tables are computed once, at export time, for every
    slot's position by the graph's own angle arithmetic (cos and sin by torch, as eager computes
    them), and the op takes the graph's ``position_ids`` to index them: a left-padded row's
    positions stay its own. A rotation whose angles are computed from anything but one integer
    [batch, tokens] graph input (a dynamic rope's scaling by the longest position), a head size
    not a multiple of 16 or per-head norms between the split and the rotation (Qwen3's) leave the
    layer as it is. Counts: ``packed_attention_inputs``, ``nodes_removed``."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common

    model = program.model
    graph = model.graph
    graph_inputs = set(graph.inputs)
    before = sum(1 for _ in graph)
    tables: dict[tuple[Any, Any], Any] = {}
    packed = 0
    for attention in [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]:
        inputs = list(attention.inputs) + [None] * (17 - len(attention.inputs))
        query, key, value = inputs[:3]
        if key is None or value is None or any(x is not None for x in inputs[7:10]):
            continue
        q_rotation, k_rotation = _producer(query, "RotaryEmbedding"), _producer(key, "RotaryEmbedding")
        if (q_rotation is None) != (k_rotation is None):
            continue
        q_part, k_part = (query, key) if q_rotation is None else (q_rotation.inputs[0], k_rotation.inputs[0])
        split = _producer(q_part, "Split")
        if split is None or list(split.outputs) != [q_part, k_part, value] or split.inputs[0].shape is None:
            continue
        packed_qkv = split.inputs[0]
        if packed_qkv.shape.rank() != 3 or split.attributes.get_int("axis", 0) not in (-1, 2):
            continue
        rotary: dict[str, Any] = {}
        if q_rotation is not None:
            same = all(a is b for a, b in zip(q_rotation.inputs[1:], k_rotation.inputs[1:], strict=True))
            interleaved = {r.attributes.get_int("interleaved", 0) for r in (q_rotation, k_rotation)}
            total, cache = _constant(inputs[6]), inputs[3].shape if inputs[3] is not None else None
            cache_len, head_size = (cache[2], cache[3]) if cache is not None and cache.rank() == 4 else (None, None)
            if not same or len(interleaved) != 1 or total is None:
                continue
            if not isinstance(cache_len, int) or not isinstance(head_size, int) or head_size % 16:
                continue
            slots = max(cache_len, int(total.reshape(-1)[0]))
            made = []
            for rows in q_rotation.inputs[2:4]:
                if (rows, slots) not in tables:
                    found = _rotary_table(rows, graph_inputs, slots)
                    if found is not None and found[1].shape[1] % 8 == 0 and 2 * found[1].shape[1] <= head_size:
                        kind = "cos" if rows is q_rotation.inputs[2] else "sin"
                        table = ir.val(f"hfexport_rotary_{kind}_{len(tables)}", const_value=ir.tensor(found[1]))
                        graph.register_initializer(table)
                        found = (found[0], table)
                    else:
                        found = None
                    tables[rows, slots] = found
                made.append(tables[rows, slots])
            if None in made or made[0][0] is not made[1][0]:
                continue
            positions = made[0][0]
            if positions.shape[0] != packed_qkv.shape[0]:  # one row of positions for every batch entry
                batch = ir.node("Shape", [packed_qkv], attributes={"start": 0, "end": 1})
                tokens = ir.node("Shape", [positions], attributes={"start": 1, "end": 2})
                both = ir.node("Concat", [batch.outputs[0], tokens.outputs[0]], attributes={"axis": 0})
                expand = ir.node("Expand", [positions, both.outputs[0]])
                graph.insert_before(attention, [batch, tokens, both, expand])
                positions = expand.outputs[0]
            rotary = {"do_rotary": 1, "rotary_interleaved": interleaved.pop()}
            inputs[7:10] = [made[0][1], made[1][1], positions]
        while inputs and inputs[-1] is None:
            inputs.pop()
        attributes = {name: attribute.value for name, attribute in attention.attributes.items()}
        fused = ir.node(
            "GroupQueryAttention",
            [packed_qkv, None, None, *inputs[3:]],
            attributes={**attributes, **rotary},
            domain=MS_DOMAIN,
            num_outputs=len(attention.outputs),
        )
        graph.insert_before(attention, [fused])
        for old, new in zip(attention.outputs, fused.outputs, strict=True):
            take_over(old, new)
        packed += 1
    if packed:
        common.RemoveUnusedNodesPass()(model)
    counts = {"packed_attention_inputs": packed, "nodes_removed": before - sum(1 for _ in graph)}
    return PassResult(program, modified=packed > 0, counts=counts)
