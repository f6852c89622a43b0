"""Cache passes: a static cache's writes as one scatter (ONNX ScatterElements, in place)."""

import collections

import torch
from graphs import count

from hfexport import get_pass

aten = torch.ops.aten


class StaticCacheWrite(torch.nn.Module):
    """A static cache layer's update: the new keys and values go into slots ``start ..`` along axis 2."""

    def forward(self, keys, values, new, start):
        slots = torch.arange(new.shape[2]) + start
        keys.index_copy_(2, slots, new)
        values.index_copy_(2, slots, -new)
        return keys * 2 + values


def test_cache_writes_become_one_scatter_with_the_same_result(tmp_path):
    keys, values, new, start = (
        torch.zeros(2, 3, 16, 4),
        torch.zeros(2, 3, 16, 4),
        torch.randn(2, 3, 5, 4),
        torch.tensor(6),
    )
    seq = torch.export.Dim("seq", max=16)
    shapes = (None, None, {2: seq}, None)
    program = torch.export.export(StaticCacheWrite(), (keys, values, new, start), dynamic_shapes=shapes)
    result = get_pass("cache_writes_as_scatter")(program)
    assert result.counts == {"rewritten": 2}
    assert count(result.program, aten.index_copy_.default) == 0 and count(result.program, aten.scatter_.src) == 2
    assert count(result.program, aten.zeros_like.default) == 1  # the keys and values share the slots' index
    for length in (5, 1):  # a prompt, then one decode token
        keys, values, new = torch.randn(2, 3, 16, 4), torch.randn(2, 3, 16, 4), torch.randn(2, 3, length, 4)
        expected_keys, expected_values = keys.clone(), values.clone()
        expected = StaticCacheWrite()(expected_keys, expected_values, new, start)
        got = result.program.module()(keys, values, new, start)
        assert torch.equal(got, expected)
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)  # written in place too

    # ONNX: one ScatterElements on the cache axis, no transposes of the whole cache around a ScatterND
    from hfexport.targets.onnx.lowering import to_onnx

    onnx_program = to_onnx(result.program)
    ops = collections.Counter(node.op_type for node in onnx_program.model.graph)
    assert ops["ScatterElements"] == 2 and ops["ScatterND"] == 0 and ops["Transpose"] == 0
