"""Cache passes: a static cache's writes as one scatter (ONNX ScatterElements, in place)."""

import collections

import torch

from hfexport import get_pass

aten = torch.ops.aten


class StaticCacheWrite(torch.nn.Module):
    """A static cache layer's update: the new keys go into slots ``start ..`` along axis 2."""

    def forward(self, cache, new, start):
        slots = torch.arange(new.shape[2]) + start
        cache.index_copy_(2, slots, new)
        return cache * 2


def count(program, target):
    return sum(1 for n in program.graph.nodes if n.target is target)


def test_cache_writes_become_one_scatter_with_the_same_result(tmp_path):
    cache, new, start = torch.zeros(2, 3, 16, 4), torch.randn(2, 3, 5, 4), torch.tensor(6)
    seq = torch.export.Dim("seq", max=16)
    program = torch.export.export(StaticCacheWrite(), (cache, new, start), dynamic_shapes=(None, {2: seq}, None))
    result = get_pass("cache_writes_as_scatter")(program)
    assert result.counts == {"rewritten": 1}
    assert count(result.program, aten.index_copy_.default) == 0 and count(result.program, aten.scatter_.src) == 1
    for length in (5, 1):  # a prompt, then one decode token
        cache, new = torch.randn(2, 3, 16, 4), torch.randn(2, 3, length, 4)
        expected_cache = cache.clone()
        expected = StaticCacheWrite()(expected_cache, new, start)
        got = result.program.module()(cache, new, start)
        assert torch.equal(got, expected) and torch.equal(cache, expected_cache)  # the input written in place too

    # ONNX: one ScatterElements on the cache axis, no transposes of the whole cache around a ScatterND
    from hfexport.targets.onnx.lowering import to_onnx

    onnx_program = to_onnx(result.program)
    ops = collections.Counter(node.op_type for node in onnx_program.model.graph)
    assert ops["ScatterElements"] == 1 and ops["ScatterND"] == 0 and ops["Transpose"] == 0
