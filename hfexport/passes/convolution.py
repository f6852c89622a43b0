"""Convolutions that are matrix products in disguise.

A vision tower's patch embedding often runs a convolution whose kernel covers its whole input
(Qwen2-VL: each row of ``pixel_values`` is one 3 x 2 x 14 x 14 patch, viewed as a 5-D tensor and
convolved with a 2 x 14 x 14 kernel). That is a linear layer over the flattened patch, and
backends run it as one: with the pinned stack, ONNX Runtime 1.32 rejects the 3-D Conv torch.onnx
emits for it ("bias must be a 1D tensor of size output_channels") and ExecuTorch's portable
library has no 3-D convolution kernel (``convolution.out`` expects 3-D or 4-D inputs, error 0x12),
while both run (and XNNPACK delegates) a linear layer.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from hfexport.pipeline.graph_edit import GraphEditor, arguments
from hfexport.pipeline.pass_manager import graph_pass

aten = torch.ops.aten

_CONVOLUTIONS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)


def _as_list(value: object, rank: int) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * rank


def _covers_whole_input(node: Node) -> bool:
    """A convolution with one output position: kernel == input spatial size (static), no
    padding, no dilation, one group."""
    args = arguments(node)
    source, weight = args["input"].meta.get("val"), args["weight"].meta.get("val")
    if source is None or weight is None or source.dim() != weight.dim():
        return False
    rank = weight.dim() - 2
    spatial = list(source.shape[2:])
    if not all(isinstance(size, int) for size in spatial) or spatial != list(weight.shape[2:]):
        return False
    padding = args.get("padding", 0)
    no_padding = padding == "valid" or all(p == 0 for p in _as_list(padding, rank))
    return no_padding and all(d == 1 for d in _as_list(args.get("dilation", 1), rank)) and args.get("groups", 1) == 1


@graph_pass(remove_when="Safe to leave out: results agree to rounding; such convolutions then run as convolutions.")
def whole_input_convolutions_as_linear(graph_module: GraphModule) -> int:
    """Rewrite a convolution whose kernel covers its whole (static) spatial input as a linear
    layer over the flattened input: ``conv(x, w, b)`` = ``linear(x.reshape(n, -1),
    w.reshape(out, -1), b).reshape(n, out, 1, …)``. Same products and sums, so the results
    agree to float rounding."""
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target not in _CONVOLUTIONS or not _covers_whole_input(node):
            continue
        args = arguments(node)
        weight = args["weight"]
        out_channels, *kernel = weight.meta["val"].shape
        edit = GraphEditor(graph_module.graph, node)
        flat = edit.call(aten.reshape.default, args["input"], [-1, math.prod(kernel)])
        matrix = edit.call(aten.reshape.default, weight, [out_channels, -1])
        product = edit.call(aten.linear.default, flat, matrix, args.get("bias"))
        result = edit.call(aten.reshape.default, product, [-1, out_channels, *([1] * (len(kernel) - 1))])
        node.replace_all_uses_with(result)
        graph_module.graph.erase_node(node)
        rewritten += 1
    return rewritten


def _dynamic_axes(value: torch.Tensor) -> int:
    return sum(not isinstance(size, int) for size in value.shape)


@graph_pass(
    remove_when=(
        "Without it, a 1-D convolution over a dynamic batch and length stays out of XNNPACK on "
        "ExecuTorch (a portable kernel)."
    )
)
def dynamic_conv1d_as_conv2d(graph_module: GraphModule) -> int:
    """Rewrite a 1-D convolution whose input has more than one dynamic axis (batch and length:
    an audio encoder's feature extractor) as a 2-D one over ``x.unsqueeze(2)``, squeezed back.

    XNNPACK runs a 1-D convolution as a 2-D one between a reshape and its inverse that it adds
    itself, after partitioning, and its reshape takes one dynamic axis: delegating such a
    convolution failed with "XNNPACK reshape only supports 1 dynamic dimension" (its own
    rewrite's squeeze, pytorch/executorch#11449). Made here, the two reshapes are ordinary
    graph nodes that the partitioner leaves to portable kernels, and the convolution is
    delegated. The same products and sums: results agree exactly."""
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target is not aten.conv1d.default:
            continue
        args = arguments(node)
        source = args["input"].meta.get("val")
        if source is None or source.dim() != 3 or _dynamic_axes(source) < 2:
            continue
        edit = GraphEditor(graph_module.graph, node)
        padding = args.get("padding", 0)
        padding = padding if isinstance(padding, str) else [0, _as_list(padding, 1)[0]]
        planar = edit.call(
            aten.conv2d.default,
            edit.call(aten.unsqueeze.default, args["input"], 2),
            edit.call(aten.unsqueeze.default, args["weight"], 2),
            args.get("bias"),
            [1, _as_list(args.get("stride", 1), 1)[0]],
            padding,
            [1, _as_list(args.get("dilation", 1), 1)[0]],
            args.get("groups", 1),
        )
        result = edit.call(aten.squeeze.dim, planar, 2)
        node.replace_all_uses_with(result)
        graph_module.graph.erase_node(node)
        rewritten += 1
    return rewritten
