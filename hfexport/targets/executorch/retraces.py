"""XNNPACK's preprocess re-traces a partition only when one of its passes changed it.

XNNPACK's ``preprocess`` runs 17 passes over each partition's program, and each of 14 of them ends
by re-tracing the whole partition under fake tensors (``ExportPass.call``) and reporting it
modified, whether it rewrote anything or not. Most find nothing in a language model (an upsample, a
batch norm, a PReLU, a 1-D convolution, a hand-written attention): a Llama-3.2-1B-shaped export
spent about 10 of its 17 ``delegate`` seconds re-tracing 20 unchanged partitions 14 times each.

Under this patch (the ``delegate`` scope) such a pass, one that rewrites the graph before it
re-traces rather than while it does (it overrides none of ``ExportPass``'s tracing hooks), skips
the re-trace when the partition's graph is the one the last re-trace (any pass's) made:
re-tracing it again would make the same graph. The first re-trace of each partition runs.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from hfexport.pipeline.patches import register_patch

# what a pass overrides to rewrite while it re-traces (ExportPass's tracing hooks)
_TRACING_HOOKS = (
    "call_operator",
    "call_sym",
    "call_cond",
    "call_while",
    "call_map",
    "call_scan",
    "call_getitem",
    "call_submodule",
    "call_delegate",
    "placeholder",
    "output",
    "on_attr",
)


def _graph_as_written(graph: torch.fx.Graph) -> list[tuple[Any, ...]]:
    """``graph``'s nodes as they compute: op, name, target, arguments (other nodes by name;
    metadata aside)."""
    from torch.fx.node import map_arg

    def named(args: Any) -> Any:
        return map_arg(args, lambda node: node.name)

    return [(node.op, node.name, node.target, named(node.args), named(node.kwargs)) for node in graph.nodes]


@functools.cache
def _rewrites_before_retracing(pass_type: type) -> bool:
    from executorch.exir.pass_base import ExportPass

    return pass_type.__module__.startswith("executorch.backends.xnnpack.") and all(
        getattr(pass_type, hook, None) is getattr(ExportPass, hook, None) for hook in _TRACING_HOOKS
    )


@register_patch(
    "executorch.exir.pass_base:_ExportPassBase.call",
    name="xnnpack_retraces_only_changed_partitions",
    reason=(
        "XNNPACK's preprocess passes each re-trace the whole partition and report it modified, whether they rewrote "
        "anything or not (a Llama-3.2-1B-shaped export: about 10 of its 17 delegate seconds, 20 partitions re-traced "
        "14 times); a pass that rewrites before it re-traces skips the re-trace of a graph the last one made"
    ),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/_passes/__init__.py",
    scope="delegate",
)
def _retracing_only_changed_graphs(original: Any) -> Any:
    from torch.fx.passes.infra.pass_base import PassResult

    # the graph module each re-trace made, by id, and its graph as written then
    retraced: dict[int, tuple[weakref.ref, list[tuple[Any, ...]]]] = {}

    def call(self: Any, graph_module: torch.fx.GraphModule) -> Any:
        skippable = _rewrites_before_retracing(type(self))
        if skippable:
            made = retraced.get(id(graph_module))
            if made is not None and made[0]() is graph_module and made[1] == _graph_as_written(graph_module.graph):
                return PassResult(graph_module, False)
        result = original(self, graph_module)
        module, key = result.graph_module, id(result.graph_module)
        retraced[key] = (weakref.ref(module, lambda _: retraced.pop(key, None)), _graph_as_written(module.graph))
        return result

    return call
