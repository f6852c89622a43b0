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

Every re-trace of an 8da4w program also runs torchao's quantization ops' Python code for each
quantized linear layer under fake tensors, only to learn its results' sizes. Under the
``torchao_*_fake_results_reused_*`` patches (the ``to_edge``, ``delegate`` and ``to_executorch``
scopes), a call whose inputs' metadata an earlier call in the same shape environment had takes
that call's results' metadata (:func:`_fake_results`).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
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


def _metadata_key(value: Any) -> Any:
    """What a fake tensor's op result can depend on in ``value``: a tensor's sizes, strides
    (symbolic ones as their expressions), dtype and device; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", _symbolic(value.shape), _symbolic(value.stride()), value.dtype, value.device)
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("symbol", str(value.node.expr))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_metadata_key(item) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((name, _metadata_key(item)) for name, item in value.items()))
    return value


def _symbolic(sizes: Any) -> tuple[Any, ...]:
    return tuple(str(size.node.expr) if isinstance(size, torch.SymInt) else int(size) for size in sizes)


def _quantization_ops() -> frozenset[Any]:
    """torchao's quantization ops, when torchao defined them (a program without torchao has none)."""
    if "torchao.quantization.quant_primitives" not in sys.modules:
        return frozenset()
    return _torchao_quantization_ops()


@functools.cache
def _torchao_quantization_ops() -> frozenset[Any]:
    ops = torch.ops.torchao
    return frozenset({ops.choose_qparams_affine.default, ops.quantize_affine.default, ops.dequantize_affine.default})


# per shape environment (its symbols are the keys'; each re-trace makes a fake mode of its own over
# the program's one), by id while it lives: a call's inputs' metadata → its results' (their tree,
# and each tensor's sizes, strides, dtype and device)
_RESULTS: dict[int, dict[Any, Any]] = {}


def _fake_results(op: Any, args: Any, kwargs: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, the call of torchao quantization op ``op`` (of :func:`_quantization_ops`) on
    ``args`` and ``kwargs``, or, when they are fake tensors (and metadata) an earlier call in the
    same shape environment took, fake tensors of that call's results' metadata."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _pytree as pytree

    tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    if not tensors or not all(isinstance(t, FakeTensor) for t in tensors):
        return compute()
    mode = tensors[0].fake_mode
    if mode.propagate_real_tensors or any(t.fake_mode is not mode for t in tensors):
        return compute()
    if id(mode.shape_env) not in _RESULTS:
        if mode.shape_env is not None:
            weakref.finalize(mode.shape_env, _RESULTS.pop, id(mode.shape_env), None)
        _RESULTS[id(mode.shape_env)] = {}
    made = _RESULTS[id(mode.shape_env)]
    key = (op, _metadata_key(args), _metadata_key(kwargs))
    try:
        hash(key)
    except TypeError:  # an argument of a kind these ops do not take: no reuse
        return compute()
    if key in made:
        spec, metadata = made[key]
        results = [
            tensors[0].new_empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in metadata
        ]
        return pytree.tree_unflatten(results, spec)
    result = compute()
    results, spec = pytree.tree_flatten(result)
    if all(isinstance(r, FakeTensor) for r in results):
        made[key] = (spec, [(r.shape, r.stride(), r.dtype, r.device) for r in results])
    return result


def _dispatched_results_reused(original: Any) -> Any:
    def _dispatch_impl(self: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func not in _quantization_ops():
            return original(self, func, types, args, kwargs)
        return _fake_results(func, args, kwargs, lambda: original(self, func, types, args, kwargs))

    return _dispatch_impl


def _called_results_reused(original: Any) -> Any:
    def call_function(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
        # an edge-dialect op wraps its ATen (or torchao) op
        op = target if isinstance(target, torch._ops.OpOverload) else getattr(target, "_op", target)
        if op not in _quantization_ops():
            return original(self, target, args, kwargs)
        return _fake_results(op, args, kwargs, lambda: original(self, target, args, kwargs))

    return call_function


_FAKE_RESULTS_REASON = (
    "each re-trace of an 8da4w program (ExecuTorch's edge passes, XNNPACK's preprocess, the emitter's passes, and "
    "the delegates' original programs each of those re-runs) runs torchao's quantization ops' Python "
    "decompositions under fake tensors only to learn their results' sizes. A call with the inputs' metadata of an "
    "earlier one in the same shape environment takes that one's results' metadata (a Llama-3.2-1B-shaped 8da4w "
    "export's lowering stages: 57 s, 42 s with it)"
)
# where the fake mode meets the op (a delegate's program run for its outputs), and where an
# ExportPass re-trace calls it (its dispatcher runs the Python decomposition before the fake mode)
for _target, _name, _make in (
    ("torch._subclasses.fake_tensor:FakeTensorMode._dispatch_impl", "dispatched", _dispatched_results_reused),
    ("torch.fx.interpreter:Interpreter.call_function", "called", _called_results_reused),
):
    for _scope in ("to_edge", "delegate", "to_executorch"):
        register_patch(
            _target,
            name=f"torchao_{_name}_fake_results_reused_in_{_scope}",
            reason=_FAKE_RESULTS_REASON,
            # torchao registers the ops' Python code as their CompositeImplicitAutograd kernels
            upstream="https://github.com/pytorch/ao/blob/v0.18.0/torchao/utils.py#L209",
            scope=_scope,
        )(_make)
