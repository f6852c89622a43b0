"""ONNX Runtime's ``RotaryEmbedding`` contrib op in place of onnxscript's intermediate rotary form
(a rewrite rule for the ``onnx_ort_fusions`` pass; imported when that pass runs)."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import pattern

from hfexport.targets.onnx.passes.domains import MS_DOMAIN

# the dtypes of x ONNX Runtime's CPU RotaryEmbedding kernel runs (not bfloat16)
ROTARY_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


class TokenAnglesRotary(pattern.RewriteRuleClassBase):
    """``RotaryEmbedding(x, cos(cat(a, a)), sin(cat(a, a)))`` (onnxscript's intermediate form;
    ``a`` [batch, tokens, head_dim / 2]: each token's angles, however the graph computes them)
    → ``com.microsoft::RotaryEmbedding(x, token_index, cos(a) rows, sin(a) rows)``.

    The contrib op reads its cos / sin from a table by position id. Rather than a table of every
    position the model might see (its size would bound the positions the graph takes), the table
    holds this call's own tokens' rows, ``[batch * tokens, head_dim / 2]`` (``[tokens, …]`` when
    one row of angles serves every batch entry), and each token's "position" is its row: the
    angles are the graph's own, for any position, and computed once for all layers.

    A half-precision model (``cast=True``) computes its angles, cos and sin in float32 and casts
    cos and sin to its own dtype (transformers' rotary embeddings do); the tables are then made
    the same way, cast to ``x``'s dtype, which ONNX Runtime's float16 kernel takes."""

    def __init__(self, cast: bool = False) -> None:
        name = "TokenAnglesRotaryCast" if cast else "TokenAnglesRotary"
        super().__init__(name, remove_nodes=False)  # the angles serve every layer
        self.cast = cast
        self._tables: dict[Any, tuple[Any, Any, Any]] = {}

    def pattern(self, op, x, angles, cos_axes, sin_axes, interleaved, num_heads, cos_to, sin_to):
        both = op.Concat(angles, angles, axis=-1)
        cos, sin = op.Cos(both), op.Sin(both)
        if self.cast:
            cos, sin = op.Cast(cos, to=cos_to), op.Cast(sin, to=sin_to)
        return op.RotaryEmbedding(
            x,
            op.Unsqueeze(cos, cos_axes),
            op.Unsqueeze(sin, sin_axes),
            interleaved=interleaved,
            num_heads=num_heads,
            _domain="ai.onnxruntime._fusion",
        )

    def check(self, context, x, angles, cos_axes, sin_axes, cos_to=None, sin_to=None, **_):
        result = pattern.MatchResult()
        for axes in (cos_axes, sin_axes):
            if axes.const_value is None or axes.const_value.numpy().reshape(-1).tolist() != [1]:
                return result.fail("cos / sin are not broadcast over the heads axis")
        if x.dtype not in ROTARY_DTYPES or angles.dtype != ir.DataType.FLOAT:
            return result.fail("ONNX Runtime's CPU RotaryEmbedding takes float32 or float16, from float32 angles")
        cast_to = {getattr(to, "value", None) for to in (cos_to, sin_to) if to is not None}
        if (cast_to or {ir.DataType.FLOAT}) != {x.dtype}:
            return result.fail("cos / sin are not in x's dtype")
        if x.shape is None or angles.shape is None or x.shape.rank() != 4 or angles.shape.rank() != 3:
            return result.fail("not x [batch, heads, tokens, head_dim] and angles [batch, tokens, half]")
        half = angles.shape[2]
        if not isinstance(half, int) or x.shape[3] != 2 * half:
            return result.fail("the rotation does not cover the whole head")
        if x.shape[2] != angles.shape[1] or angles.shape[0] not in (x.shape[0], 1):
            return result.fail("the angles are not one row per token of x (per batch entry, or for all)")
        return result

    def rewrite(self, op, x, angles, interleaved, num_heads, **_):
        if (angles, x.dtype) not in self._tables:
            rows = op.Constant(value_ints=[-1, angles.shape[2]])
            if angles.shape[0] == 1:  # one row per token for every batch entry: position id = token
                index = op.Constant(value_ints=[0])
            else:  # [batch, tokens] rows: batch entry b's token t reads row b * tokens + t
                batch_tokens = op.Shape(angles, start=0, end=2)
                count = op.ReduceProd(batch_tokens, keepdims=0)
                index = op.Reshape(op.Range(op.Constant(value_int=0), count, op.Constant(value_int=1)), batch_tokens)
            cos, sin = op.Reshape(op.Cos(angles), rows), op.Reshape(op.Sin(angles), rows)
            if x.dtype != angles.dtype:
                cos, sin = op.Cast(cos, to=x.dtype), op.Cast(sin, to=x.dtype)
            self._tables[angles, x.dtype] = (index, cos, sin)
        index, cos, sin = self._tables[angles, x.dtype]
        return op.RotaryEmbedding(x, index, cos, sin, interleaved=interleaved, num_heads=num_heads, _domain=MS_DOMAIN)

    def cleanup(self) -> None:
        self._tables.clear()
