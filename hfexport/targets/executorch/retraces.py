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

Every ``ExportPass`` re-trace (ExecuTorch's edge passes, XNNPACK's preprocess, the emitter's passes)
also runs each node's op again under fake tensors. Under the ``retrace_*`` patches (the same three
scopes) each re-trace records the graph it made, node by node, with the results it gave them; the
next re-trace of that graph gives a node the result it had when the node is as written then, holds
that result still, and is called with the same op (or its edge-dialect op) on the same arguments,
its inputs the very fake values it read or, for an op whose results alias nothing, ones of the same
sizes, strides and dtype. A node a pass rewrote since, and what reads it when its sizes changed, run
again (a Llama-3.2-1B-shaped export: ``to_edge`` 12.8 → 7.9 s, ``delegate`` 9.6 → 7.0 s, the same
``.pte``). A delegate's call counts as such an op: it takes its lowered module (the very object) and
returns outputs of its own, so the emitter's passes run each delegate's program once, not once per
re-trace (``to_executorch`` 2.6 → 1.6 s).

Each re-trace and each pass manager's check also recompiles the graph module's generated Python
source; under the ``fx_sources_compiled_once_*`` patches a stage compiles each distinct source once.
"""

from __future__ import annotations

import functools
import operator
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


def _register_in_every_lowering_stage(target: str, name: str, reason: str, upstream: str, make: Callable) -> None:
    """``make`` as the patch of ``target`` in each ExecuTorch lowering stage that re-traces
    (``to_edge``, ``delegate``, ``to_executorch``), named ``{name}_in_{stage}``."""
    for scope in ("to_edge", "delegate", "to_executorch"):
        register_patch(target, name=f"{name}_in_{scope}", reason=reason, upstream=upstream, scope=scope)(make)


# where the fake mode meets the op (a delegate's program run for its outputs), and where an
# ExportPass re-trace calls it (its dispatcher runs the Python decomposition before the fake mode)
for _target, _name, _make in (
    ("torch._subclasses.fake_tensor:FakeTensorMode._dispatch_impl", "dispatched", _dispatched_results_reused),
    ("torch.fx.interpreter:Interpreter.call_function", "called", _called_results_reused),
):
    _register_in_every_lowering_stage(
        _target,
        f"torchao_{_name}_fake_results_reused",
        _FAKE_RESULTS_REASON,
        # torchao registers the ops' Python code as their CompositeImplicitAutograd kernels
        "https://github.com/pytorch/ao/blob/v0.18.0/torchao/utils.py#L209",
        _make,
    )


def _interpreter_naming_its_node(original: Any) -> Any:
    def run_node(self: Any, node: torch.fx.Node) -> Any:
        previous = getattr(self.callback, "_hfexport_node", None)
        self.callback._hfexport_node = node
        try:
            return original(self, node)
        finally:
            self.callback._hfexport_node = previous

    return run_node


def _as_written(node: torch.fx.Node) -> tuple[Any, ...]:
    from torch.fx.node import map_arg

    return (node.op, node.target, map_arg(node.args, lambda n: n.name), map_arg(node.kwargs, lambda n: n.name))


# per graph module a re-trace made, by id while it lives: each node (by name) as written then,
# and its result then (a fake value the re-trace computed or took from the re-trace before)
_TRACED: dict[int, tuple[weakref.ref, dict[str, tuple[tuple[Any, ...], Any]]]] = {}


def _recording_retraced_modules(original: Any) -> Any:
    def call_submodule(self: Any, graph_module: torch.fx.GraphModule, inputs: Any) -> Any:
        made = _TRACED.get(id(graph_module))
        previous = getattr(self, "_hfexport_traced", None)
        self._hfexport_traced = made[1] if made is not None and made[0]() is graph_module else None
        try:
            result = original(self, graph_module, inputs)
        finally:
            self._hfexport_traced = previous
        module, key = result.graph_module, id(result.graph_module)
        nodes = {node.name: (_as_written(node), _recorded_value(module, node)) for node in module.graph.nodes}
        _TRACED[key] = (weakref.ref(module, lambda _: _TRACED.pop(key, None)), nodes)
        return result

    return call_submodule


def _recorded_value(module: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    """What ``node`` gave the re-trace that made ``module``: its result, or for a ``get_attr``
    node the attribute itself (a delegate's lowered module, which its call takes)."""
    if node.op != "get_attr":
        return node.meta.get("val")
    try:
        return operator.attrgetter(node.target)(module)
    except AttributeError:
        return None


def _traced_result(traced: dict[str, tuple[tuple[Any, ...], Any]], node: torch.fx.Node) -> Any:
    """``node``'s result as the last re-trace made it, when ``node`` is as that re-trace wrote it
    and still holds that result; None when a pass since changed either."""
    record = traced.get(node.name)
    if record is None or record[1] is None or record[1] is not node.meta.get("val") or record[0] != _as_written(node):
        return None
    return record[1]


def _same_call(traced: dict[str, Any], node: torch.fx.Node, target: Any, args: Any, kwargs: Any) -> bool:
    """Whether the re-trace calls ``target`` (``node``'s op, or its edge-dialect op) on what
    ``node`` took when the last re-trace computed its result: every argument equal, and each
    input that very fake value, or (for an op whose results alias nothing) one of its sizes,
    strides and dtype."""
    if target is not node.target and getattr(target, "_op", None) is not node.target:
        return False
    return _same_arguments(traced, (args, kwargs), (node.args, node.kwargs), _fresh_results(node.target))


@functools.cache
def _fresh_results(op: Any) -> bool:
    """``op`` (an ATen or edge-dialect op, or a delegate's call) writes into none of its inputs and
    returns none of them (a delegate returns the outputs of its own ops, which the partitioner made
    of whole nodes: no input passes through, and a view op is a copy in the edge dialect)."""
    if op is _call_delegate():
        return True
    schema = getattr(op, "_schema", None) or getattr(getattr(op, "_op", None), "_schema", None)
    return schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def _same_arguments(traced: dict[str, Any], new: Any, old: Any, fresh: bool) -> bool:
    from executorch.exir.pass_base import ProxyValue

    if isinstance(old, torch.fx.Node):
        record = traced.get(old.name)
        if record is not None and old.op == "get_attr" and not isinstance(new, ProxyValue):
            return new is record[1] is not None  # the very attribute (a lowered module)
        return isinstance(new, ProxyValue) and record is not None and _same_value(new.data, record[1], fresh)
    if isinstance(old, list | tuple):  # fx keeps its own list type: the kind of sequence does not count
        return (
            isinstance(new, list | tuple)
            and len(new) == len(old)
            and all(_same_arguments(traced, a, b, fresh) for a, b in zip(new, old, strict=True))
        )
    if isinstance(old, dict):
        return (
            isinstance(new, dict)
            and new.keys() == old.keys()
            and all(_same_arguments(traced, new[k], old[k], fresh) for k in old)
        )
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        return new is old
    return type(new) is type(old) and new == old


def _same_value(new: Any, old: Any, fresh: bool) -> bool:
    """``new`` is ``old`` (a fake tensor: the very one, or for an op with ``fresh`` results one
    of its metadata that carries no constant), or the same symbolic size."""
    from torch._subclasses.fake_tensor import FakeTensor

    if old is None:
        return False
    if isinstance(old, torch.SymInt | torch.SymFloat | torch.SymBool):
        return type(new) is type(old) and new.node.expr == old.node.expr
    if new is old:
        return True
    return (
        fresh
        and isinstance(new, FakeTensor)
        and isinstance(old, FakeTensor)
        and new.fake_mode is old.fake_mode
        and new.constant is None
        and old.constant is None
        and _metadata_key(new) == _metadata_key(old)
    )


def _reusable(value: Any, mode: Any) -> bool:
    """``value`` (a node's result) is fake tensors of ``mode``, or sizes."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves(value)
    return bool(leaves) and all(
        not isinstance(leaf, torch.Tensor) or (isinstance(leaf, FakeTensor) and leaf.fake_mode is mode)
        for leaf in leaves
    )


def _results_of_unchanged_nodes_reused(original: Any) -> Any:
    def _fx(self: Any, kind: str, target: Any, args: Any, kwargs: Any, meta: Any) -> Any:
        node = getattr(self, "_hfexport_node", None)
        traced = getattr(self, "_hfexport_traced", None)
        value = _traced_result(traced, node) if traced and node is not None and kind == "call_function" else None
        if (
            value is None
            or not (isinstance(target, torch._ops.OpOverload | _edge_op_type()) or target is _call_delegate())
            or not _same_call(traced, node, target, args, kwargs)
            or not _reusable(value, self.fake_tensor_mode)
        ):
            return original(self, kind, target, args, kwargs, meta)
        from executorch.exir.pass_base import ProxyValue
        from torch.utils import _pytree as pytree

        self._hfexport_node = None  # once per node: a second call of the same op dispatches
        # as ExportPass._fx, with the node's result in place of running the op again
        args_proxy, kwargs_proxy = pytree.tree_map_only(ProxyValue, lambda x: x.proxy, (args, kwargs))
        name = None
        if isinstance(target, torch._ops.OpOverload):
            name = self.tracer.graph._target_to_str(target.overloadpacket.__name__)
        proxy = self.tracer.create_proxy(kind, target, args_proxy, kwargs_proxy, name=name)
        proxy.node.meta.update(meta.data)
        self.tracer.set_metadata(proxy.node, value)
        return ProxyValue(value, proxy)

    return _fx


@functools.cache
def _call_delegate() -> Any:
    from executorch.exir.delegate import executorch_call_delegate

    return executorch_call_delegate


@functools.cache
def _edge_op_type() -> type:
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    return EdgeOpOverload


_UNCHANGED_REASON = (
    "an ExportPass re-trace runs every node's op again under fake tensors to learn its result's sizes; a node that "
    "the last re-trace computed and no pass changed since, called with the same op (or its edge-dialect op) on "
    "inputs of the same metadata, gets the result it had (a Llama-3.2-1B-shaped export: to_edge 12.8 -> 7.9 s, "
    "delegate 9.6 -> 7.0 s)"
)
for _target, _name, _make in (
    (
        "executorch.exir.pass_base:_ExportPassBase.ExportInterpreter.run_node",
        "names_its_node",
        _interpreter_naming_its_node,
    ),
    ("executorch.exir.pass_base:_ExportPassBase.call_submodule", "records_its_results", _recording_retraced_modules),
    # torch's own ExportPass base, which the edge dialect's first re-trace uses (views to copies):
    # recorded, so that the next re-trace, ExecuTorch's, does not run every op again
    (
        "torch._export.pass_base:_ExportPassBaseDeprecatedDoNotUse.call_submodule",
        "of_torch_records_its_results",
        _recording_retraced_modules,
    ),
    ("executorch.exir.pass_base:_ExportPassBase._fx", "reuses_unchanged_results", _results_of_unchanged_nodes_reused),
):
    _register_in_every_lowering_stage(
        _target,
        f"retrace_{_name}",
        _UNCHANGED_REASON,
        "https://github.com/pytorch/executorch/blob/v1.4.1/exir/pass_base.py",
        _make,
    )


# the sources compiled in one stage, kept for their next recompile (a 1,300-node graph's is ~300 KB)
_COMPILED_SOURCES = 256


def _each_source_compiled_once(original: Any) -> Any:
    """``torch.fx.graph_module._exec_with_source`` compiling each generated source once per stage:
    a source compiled before, for a graph of the same origin (``co_fields``), runs its code object
    again in the new module's globals (a function's code does not depend on the globals it is
    defined in; its traceback names the first compile's file, of the same text)."""
    from torch.fx import graph_module

    compiled: dict[tuple[str, Any], Any] = {}

    def exec_with_source(src: str, globals: dict[str, Any], co_fields: dict[str, Any] | None = None) -> None:
        key = (src, tuple(sorted(co_fields.items())) if co_fields else None)
        code = compiled.get(key)
        if code is None:
            code = compile(src, graph_module._loader.cache(src, globals, co_fields), "exec", dont_inherit=True)
            if len(compiled) >= _COMPILED_SOURCES:
                del compiled[next(iter(compiled))]
            compiled[key] = code
        exec(code, globals)

    return exec_with_source


_register_in_every_lowering_stage(
    "torch.fx.graph_module:_exec_with_source",
    "fx_sources_compiled_once",
    (
        "every GraphModule recompile compiles its generated Python source, and the lowering recompiles the same "
        "graphs again and again (the pass managers' checks, each pass's result, each new module): a "
        "Llama-3.2-1B-shaped export compiled 2,604 sources, 173 of them different, in 1.8 s"
    ),
    "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/fx/graph_module.py#L134",
    _each_source_compiled_once,
)


def _matching_only_where_the_pattern_can_be(necessary_op: str) -> Callable[[Any], Any]:
    """An XNNPACK pattern pass's ``call`` that, on a partition without ``necessary_op`` (an op of
    every graph the pass matches, ``"aten._softmax.default"``), finds no match without building
    the patterns: it re-traces, as the pass does after matching nothing."""

    def make(original: Any) -> Any:
        def call(self: Any, graph_module: torch.fx.GraphModule) -> Any:
            from executorch.exir.dialects._ops import ops as exir_ops
            from executorch.exir.pass_base import ExportPass
            from torch.fx.passes.infra.pass_base import PassResult

            op = operator.attrgetter(necessary_op)(exir_ops.edge)
            if any(node.target == op for node in graph_module.graph.nodes):
                return original(self, graph_module)
            graph_module.recompile()
            return PassResult(ExportPass.call(self, graph_module).graph_module, True)

        return call

    return make


for _pass, _name, _op in (
    ("convert_to_sdpa:ConvertToSDPAPass", "sdpa", "aten._softmax.default"),
    ("convert_to_upsample_bilinear2d:ConvertToUpsampleBilinear2d", "upsample", "aten.upsample_bilinear2d.vec"),
):
    register_patch(
        f"executorch.backends.xnnpack._passes.{_pass}.call",
        name=f"xnnpack_{_name}_pass_matches_only_where_it_can",
        reason=(
            "XNNPACK's SDPA and bilinear-upsample passes build their patterns (an export and an edge lowering of a "
            "module each, once per process: 1.9 s of a Llama-3.2-1B-shaped export) to look for them in every "
            f"partition; a partition without {_op}, an op of every pattern, has no match"
        ),
        upstream=f"https://github.com/pytorch/executorch/blob/v1.4.1/backends/xnnpack/_passes/{_pass.split(':')[0]}.py",
        scope="delegate",
    )(_matching_only_where_the_pattern_can_be(_op))
