"""Transformers caches as pytree nodes: flatten / unflatten, and through torch.export save / load."""

import torch
import torch.utils._pytree as pytree
from transformers import DynamicCache, EncoderDecoderCache, StaticCache

from hfexport import register_pytree_node
from hfexport.models.caches import register_cache_pytrees


def _filled(cache, layers=2, seq=3):
    for layer in range(layers):
        cache.update(torch.randn(1, 2, seq, 4), torch.randn(1, 2, seq, 4), layer)
    return cache


def test_dynamic_cache_round_trip_with_attribute_paths():
    register_cache_pytrees()
    cache = _filled(DynamicCache())
    leaves, spec = pytree.tree_flatten_with_path({"cache": cache})
    names = [pytree.keystr(path) for path, _ in leaves]
    assert names[:2] == ["['cache'].layers[0].keys", "['cache'].layers[0].values"]
    rebuilt = pytree.tree_unflatten([leaf for _, leaf in leaves], spec)["cache"]
    assert type(rebuilt) is DynamicCache and rebuilt.get_seq_length() == 3
    assert torch.equal(rebuilt.layers[1].values, cache.layers[1].values)


def test_static_and_encoder_decoder_caches_flatten():
    register_cache_pytrees()
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=2)
    static = StaticCache(config=config, max_cache_len=6)
    static.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), 0, {"cache_position": torch.arange(2)})
    leaves, spec = pytree.tree_flatten(static)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is StaticCache and rebuilt.layers[0].max_cache_len == 6
    assert torch.equal(rebuilt.layers[0].keys, static.layers[0].keys)

    both = EncoderDecoderCache(_filled(DynamicCache()), _filled(DynamicCache(), seq=5))
    leaves, spec = pytree.tree_flatten(both)
    assert len(leaves) == 8
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert rebuilt.cross_attention_cache.get_seq_length() == 5


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b
        self.scale = 2


def test_custom_class_registration_and_export_save_load(tmp_path):
    assert register_pytree_node(Pair) is Pair
    register_pytree_node(Pair)  # idempotent

    class M(torch.nn.Module):
        def forward(self, pair):
            return Pair(pair.a + pair.b, pair.a * pair.scale)

    program = torch.export.export(M(), (Pair(torch.ones(2), torch.ones(2)),))
    out = program.module()(Pair(torch.ones(2), torch.full((2,), 3.0)))
    assert torch.equal(out.a, torch.full((2,), 4.0)) and out.scale == 2
    torch.export.save(program, tmp_path / "p.pt2")
    loaded = torch.export.load(tmp_path / "p.pt2")
    assert torch.equal(loaded.module()(Pair(torch.ones(2), torch.ones(2))).b, torch.full((2,), 2.0))
