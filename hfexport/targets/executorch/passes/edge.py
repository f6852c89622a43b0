"""The ``edge_passes`` stage: rewrites of ExecuTorch's edge-dialect program, after ``to_edge`` and
before the delegation, each a registered pass (listed by ``hfexport passes --format executorch``,
dumped, timed and verified like the FX passes).

They take what decomposing for the partitioners leaves behind and XNNPACK would run as extra
operators or leave to portable kernels between delegated graphs: whole-cache copies, same-shape
expands and views, symbolic view sizes, transposes around the rotary embedding, contiguous clones,
and a state cache read transposed. Each pass is a function ``fn(edge_program) -> int`` (matches
rewritten) over the ``EdgeProgramManager``'s program, which it edits in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from hfexport.pipeline.pass_manager import Pass, PassResult, register_pass
from hfexport.targets.manifest import INPUT_SHAPE, STATE_PREFIX

EDGE_PASSES = "edge_passes"


def edge_pass(fn: Callable[[torch.export.ExportedProgram], int], remove_when: str = "") -> Pass:
    """Register ``fn(edge_program) -> int`` as a pass of the ``edge_passes`` stage: it rewrites
    the ``EdgeProgramManager``'s program in place and returns how many matches it rewrote."""

    def run(edge: Any) -> PassResult:
        rewritten = fn(edge.exported_program())
        return PassResult(edge, modified=bool(rewritten), counts={"rewritten": rewritten})

    functools.update_wrapper(run, fn)
    return register_pass(run, name=fn.__name__, stage=EDGE_PASSES, remove_when=remove_when)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the row-major strides of its shape, size-one axes included."""
    return tensor.clone(memory_format=torch.contiguous_format)


def state_in_attention_layout(program: torch.export.ExportedProgram) -> int:
    """Lay out each state buffer that the program reads only as ``attention_as_custom_sdpa`` hands
    a cache to the fused kernel, its first keys transposed from ``[batch, heads, length, dim]`` to
    ``[batch, length, heads, dim]``, in that order, and return how many were.

    The kernel's keys are then the buffer's first rows as they lie, where each step transposed
    them; the write (``index_put_`` along the length axis, in place) takes the new rows transposed
    instead, one step's rows. The initial value is transposed to match."""
    from executorch.exir.dialects._ops import ops as exir_ops

    swap = [0, 2, 1, 3]
    graph = program.graph_module.graph
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}

    def transposed(node: torch.fx.Node) -> bool:
        return edge_op(node, "aten::permute_copy") and list(node.args[1]) == swap

    def first_keys(read: torch.fx.Node) -> bool:  # slice_copy(cache, 2, 0, n), read only transposed
        return (
            edge_op(read, "aten::slice_copy.Tensor")
            and tuple(read.args[1:3]) == (2, 0)
            and len(read.args) <= 4
            and all(transposed(user) for user in read.users)
        )

    changed = 0
    for spec in program.graph_signature.input_specs:
        buffer = placeholders.get(getattr(spec.arg, "name", None))
        if buffer is None or not str(spec.target).startswith(STATE_PREFIX) or len(buffer.users) != 1:
            continue
        (write,) = buffer.users
        if not edge_op(write, "aten::index_put_") or write.args[0] is not buffer or buffer.meta["val"].dim() != 4:
            continue
        indices, rows = write.args[1], write.args[2]
        reads = [user for user in write.users if user.op != "output"]
        if len(indices) != 3 or indices[:2] != [None, None] or not reads or not all(map(first_keys, reads)):
            continue
        # clone, not contiguous(): with one head (multi-query attention) the permuted tensor counts
        # as contiguous and keeps its strides, from which ExecuTorch reads another dim order than the
        # rows written into it have ("2 input tensors have different dim orders" in index_put_)
        initial = _contiguous(program.state_dict[spec.target].permute(swap))
        program.state_dict[spec.target] = initial
        fake_mode = buffer.meta["val"].fake_mode
        buffer.meta[INPUT_SHAPE] = [int(size) for size in buffer.meta["val"].shape]
        buffer.meta["val"] = fake_mode.from_tensor(initial, static_shapes=True)
        if transposed(rows):
            rows = rows.args[0]  # the values: transposed from [batch, length, heads, dim] just before
        else:
            with graph.inserting_before(write):
                node = graph.call_function(exir_ops.edge.aten.permute_copy.default, (rows, swap))
            with fake_mode:
                node.meta["val"] = _contiguous(rows.meta["val"].permute(swap))
            rows = node
        write.args = (buffer, [None, indices[2]], rows, *write.args[3:])
        write.meta["val"] = fake_mode.from_tensor(initial, static_shapes=True)
        for read in reads:
            read.args = (write, 1, *read.args[2:])
            with fake_mode:
                read.meta["val"] = next(iter(read.users)).meta["val"].clone()
            for user in list(read.users):
                user.replace_all_uses_with(read)
                graph.erase_node(user)
        changed += 1
    if changed:
        program.graph_module.recompile()
    return changed


_HEAD_SWAP = [0, 2, 1, 3]  # [batch, length, heads, dim] <-> [batch, heads, length, dim]: its own inverse
_ELEMENTWISE = ("aten::mul.Tensor", "aten::add.Tensor", "aten::sub.Tensor")


def cancel_head_transposes(program: torch.export.ExportedProgram) -> int:
    """Where a 4-D tensor is transposed between the head and length axes, goes through elementwise
    ops (``mul``, ``add``, ``sub``) and last-axis linears only, and every result leaving them is
    transposed back, run those ops on the untransposed tensor and drop both transposes; a 4-D
    operand from outside is transposed instead, once however many such chains use it. Returns how
    many chains changed.

    A decoder layer has three such chains: the query's and the key's rotary embedding (the model
    transposes them to ``[batch, heads, length, dim]``; ``custom_sdpa`` and the state cache take them
    back to ``[batch, length, heads, dim]``) and the attention output's row mask. Each XNNPACK
    transpose is one more operator a step runs and re-plans (the length axis is dynamic): six per
    layer. The values are the same, computed in another memory order."""
    from executorch.exir.dialects._ops import ops as exir_ops

    graph = program.graph_module.graph
    transposed_operands: dict[torch.fx.Node, torch.fx.Node] = {}

    def swaps(node: Any) -> bool:
        return (
            isinstance(node, torch.fx.Node)
            and edge_op(node, "aten::permute_copy")
            and list(node.args[1]) == _HEAD_SWAP
            and node.meta["val"].dim() == 4
        )

    def region(head: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
        """The ops between ``head`` and the transposes back (in graph order), and those transposes."""
        inside, exits, queue = [], [], [head]
        while queue:
            node = queue.pop()
            for user in node.users:
                if user in inside or user in exits:
                    continue
                if swaps(user) and user is not head:
                    exits.append(user)
                elif edge_op(user, "aten::linear") and user.args[0] is node and user.args[1] is not node:
                    inside.append(user)
                    queue.append(user)
                elif any(edge_op(user, name) for name in _ELEMENTWISE) and not user.kwargs and len(user.args) == 2:
                    inside.append(user)
                    queue.append(user)
                else:
                    return None
        members = set(inside) | {head}
        for node in inside:  # an operand from outside must not depend on the head axis' order
            if edge_op(node, "aten::linear"):
                continue  # its weight (and bias) act on the last axis only
            for operand in node.args:
                if operand in members or not isinstance(operand, torch.fx.Node):
                    continue
                shape = operand.meta["val"].shape
                if len(shape) != 4 and any(size != 1 for size in shape[:-1]):
                    return None
        order = {node: index for index, node in enumerate(graph.nodes)}
        return sorted(inside, key=order.__getitem__), exits

    def transposed(operand: torch.fx.Node) -> torch.fx.Node:
        if swaps(operand):
            return operand.args[0]
        if operand not in transposed_operands:
            # [batch, 1, length, dim] made by unsqueeze(x, 1) (the rotary's cos and sin) is unsqueeze(x, 2) transposed
            unsqueezed = edge_op(operand, "aten::unsqueeze_copy") and operand.args[1] in (1, -3)
            after = operand if operand.op == "call_function" else [n for n in graph.nodes if n.op == "placeholder"][-1]
            with graph.inserting_after(after):
                node = (
                    graph.call_function(exir_ops.edge.aten.unsqueeze_copy.default, (operand.args[0], 2))
                    if unsqueezed
                    else graph.call_function(exir_ops.edge.aten.permute_copy.default, (operand, _HEAD_SWAP))
                )
            with operand.meta["val"].fake_mode:
                node.meta["val"] = operand.meta["val"].permute(_HEAD_SWAP).contiguous()
            transposed_operands[operand] = node
        return transposed_operands[operand]

    changed = 0
    erased: set[torch.fx.Node] = set()
    for head in [node for node in graph.nodes if swaps(node)]:
        if head in erased:
            continue
        if not head.users:  # left by an earlier rewrite (a value's transpose once the cache took it as is)
            graph.erase_node(head)
            erased.add(head)
            continue
        found = region(head)
        if found is None or not found[1]:
            continue
        inside, exits = found
        members = set(inside)
        for node in inside:
            node.args = tuple(
                head.args[0]
                if arg is head
                else transposed(arg)
                if isinstance(arg, torch.fx.Node)
                and arg not in members
                and arg.meta["val"].dim() == 4
                and not (edge_op(node, "aten::linear") and index > 0)
                else arg
                for index, arg in enumerate(node.args)
            )
            with node.meta["val"].fake_mode:
                node.meta["val"] = node.meta["val"].permute(_HEAD_SWAP).contiguous()
        for exit_ in exits:
            replace_node(program, exit_, head.args[0] if exit_.args[0] is head else exit_.args[0])
            erased.add(exit_)
        if not head.users:
            graph.erase_node(head)
            erased.add(head)
        changed += 1
    for operand in transposed_operands:  # the rotary's cos and sin unsqueezed for the other order
        if not operand.users and operand.op == "call_function":
            graph.erase_node(operand)
    if changed:
        program.graph_module.recompile()
    return changed


def drop_same_layout_copies(program: torch.export.ExportedProgram) -> int:
    """Replace each functional ``copy(like, src)`` whose ``like`` has ``src``'s shape, strides and
    dtype by ``src`` itself (the values are ``src``'s), and return how many went.

    ExecuTorch's own edge conversion functionalises a program that writes its inputs in place (a
    static cache) and then decomposes it, and each round leaves a ``copy(cache, new value)`` per
    written input: two whole-cache copies per layer and step. The ``to_edge`` stage does both in one
    re-trace and leaves none; an edge program ExecuTorch converted still has them. Only a ``src``
    computed in the graph qualifies: a program input may be written back before a user of the copy
    runs (pytorch/pytorch#198131)."""
    graph = program.graph_module.graph
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "_name", None) != "aten::copy":
            continue
        like, src = node.args[0], node.args[1]
        if len(node.args) > 2 or node.kwargs or not isinstance(src, torch.fx.Node) or src.op == "placeholder":
            continue
        a, b = like.meta.get("val"), src.meta.get("val")
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            continue
        if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
            continue
        replace_node(program, node, src)
        dropped += 1
    if dropped:
        program.graph_module.recompile()
    return dropped


def replace_node(program: torch.export.ExportedProgram, node: torch.fx.Node, value: torch.fx.Node) -> None:
    """Give ``node``'s users ``value`` instead and erase ``node``; a program output (a user output,
    an input's write-back) that named ``node`` names ``value``."""
    node.replace_all_uses_with(value)
    for spec in program.graph_signature.output_specs:
        if getattr(spec.arg, "name", None) == node.name:
            spec.arg = type(spec.arg)(name=value.name)
    node.graph.erase_node(node)


def edge_op(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_function" and getattr(node.target, "_name", None) == name


def drop_same_shape_expands(program: torch.export.ExportedProgram) -> int:
    """Replace each ``expand_copy`` whose result has its input's shape by the input, and return how
    many went. Decomposing ``matmul`` expands both operands to the broadcast shape, a copy of the
    whole key cache per layer when the shapes already match, and XNNPACK takes no ``expand_copy``
    with a dynamic axis, so each one also split the layer's delegated graph."""
    return _drop_identities(program, "aten::expand_copy", lambda node: _same_shape(node.args[0], node))


def drop_same_shape_views(program: torch.export.ExportedProgram) -> int:
    """Replace each ``view_copy`` whose result has its input's shape (a reshape to the same
    ``[batch, heads, -1, dim]``, as attention outputs get) by the input, and return how many went."""
    return _drop_identities(program, "aten::view_copy", lambda node: _same_shape(node.args[0], node))


def drop_contiguous_clones(program: torch.export.ExportedProgram) -> int:
    """Replace each ``_clone_dim_order`` to the contiguous order of an input already contiguous by
    the input, and return how many went (a transpose's ``.contiguous()`` once the transpose has
    gone: :func:`cancel_head_transposes`)."""

    def identity(node: torch.fx.Node) -> bool:
        value = node.args[0].meta.get("val")
        order = node.kwargs.get("dim_order")
        return (
            isinstance(value, torch.Tensor)
            and value.is_contiguous()
            and (order is None or list(order) == list(range(value.dim())))
        )

    return _drop_identities(program, "dim_order_ops::_clone_dim_order", identity)


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    x, y = a.meta.get("val"), b.meta.get("val")
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape


def _drop_identities(program: torch.export.ExportedProgram, name: str, identity: Any) -> int:
    """Replace each ``name`` op that ``identity(node)`` says returns its first argument's values
    by that argument (not a program output's value), and return how many went."""
    graph = program.graph_module.graph
    outputs = {getattr(spec.arg, "name", None) for spec in program.graph_signature.output_specs}
    dropped = 0
    for node in list(graph.nodes):
        if not edge_op(node, name) or node.name in outputs or not identity(node):
            continue
        replace_node(program, node, node.args[0])
        dropped += 1
    if dropped:
        program.graph_module.recompile()
    return dropped


def infer_the_dynamic_view_axis(program: torch.export.ExportedProgram) -> int:
    """Give each ``view_copy`` whose result has exactly one dynamic axis a literal shape with -1 for
    that axis, and return how many changed. XNNPACK's reshape infers one axis but takes no
    symbolic size (a decode graph's query length read with ``sym_size``), so each such view was
    left to a portable kernel between two delegated graphs."""
    changed = 0
    for node in program.graph_module.graph.nodes:
        if not edge_op(node, "aten::view_copy"):
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        dynamic = [axis for axis, size in enumerate(value.shape) if not isinstance(size, int)]
        if len(dynamic) != 1 or all(isinstance(size, int) for size in node.args[1]):
            continue
        node.args = (node.args[0], [-1 if axis in dynamic else int(size) for axis, size in enumerate(value.shape)])
        changed += 1
    if changed:
        program.graph_module.recompile()
    return changed


def _causal_start(mask: torch.fx.Node) -> torch.fx.Node | None:
    """The first new token's slot when every boolean 4-D mask ``mask`` is computed from is the
    LLM-runner interface's causal one (tagged by ``llm_runner_io``), all from that one slot; else None."""
    from hfexport.targets.executorch.llm_runner import CAUSAL_FROM

    starts, seen, todo = set(), set(), [mask]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("val")
        if CAUSAL_FROM in node.meta:
            starts.add(node.meta[CAUSAL_FROM])
            continue
        if node.op == "placeholder" or (
            isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 4
        ):
            return None  # a mask of another kind (or an input): its keys are not the causal ones
        todo.extend(node.all_input_nodes)
    return starts.pop() if len(starts) == 1 else None


def custom_sdpa_reads_causally(program: torch.export.ExportedProgram) -> int:
    """Give each ``llama::custom_sdpa`` whose mask is the LLM-runner interface's causal one (no
    sliding window, no chunk: every slot up to the query's own) the whole state cache, the first
    new token's slot as ``start_pos`` and ``is_causal`` instead of the mask and the cache's first
    keys, and return how many. The kernel then views the filled keys in place (``start_pos`` plus
    the new tokens) and masks the later ones itself, where the keys cut to the mask's extent were a
    copy of every layer's filled keys and values at every step (SmolLM2-135M at 150 tokens: 7 MB a
    step). Masks with a window or chunk, and hfexport's own interface (its masks carry padding),
    keep the copy and the mask."""
    from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

    graph = program.graph_module.graph
    sdpa = [
        n
        for n in graph.nodes
        if n.op == "call_function" and "llama::custom_sdpa" in str(getattr(n.target, "_name", ""))
    ]
    starts: dict[torch.fx.Node, torch.fx.Node] = {}
    changed = 0
    for node in sdpa:
        query, key, value, _, mask = node.args[:5]
        if mask is None or (len(node.args) > 6 and node.args[6]):
            continue
        start = _causal_start(mask)
        reads = [key, value]
        if start is None or not all(
            edge_op(r, "aten::slice_copy.Tensor") and tuple(r.args[1:3]) == (1, 0) for r in reads
        ):
            continue
        caches = [r.args[0] for r in reads]
        if start not in starts:
            fake_mode = start.meta["val"].fake_mode
            slots = caches[0].meta["val"].shape[1]
            with graph.inserting_after(start):
                scalar = graph.call_function(torch.ops.aten._local_scalar_dense.default, (start,))
            # symbols the earlier stages' fake values made and left pending are not this node's
            fake_mode.shape_env.pending_fresh_unbacked_symbols.clear()
            with fake_mode:
                scalar.meta["val"] = torch.ops.aten._local_scalar_dense.default(start.meta["val"])
            scalar.meta["unbacked_bindings"] = compute_unbacked_bindings(fake_mode.shape_env, scalar.meta["val"])
            with graph.inserting_after(scalar):
                graph.call_function(
                    torch.ops.aten.sym_constrain_range_for_size.default, (scalar,), {"min": 0, "max": slots - 1}
                )
            starts[start] = scalar
        node.args = (query, caches[0], caches[1], starts[start], None, node.args[5], True, *node.args[7:])
        changed += 1
    if changed:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return changed


# index arithmetic the layers repeat (each layer's cache-write slots: arange(S) + its counter, which
# llm_runner_io made one and the same value); pure, so two with the same arguments are one value
_REPEATABLE = (
    "aten::arange.start_step",
    "aten::add.Tensor",
    "aten::sub.Tensor",
    "aten::unsqueeze_copy.default",
    "aten::select_copy.int",
)


def merge_repeated_index_arithmetic(program: torch.export.ExportedProgram) -> int:
    """Replace each index-arithmetic node (``arange``, ``add``, ``sub``, ``unsqueeze_copy``,
    ``select_copy``) that repeats an earlier one's operation on the same arguments by that one, and
    return how many went. In the LLM runner's program every layer's token counter is
    ``input_pos[0]``, so each layer's cache-write slots (``arange(S) + counter``) are one value
    computed once per layer: two portable operators a layer, a step, between delegated graphs."""
    graph = program.graph_module.graph
    seen: dict[tuple[Any, ...], torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "_name", None) not in _REPEATABLE:
            continue
        key = (node.target, repr(node.args), repr(sorted(node.kwargs.items())))  # nodes repr as their names
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    if merged:
        program.graph_module.recompile()
    return merged


# In this order: the copies go first (a state buffer's write is then the only op reading it,
# which state_in_attention_layout needs), then the state's layout (its write then takes the
# keys untransposed, which lets cancel_head_transposes take the key's rotary chain, and the
# kernel's reads are the state's first rows, which custom_sdpa_reads_causally replaces by the
# state itself), then the transposes, whose removal leaves the contiguous clones to drop.
DEFAULT_EDGE_PASSES: tuple[str, ...] = (
    edge_pass(
        drop_same_layout_copies,
        remove_when=(
            "Without it, a program writing its inputs (a static cache) copies the whole cache twice per layer and step."
        ),
    ).name,
    edge_pass(
        drop_same_shape_expands,
        remove_when=(
            "Without it, matmul's expands copy the key cache per layer and split XNNPACK's "
            "delegated graphs at a dynamic axis."
        ),
    ).name,
    edge_pass(
        infer_the_dynamic_view_axis,
        remove_when=("Without it, views with a symbolic size run on portable kernels between two delegated graphs."),
    ).name,
    edge_pass(
        state_in_attention_layout,
        remove_when=(
            "Without it, the fused attention kernel's keys are transposed out of the state cache at every step."
        ),
    ).name,
    edge_pass(
        custom_sdpa_reads_causally,
        remove_when=(
            "For an ExecuTorch whose custom_sdpa reads only the keys its mask marks visible: without it, every layer "
            "copies its filled keys and values at every step."
        ),
    ).name,
    edge_pass(
        merge_repeated_index_arithmetic,
        remove_when=("Safe to leave out: without it, each layer computes its cache-write slots again."),
    ).name,
    edge_pass(
        drop_same_shape_views,
        remove_when=("Safe to leave out: the views it drops change no shape; without it they stay as copies."),
    ).name,
    edge_pass(
        cancel_head_transposes,
        remove_when=(
            "Safe to leave out (the same values in another memory order): without it each layer "
            "keeps about six transposes, a few percent of a decode step."
        ),
    ).name,
    edge_pass(
        drop_contiguous_clones,
        remove_when=("Safe to leave out: without it, clones of already contiguous tensors stay as copies."),
    ).name,
)
