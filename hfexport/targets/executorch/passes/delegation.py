"""Rewrites that let the XNNPACK delegate take ops it would leave to ExecuTorch's portable kernels.

Every op XNNPACK refuses splits the delegated graph in two: one more delegate call per step, and a
portable kernel between them. In a decoder layer the norms are such ops, so each pass here is
measured by the ``portable_nodes`` and delegated-subgraph counts of the ``delegate`` stage.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.pipeline.graph_edit import GraphEditor, add_constant, arguments, replace_node
from hfexport.pipeline.pass_manager import PassResult, register_pass

aten = torch.ops.aten


def _last_axis_mean(node: torch.fx.Node) -> int | None:
    """The static size of the last axis when ``node`` is ``mean(x, [-1], keepdim=True)`` of float
    ``x`` with no dtype override, else ``None``."""
    if node.op != "call_function" or node.target is not aten.mean.dim:
        return None
    args = arguments(node)
    value = args["self"].meta["val"]
    dims = args.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if not value.is_floating_point() or args.get("dtype") is not None or not args.get("keepdim", False):
        return None
    if [d % value.dim() for d in dims] != [value.dim() - 1]:
        return None
    size = value.shape[-1]
    return size if isinstance(size, int) else None


@register_pass(
    name="stored_weights_as_float32",
    remove_when=(
        "Without it, the linear layers of a bfloat16 checkpoint the command line exports read their weights through a "
        "cast: to_edge decomposes them and XNNPACK takes none."
    ),
)
def stored_weights_as_float32(program: Any) -> PassResult:
    """Fold each cast to float32 of a weight the model stores narrower than it computes in (the
    command line keeps a bfloat16 checkpoint's linear weights as read,
    :meth:`~hfexport.targets.executorch.ExecutorchTarget.keeps_stored`) into a float32 weight,
    converted one at a time into a temporary file the program maps
    (:func:`~hfexport.targets.executorch.stored_weights.stored_weights_converted`). XNNPACK keeps a
    linear layer whole only when its weight is a parameter, not a cast; the values are the same."""
    from hfexport.targets.executorch.stored_weights import stored_weights_converted

    converted = stored_weights_converted(program)
    return PassResult(program, modified=converted > 0, counts={"converted": converted})


@register_pass(
    name="last_axis_mean_as_linear",
    remove_when=("Without it, each RMSNorm's mean is a portable kernel splitting every delegated layer in three."),
)
def last_axis_mean_as_linear(program: Any) -> PassResult:
    """Rewrite ``mean(x, -1, keepdim=True)`` over a static last axis of size ``n`` (RMSNorm's
    variance) as ``linear(x, full([1, n], 1/n))``: XNNPACK only takes ``mean`` as a 4-D global
    average pool, so each norm was a portable kernel splitting the delegated layer in three;
    a one-output linear layer it takes. The same sum, in another order: results match to rounding."""
    rewritten = 0
    for node in list(program.graph.nodes):
        size = _last_axis_mean(node)
        if size is None:
            continue
        x = arguments(node)["self"]
        dtype = x.meta["val"].dtype
        # one weight per mean: ExecuTorch fails to unlift a delegate whose constant another
        # delegate also holds ("... is not a buffer")
        weight = add_constant(
            program, f"hfexport_mean_weight_{node.name}", torch.full((1, size), 1 / size, dtype=dtype)
        )
        mean = GraphEditor(program.graph, node).call(aten.linear.default, x, weight)
        replace_node(program, node, mean)
        rewritten += 1
    if rewritten:
        program.graph_module.recompile()
    return PassResult(program, modified=rewritten > 0, counts={"rewritten": rewritten})
