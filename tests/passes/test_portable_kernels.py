"""Rewrites of ops without ExecuTorch portable kernels: counts before / after and numerics."""

import torch
from graphs import count

from hfexport import get_pass

aten = torch.ops.aten


class Routing(torch.nn.Module):
    """The MoE routing bookkeeping of transformers' grouped experts."""

    def forward(self, expert_ids):
        sorted_ids, perm = torch.sort(expert_ids)
        counts = torch.histc(sorted_ids.float(), bins=4, min=0, max=3)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        return counts, sorted_ids, inverse


def test_rewrites_keep_routing_numerics():
    ids = torch.tensor([3, 1, 1, 0, 3, 3, 2, 1])
    program = torch.export.export(Routing(), (ids,), dynamic_shapes=({0: torch.export.Dim("n", max=64)},))
    assert count(program, aten.histc.default) == 1 and count(program, aten.sort.default) == 1
    assert count(program, aten.empty_like.default) == 1
    for name, gone, added in [
        ("histc_to_comparisons", aten.histc.default, aten.eq.Tensor),
        ("sort_to_topk", aten.sort.default, aten.topk.default),
        ("empty_like_to_zeros_like", aten.empty_like.default, aten.zeros_like.default),
    ]:
        result = get_pass(name)(program)
        assert result.counts == {"rewritten": 1}, name
        assert count(result.program, gone) == 0 and count(result.program, added) >= 1, name
    for sample in [ids, torch.tensor([2, 2, 0]), torch.randint(0, 4, (40,))]:
        counts, sorted_ids, inverse = program.module()(sample)
        expected_counts, expected_sorted, _ = Routing()(sample)
        torch.testing.assert_close(counts, expected_counts)
        assert torch.equal(sorted_ids, expected_sorted)
        # the inverse permutation still undoes the sort, whatever the order among equal ids
        assert torch.equal(sorted_ids[inverse], sample)


def test_histc_counts_values_at_the_edges():
    class Histogram(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=5, min=-1.0, max=1.0)

    x = torch.tensor([-1.0, -0.99, 0.0, 0.39, 0.4, 1.0, 1.5, -2.0])
    program = torch.export.export(Histogram(), (x,))
    get_pass("histc_to_comparisons")(program)
    torch.testing.assert_close(program.module()(x), torch.histc(x, bins=5, min=-1.0, max=1.0))


def test_an_empty_of_symbolic_size_keeps_its_axes_dynamic_on_executorch():
    # multi-head latent attention builds its keys in new_empty, then copies two slices in: to_edge's
    # _empty_dim_order read the symbolic size as ints and the program took the sample's batch and
    # length only ("input 'input_ids' axis 0 has size 3, above the exported upper bound 2")
    from hfexport import ExecutorchConfig, ExecutorchExporter, ExecutorchRunner

    class LatentKeys(torch.nn.Module):
        def forward(self, nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
            keys = nope.new_empty(*nope.shape[:-1], nope.shape[-1] + rope.shape[-1])
            keys[..., : nope.shape[-1]].copy_(nope)
            keys[..., nope.shape[-1] :].copy_(rope)
            return keys * 2

    model = LatentKeys().eval()
    sample = {"nope": torch.randn(2, 5, 8), "rope": torch.randn(2, 5, 4)}
    result = ExecutorchExporter().export(model, sample, ExecutorchConfig(dynamic=True))
    other = {"nope": torch.randn(3, 9, 8), "rope": torch.randn(3, 9, 4)}
    got = ExecutorchRunner(result).run(other)[0]
    torch.testing.assert_close(got, model(**other), atol=0, rtol=0)
    axes = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    program = torch.export.export(model, (), sample, dynamic_shapes={"nope": axes, "rope": axes})
    assert get_pass("empty_of_symbolic_size_to_zeros")(program).counts == {"rewritten": 1}
    assert count(program, aten.new_empty.default) == 0 and count(program, aten.new_zeros.default) == 1
