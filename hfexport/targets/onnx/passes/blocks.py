"""4-bit weight blocks with a scale and a float minimum each, on ONNX Runtime's ``MatMulNBits``.

Each block of ``block_size`` weights along the input axis becomes ``minimum + scale * q`` with ``q``
in 0..15, ``scale = (max - min) / 15``: llama.cpp's Q4_1 form. Its minimum is exact, where
``MatMulNBits``'s own asymmetric form rounds it to an integer zero point, up to half a step
off for every weight of the block. That matters most for a checkpoint that is already Q4_1 (a
GGUF file, like SmolLM2-135M's): its weights sit on exactly this lattice, so these blocks hold them
without error, and integer zero points put a second rounding error of the same size on top.

``MatMulNBits`` with float zero points runs a slow dequantise-then-GEMM path on CPU
(microsoft/onnxruntime#28552), so the minimums are applied beside it instead::

    y = MatMulNBits(x, q, scale)            # zero point 8: scale * (q - 8), the int8 fast path
      + MatMul(MatMul(x, block_sums), m)    # m = minimum + 8 * scale, per block and output

``block_sums`` ([K, blocks], ones over each block) sums ``x`` over each block, once per input; the
weights that share an input (q, k, v) are packed into one such form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hfexport.targets.onnx.passes.domains import MS_DOMAIN


def minimum_blocks(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weight`` [K, N] (a MatMul's) → (packed 4-bit ``q`` [N, blocks, block_size / 2], ``scale``
    [N, blocks], ``minimum`` [N, blocks]); ``weight ≈ minimum + scale * q`` per block."""
    k, n = weight.shape
    blocks = -(-k // block_size)
    padded = np.pad(weight, ((0, blocks * block_size - k), (0, 0))) if k % block_size else weight
    grouped = padded.T.reshape(n, blocks, block_size).astype(np.float64)
    low, high = grouped.min(-1), grouped.max(-1)
    scale = (high - low) / 15
    scale[scale == 0] = 1.0
    q = np.clip(np.rint((grouped - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)  # two per byte, the first in the low nibble
    return packed, scale.astype(np.float32), low.astype(np.float32)


def rewrite_with_minimum_blocks(
    model: Any, names: set[str], block_size: int, accuracy_level: int, float_inputs: frozenset[str] = frozenset()
) -> int:
    """Replace each MatMul in ``names`` (top graph, constant [K, N] weight) by the form above, in
    place, and return how many. A ``MatMulNBits`` that takes a MatMul in ``float_inputs`` gets
    ``accuracy_level`` 1 (its input stays fp32), the others ``accuracy_level``.

    The MatMuls that read one input (a layer's q, k and v projections; its gate and up
    projections) are packed into one: their weights side by side along N, one ``MatMulNBits``,
    one minimums ``MatMul`` and one ``Add``, then a ``Split`` into their outputs. Each output
    column keeps its own blocks, so the values are the same; the step runs fewer nodes and
    quantizes the shared input to int8 once instead of once per weight."""
    import onnx
    from onnx import helper, numpy_helper

    initializers = {t.name: t for t in model.graph.initializer}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    groups: dict[str, list[Any]] = {}  # input → the MatMuls reading it, in graph order
    for node in model.graph.node:
        if node.name in names:
            groups.setdefault(node.input[0], []).append(node)
    first = {group[0].name: group for group in groups.values()}
    indicators: dict[int, str] = {}  # K → the [K, blocks] ones matrix
    nodes, added, weights = [], [], set()
    for node in model.graph.node:
        if node.name not in names:
            nodes.append(node)
            continue
        group = first.get(node.name)
        if group is None:
            continue  # packed with the first MatMul reading its input
        x = node.input[0]
        parts = [numpy_helper.to_array(initializers[member.input[1]]) for member in group]
        weight = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        k, n = weight.shape
        packed, scale, low = minimum_blocks(weight, block_size)
        blocks = packed.shape[1]
        base = f"{group[0].input[1]}_q4m" if len(group) == 1 else f"{x}_packed_q4m"
        offsets = low + 8 * scale  # MatMulNBits without zero points takes 8
        added += [
            numpy_helper.from_array(packed, f"{base}_q"),
            numpy_helper.from_array(scale.reshape(-1), f"{base}_scales"),
            numpy_helper.from_array(np.ascontiguousarray(offsets.T), f"{base}_minimums"),
        ]
        if k not in indicators:
            ones = (np.arange(blocks * block_size)[:k, None] // block_size == np.arange(blocks)).astype(np.float32)
            indicators[k] = f"block_sums_{k}x{blocks}"
            added.append(numpy_helper.from_array(ones, indicators[k]))
        sums = f"{x}_block_sums"
        y = group[0].output[0] if len(group) == 1 else f"{x}_packed_matmul"
        label = group[0].name if len(group) == 1 else f"{x}_packed"
        nodes += [
            helper.make_node("MatMul", [x, indicators[k]], [sums], name=sums),
            helper.make_node(
                "MatMulNBits",
                [x, f"{base}_q", f"{base}_scales"],
                [f"{y}_q4"],
                name=f"{label}_Q4",
                domain=MS_DOMAIN,
                K=k,
                N=n,
                bits=4,
                block_size=block_size,
                accuracy_level=1 if any(member.name in float_inputs for member in group) else accuracy_level,
            ),
            helper.make_node("MatMul", [sums, f"{base}_minimums"], [f"{y}_minimums"], name=f"{label}_min"),
            helper.make_node("Add", [f"{y}_q4", f"{y}_minimums"], [y], name=f"{label}_add"),
        ]
        if len(group) > 1:
            sizes = f"{base}_split"
            added.append(numpy_helper.from_array(np.array([p.shape[1] for p in parts], np.int64), sizes))
            outputs = [member.output[0] for member in group]
            nodes.append(helper.make_node("Split", [y, sizes], outputs, name=f"{label}_split", axis=-1))
        for member in group:
            readers[member.input[1]] -= 1
            weights.add(member.input[1])
    unused = {name for name in weights if readers[name] == 0}
    kept = [t for t in model.graph.initializer if t.name not in unused]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + added)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    rewritten = sum(len(group) for group in groups.values())
    if rewritten and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return rewritten
