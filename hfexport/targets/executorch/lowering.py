"""ExecuTorch lowering: the captured ``ExportedProgram`` → edge dialect → delegation (XNNPACK) →
``ExecutorchProgramManager``, each a named, dumped, timed stage.

ExecuTorch plans memory for the largest allowed shapes, so capture bounds every dynamic axis
(:func:`memory_planning_bounds`), and :class:`~hfexport.targets.executorch.runner.ExecutorchRunner`
checks inputs against those bounds before running.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from hfexport.configs import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN
from hfexport.errors import ConfigError, UnsupportedModelError
from hfexport.pipeline.artifacts import ArtifactKind, graph_histogram, register_artifact_kind
from hfexport.pipeline.dynamic_shapes import AxisBounds
from hfexport.pipeline.patches import patches_applied, register_patch
from hfexport.pipeline.pipeline import PipelineRun
from hfexport.targets.manifest import INPUT_SHAPE, STATE_PREFIX
from hfexport.versions import require_backend

logger = logging.getLogger("hfexport")


# config fields that cap a model's sequence length, in the model config or its text config
LENGTH_LIMITS = ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")


def memory_planning_bounds(model: torch.nn.Module, config: Any) -> AxisBounds:
    """The bounds ExecuTorch memory planning needs, by the policy of
    :class:`~hfexport.ExecutorchConfig`: ``max_batch_size`` (default 8) for axis 0; for the others
    ``max_seq_len``, else 2048 capped by the model config's own length limit."""
    batch = config.max_batch_size or DEFAULT_MAX_BATCH_SIZE
    if config.max_seq_len is not None:
        return AxisBounds(batch, config.max_seq_len, "ExecuTorch memory planning: max_seq_len")
    model_config = getattr(model, "config", None)
    configs = [model_config]
    if hasattr(model_config, "get_text_config"):
        configs.append(model_config.get_text_config())
    limits = {
        field: int(value)
        for cfg in configs
        for field in LENGTH_LIMITS
        if isinstance(value := getattr(cfg, field, None), int) and value > 0
    }
    if limits:
        field, limit = min(limits.items(), key=lambda item: item[1])
        if limit < DEFAULT_MAX_SEQ_LEN:
            return AxisBounds(batch, limit, f"ExecuTorch memory planning: model config {field}")
    return AxisBounds(
        batch,
        DEFAULT_MAX_SEQ_LEN,
        f"ExecuTorch memory planning: default max_seq_len {DEFAULT_MAX_SEQ_LEN}",
        widenable=True,
    )


def planned_memory_mb(program: Any) -> float:
    """The memory the program's plan allocates, in MiB (every planned buffer of every method)."""
    return sum(sum(plan.non_const_buffer_sizes) for plan in program.executorch_program.execution_plan) / 2**20


def default_memory_budget_mb() -> int:
    """Half of this machine's physical memory, in MiB."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 / 2)


def partitioners(backend: str) -> list[Any]:
    """The partitioners of an ExecuTorch backend (``portable``: none)."""
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
        from executorch.backends.xnnpack.partition.config.generic_node_configs import UnsqueezeCopyConfig
        from executorch.backends.xnnpack.partition.config.node_configs import BatchNormConfig, MaxDimConfig
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        stricter = {
            UnsqueezeCopyConfig: _refusing(UnsqueezeCopyConfig, _two_dynamic_axes),
            MaxDimConfig: _refusing(MaxDimConfig, _max_over_an_outer_axis),
            BatchNormConfig: _refusing(BatchNormConfig, _a_3d_batch_norm_over_two_dynamic_axes),
        }
        return [XnnpackPartitioner(configs=[stricter.get(c, c) for c in ALL_PARTITIONER_CONFIGS])]
    if backend == "portable":
        return []
    raise ConfigError(f"ExecuTorch backend {backend!r} is not supported by this lowering; use 'xnnpack' or 'portable'")


def _refusing(base: type, refused: Callable[[torch.fx.Node], bool]) -> type:
    """XNNPACK's partitioner config ``base``, also refusing the nodes ``refused`` names (they run
    as portable kernels instead): nodes XNNPACK's partitioner claims and its node visitor then
    cannot lower, which failed the whole ``delegate`` stage."""

    class Stricter(base):  # type: ignore[misc, valid-type]
        def check_constraints(self, node: torch.fx.Node, ep: Any) -> bool:
            return not refused(node) and super().check_constraints(node, ep)

    Stricter.__name__ = Stricter.__qualname__ = f"{base.__name__}Checked"
    return Stricter


def _two_dynamic_axes(node: torch.fx.Node) -> bool:
    """An output with two or more dynamic axes: XNNPACK lowers unsqueeze as a static reshape,
    which takes one ("XNNPACK reshape only supports 1 dynamic dimension"; pytorch/executorch#11449,
    the config came with pytorch/executorch#19261)."""
    value = node.meta.get("val")
    return value is not None and _dynamic_axes(value) > 1


def _dynamic_axes(value: torch.Tensor) -> int:
    from torch.fx.experimental.symbolic_shapes import free_symbols

    return sum(bool(free_symbols(size)) for size in value.shape)


def _a_3d_batch_norm_over_two_dynamic_axes(node: torch.fx.Node) -> bool:
    """A batch norm over a 3-D input with two or more dynamic axes (batch and length): XNNPACK
    decomposes it into a 1-D convolution after partitioning (``_passes/decompose_batch_norm.py``),
    which its ``Conv1dUnsqueezePass`` runs as a 2-D one between reshapes that take one dynamic axis
    (the same "XNNPACK reshape only supports 1 dynamic dimension" as :func:`_two_dynamic_axes`;
    the conformer encoders of Cohere ASR and Canary)."""
    source = node.all_input_nodes[0].meta.get("val") if node.all_input_nodes else None
    return source is not None and source.dim() == 3 and _dynamic_axes(source) > 1


def _max_over_an_outer_axis(node: torch.fx.Node) -> bool:
    """A ``max.dim`` over an axis other than 2 or 3 as written: the config checks the rank (4) but
    not the axis, and XNNPACK's visitor (``operators/op_max_dim.py``) refuses it ("amax.default only
    supports dim == 2 or dim == 3"; a negative axis is refused there too). MoE routers (HY-V4,
    MiMo-V2-Flash) take the max over their group axis."""
    return len(node.args) < 2 or node.args[1] not in (2, 3)


def refuse_scans_over_a_dynamic_state(program: torch.export.ExportedProgram) -> None:
    """Raise :class:`UnsupportedModelError` when a ``scan`` (Mamba's selective scan, see
    ``selective_scan_as_scan_op``) carries a state with a dynamic axis: ExecuTorch 1.4's emitter
    copies the initial state into a buffer planned for the largest size with ``aten::copy_``, which
    does not resize, so the program would fail at run time on any smaller batch."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.higher_order.scan:
            continue
        for state in node.args[1]:
            value = state.meta.get("val") if isinstance(state, torch.fx.Node) else None
            if value is not None and any(free_symbols(size) for size in value.shape):
                raise UnsupportedModelError(
                    f"the model's recurrence (a scan) carries a state of dynamic shape {list(value.shape)}, which "
                    "ExecuTorch's runtime cannot run (it copies the state into a buffer of the largest size); "
                    "export it for one sequence (ExecutorchConfig(max_batch_size=1)), or for generation "
                    "(--generation), whose programs take one"
                )


@register_patch(
    "torch._decomp.decompositions:should_fold",
    name="matmul_fold_without_guards",
    reason=(
        "to_edge's decomposition of a 3-D by 2-D matmul asks whether the left operand folds into a matrix "
        "by comparing its strides with guard_or_false, which on a backed symbol guards on the sample's "
        "size: a decode step's query length (MiniCPM3, HY-V4, Phi) became the sample's 2 and the program "
        "refused one token. With a symbolic size or stride the matmul takes the batched path instead, "
        "which holds for every size (the choice is one of speed, not of result)"
    ),
    upstream="https://github.com/pytorch/pytorch/pull/159184",
    scope="to_edge",
)
def _fold_without_guards(original: Any) -> Any:
    from torch.fx.experimental.symbolic_shapes import free_symbols

    @functools.wraps(original)
    def should_fold(tensor1: torch.Tensor, tensor2: torch.Tensor, is_out: bool) -> bool:
        left = tensor1 if tensor1.ndim >= tensor2.ndim else tensor2
        if any(free_symbols(size) for size in (*left.shape, *left.stride())):
            return False
        return original(tensor1, tensor2, is_out)

    return should_fold


@register_patch(
    "executorch.exir.program._program:lift_constant_tensor_pass",
    name="lifted_constants_in_placeholder_order",
    reason=(
        "to_edge lifts the constants its scalar-to-tensor pass made as placeholders before the first user input "
        "placeholder that is a tensor, and their specs before the first user input spec of any kind: when a user "
        "input is None (a multimodal language model's mask dict, {'full_attention': None}) the two orders part, "
        "and the verifier refused the program ('Input spec name _lifted_tensor_constant2 does not match node "
        "name attention_mask_full_attention'). The input specs are put back in the placeholders' order"
    ),
    upstream="https://github.com/pytorch/pytorch/pull/157719",  # torch's own lift_constants_pass, fixed alike
    scope="to_edge",
)
def _lifted_constants_in_placeholder_order(original: Any) -> Any:
    @functools.wraps(original)
    def lift_constant_tensor_pass(program: Any) -> Any:
        program = original(program)
        signature = program.graph_signature
        by_name = {getattr(spec.arg, "name", None): spec for spec in signature.input_specs}
        placeholders = [node.name for node in program.graph.nodes if node.op == "placeholder"]
        if len(by_name) == len(signature.input_specs) and set(placeholders) == set(by_name):
            signature.input_specs = [by_name[name] for name in placeholders]
        return program

    return lift_constant_tensor_pass


def to_edge(
    program: torch.export.ExportedProgram, partitioners: list[Any], state_from: dict[str, Any] | None = None
) -> Any:
    """ATen → ExecuTorch edge dialect, keeping whole the ops the partitioners take undecomposed
    (linear, SDPA, … for XNNPACK), exactly as ``to_edge_transform_and_lower`` does before it
    delegates; the delegation is the next stage so each can be dumped and timed. With
    ``state_from`` (the sample's keyword inputs), a static cache's keys and values become the
    program's state (:func:`cache_as_program_state`)."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program._program import _gen_edge_manager_for_partitioners
    from torch.nn.attention import SDPBackend, sdpa_kernel

    refuse_scans_over_a_dynamic_state(program)
    config = EdgeCompileConfig(_check_ir_validity=False)
    # Decompose SDPA with the math backend: the CPU fused kernel's decomposition lays its output
    # out differently from what capture recorded, and a view after it (GPT-2's Conv1D) then
    # fails with "Cannot view a tensor with shape ... and strides ..." (pytorch/pytorch#136543).
    fixes = ["matmul_fold_without_guards", "lifted_constants_in_placeholder_order"]
    with sdpa_kernel(SDPBackend.MATH), patches_applied(fixes, scope=None):
        edge = _gen_edge_manager_for_partitioners({"forward": partitioners}, {"forward": program}, config, None, False)
    program = edge.exported_program()
    drop_same_layout_copies(program)
    drop_same_shape_expands(program)
    infer_the_dynamic_view_axis(program)
    if state_from is not None and cache_as_program_state(program, state_from):
        state_in_attention_layout(program)
    drop_same_shape_views(program)
    cancel_head_transposes(program)
    drop_contiguous_clones(program)
    return edge


def cache_as_program_state(program: torch.export.ExportedProgram, sample: dict[str, Any]) -> list[str]:
    """Keep a static cache's keys and values inside the program as mutable buffers (its state)
    instead of inputs it writes back, and return their input paths.

    The Python runtime copies every input into the program's planned memory and clones every
    output, so a cache passed in and returned costs three copies of every layer's keys and values
    per decode step; as state it stays where the program writes it. An input qualifies when the
    program writes it, it is a floating-point tensor with a static batch axis (its other axes take
    the sample's sizes: a static cache's are fixed), and only the ops writing it read it (a
    delegate takes a buffer it reads as a constant). Token counters stay inputs, so a decode loop
    still starts a sequence by zeroing them.

    A buffer's initial value is the sample's (stored in the .pte and copied in when the program
    loads), so verification on the sample is exact; any finite values serve, since a decode step
    reads only the slots its attention mask marks written."""
    from torch.export import graph_signature as gs

    from hfexport.pipeline.io_names import program_io_names
    from hfexport.targets.runner import flat_inputs

    signature = program.graph_signature
    written = {s.target for s in signature.output_specs if s.kind == gs.OutputKind.USER_INPUT_MUTATION}
    user = [s for s in signature.input_specs if s.kind == gs.InputKind.USER_INPUT]
    paths = dict(zip((id(s) for s in user), program_io_names(program)[0], strict=True))
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    values = flat_inputs(sample)
    state: dict[str, str] = {}  # placeholder name -> input path
    for spec in user:
        name = getattr(spec.arg, "name", None)
        node = nodes.get(name)
        value = node.meta.get("val") if node is not None else None
        if name not in written or not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
            continue
        if value.dim() < 2 or not isinstance(value.shape[0], int):
            continue  # a dynamic batch: one buffer cannot hold every batch size
        if not all(_edge_op(reader, "aten::index_put") or _edge_op(reader, "aten::copy") for reader in node.users):
            continue
        if not isinstance(values.get(paths[id(spec)]), torch.Tensor):
            continue
        state[name] = paths[id(spec)]
    if not state:
        return []
    inputs = []
    for spec in signature.input_specs:
        if spec.kind == gs.InputKind.USER_INPUT and getattr(spec.arg, "name", None) in state:
            target = STATE_PREFIX + state[spec.arg.name]
            initial = values[state[spec.arg.name]].detach().clone().contiguous()
            program.state_dict[target] = initial
            node = nodes[spec.arg.name]
            # a buffer has the sample's sizes, not the symbolic ones of a dynamic input (the
            # cache length is one): memory planning would size it by their upper bounds
            node.meta["val"] = node.meta["val"].fake_mode.from_tensor(initial, static_shapes=True)
            node.meta["et_init_buffer"] = True  # serialise the initial value
            spec = gs.InputSpec(gs.InputKind.BUFFER, gs.TensorArgument(spec.arg.name), target, persistent=True)
        inputs.append(spec)
    outputs = [
        gs.OutputSpec(gs.OutputKind.BUFFER_MUTATION, spec.arg, STATE_PREFIX + state[spec.target])
        if spec.kind == gs.OutputKind.USER_INPUT_MUTATION and spec.target in state
        else spec
        for spec in signature.output_specs
    ]
    written_in_place = _write_state_in_place(program, inputs, outputs)
    output = program.graph.output_node()
    results = list(output.args[0])
    # the model also returns the cache: the state's new values need not leave the program (the
    # runtime would hand each one over every step); the flat output spec keeps their names, as ()
    state_values = {results[i] for i in written_in_place}
    names = iter(program_io_names(program)[1])
    kept_names: dict[str, Any] = {}
    kept = []
    for index, spec in enumerate(outputs):
        if spec.kind != gs.OutputKind.USER_OUTPUT:
            kept.append(index)
            continue
        name = next(names)
        returned = results[index] not in state_values
        kept_names[name] = 0 if returned else ()
        if returned:
            kept.append(index)
    # ExecuTorch's write-back pass puts the mutations it copies before the ones written in place,
    # and its emitter then drops buffer mutations by position: order the outputs that way first
    order = sorted(kept, key=lambda i: (outputs[i].kind == gs.OutputKind.USER_OUTPUT, i in written_in_place))
    output.args = (type(output.args[0])(results[i] for i in order),)
    program._graph_signature = gs.ExportGraphSignature(inputs, [outputs[i] for i in order])
    program.graph_module.recompile()
    # the user inputs left, by their paths: a flat keyword spec replaces the cache's pytree
    left = [paths[id(spec)] for spec in user if getattr(spec.arg, "name", None) not in state]
    call = program.module_call_graph[0].signature
    call.in_spec = torch.utils._pytree.tree_flatten(((), dict.fromkeys(left, 0)))[1]
    call.out_spec = torch.utils._pytree.tree_flatten(kept_names)[1]
    call.inputs = [i for i in call.inputs if getattr(i, "name", None) not in state]
    dropped = {node.name for node in state_values}
    call.outputs = [o for o in call.outputs if getattr(o, "name", None) not in dropped]
    call.forward_arg_names = None
    return sorted(state.values())


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
        return _edge_op(node, "aten::permute_copy") and list(node.args[1]) == swap

    def first_keys(read: torch.fx.Node) -> bool:  # slice_copy(cache, 2, 0, n), read only transposed
        return (
            _edge_op(read, "aten::slice_copy.Tensor")
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
        if not _edge_op(write, "aten::index_put_") or write.args[0] is not buffer or buffer.meta["val"].dim() != 4:
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
            and _edge_op(node, "aten::permute_copy")
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
                elif _edge_op(user, "aten::linear") and user.args[0] is node and user.args[1] is not node:
                    inside.append(user)
                    queue.append(user)
                elif any(_edge_op(user, name) for name in _ELEMENTWISE) and not user.kwargs and len(user.args) == 2:
                    inside.append(user)
                    queue.append(user)
                else:
                    return None
        members = set(inside) | {head}
        for node in inside:  # an operand from outside must not depend on the head axis' order
            if _edge_op(node, "aten::linear"):
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
            unsqueezed = _edge_op(operand, "aten::unsqueeze_copy") and operand.args[1] in (1, -3)
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
                and not (_edge_op(node, "aten::linear") and index > 0)
                else arg
                for index, arg in enumerate(node.args)
            )
            with node.meta["val"].fake_mode:
                node.meta["val"] = node.meta["val"].permute(_HEAD_SWAP).contiguous()
        for exit_ in exits:
            _replace_node(program, exit_, head.args[0] if exit_.args[0] is head else exit_.args[0])
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


def _write_state_in_place(program: torch.export.ExportedProgram, inputs: list[Any], outputs: list[Any]) -> set[int]:
    """Make each state buffer's write (``index_put``, functional after decomposition) an
    ``index_put_`` on the buffer itself, so the new rows land in the state with no copy of it; the
    indices of the buffer-mutation outputs now written in place."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from torch.export import graph_signature as gs

    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    values = program.graph.output_node().args[0]
    in_place = set()
    for index, spec in enumerate(outputs):
        if spec.kind != gs.OutputKind.BUFFER_MUTATION:
            continue
        write = values[index]
        buffer = next(s.arg.name for s in inputs if s.target == spec.target)
        if not _edge_op(write, "aten::index_put") or write.args[0] is not placeholders.get(buffer):
            continue
        if any(user is not write and not _edge_op(user, "aten::copy") for user in write.args[0].users):
            continue
        write.target = exir_ops.edge.aten.index_put_.default
        in_place.add(index)
    return in_place


def drop_same_layout_copies(program: torch.export.ExportedProgram) -> int:
    """Replace each functional ``copy(like, src)`` whose ``like`` has ``src``'s shape, strides and
    dtype by ``src`` itself (the values are ``src``'s), and return how many went.

    Decomposing a program that writes its inputs in place (a static cache) for the partitioners
    functionalises it twice, and each round leaves a ``copy(cache, new value)`` per written input:
    two whole-cache copies per layer and step. Only a ``src`` computed in the graph qualifies: a
    program input may be written back before a user of the copy runs (pytorch/pytorch#198131)."""
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
        _replace_node(program, node, src)
        dropped += 1
    if dropped:
        program.graph_module.recompile()
    return dropped


def _replace_node(program: torch.export.ExportedProgram, node: torch.fx.Node, value: torch.fx.Node) -> None:
    """Give ``node``'s users ``value`` instead and erase ``node``; a program output (a user output,
    an input's write-back) that named ``node`` names ``value``."""
    node.replace_all_uses_with(value)
    for spec in program.graph_signature.output_specs:
        if getattr(spec.arg, "name", None) == node.name:
            spec.arg = type(spec.arg)(name=value.name)
    node.graph.erase_node(node)


def _edge_op(node: torch.fx.Node, name: str) -> bool:
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
        if not _edge_op(node, name) or node.name in outputs or not identity(node):
            continue
        _replace_node(program, node, node.args[0])
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
        if not _edge_op(node, "aten::view_copy"):
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


def delegate(edge: Any, partitioners: list[Any], run: PipelineRun) -> Any:
    """Partition and delegate (no partitioners: nothing is delegated), and record a delegation
    summary (``delegation.md`` in the dump, counts in the report)."""
    # XnnpackPartitioner warns that to_backend outside to_edge_transform_and_lower is deprecated;
    # this is that function's own sequence, split in two stages, so the warning does not apply.
    partition_logger = logging.getLogger("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    level = partition_logger.level
    partition_logger.setLevel(logging.ERROR)
    try:
        for partitioner in partitioners:
            edge = edge.to_backend({"forward": partitioner})
    finally:
        partition_logger.setLevel(level)
    summary = delegation_summary(edge.exported_program().graph_module)
    run.current.counts.update(
        {"delegated_nodes": summary["delegated_nodes"], "portable_nodes": summary["portable_nodes"]}
    )
    run.current.files["delegation.md"] = summary["markdown"]
    return edge


def delegation_summary(graph_module: torch.fx.GraphModule) -> dict[str, Any]:
    """How many nodes went to the delegate, and which ops stayed on portable kernels."""
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(graph_module)
    rows = sorted(info.delegation_by_operator.values(), key=lambda b: (-b.delegated, -b.non_delegated, b.op_type))
    lines = [
        f"delegated subgraphs: {info.num_delegated_subgraphs}",
        f"delegated nodes: {info.num_delegated_nodes}",
        f"nodes left on portable kernels: {info.num_non_delegated_nodes}",
        "",
        "| op | delegated | portable |",
        "|---|---:|---:|",
        *(f"| {b.op_type} | {b.delegated} | {b.non_delegated} |" for b in rows),
    ]
    return {
        "delegated_nodes": info.num_delegated_nodes,
        "portable_nodes": info.num_non_delegated_nodes,
        "markdown": "\n".join(lines) + "\n",
    }


def to_executorch(edge: Any, config: Any, run: PipelineRun) -> Any:
    """Edge → ExecuTorch program, with the config's memory-planning flags. Records the planned
    memory (``planned_memory_mb``) and raises :class:`ConfigError` when it exceeds the budget
    (``max_planned_memory_mb``), naming the bounds that set it."""
    from executorch.exir import ExecutorchBackendConfig
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from hfexport.targets.executorch.memory_planning import planning_pass

    planning = planning_pass(config.alloc_graph_input, config.alloc_graph_output, config.alloc_mutable_buffers)
    with warnings.catch_warnings():
        # "buffers that are mutated ... have a meaningless initial state": ours carry one (et_init_buffer)
        warnings.filterwarnings("ignore", message="Mutation on a buffer in the model is detected")
        try:
            program = edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=planning))
        except (GuardOnDataDependentSymNode, RuntimeError) as error:
            unbounded = isinstance(error, GuardOnDataDependentSymNode) or "finite upper bound" in str(error)
            if not unbounded:
                raise
            raise UnsupportedModelError(
                "the program has sizes computed from its input values, with no upper bound (the tokens a "
                "repeat_interleave makes, such as the image patches an image_grid_thw counts), and ExecuTorch plans "
                f"memory for the largest size of each ({str(error).splitlines()[0]}); export it to Dynamo or ONNX "
                "(pytorch/pytorch#158786)"
            ) from error
    planned = planned_memory_mb(program)
    run.current.counts["planned_memory_mb"] = round(planned)
    budget = config.max_planned_memory_mb or default_memory_budget_mb()
    bounds = run.captured.bounds if run.captured is not None else None
    logger.info("ExecuTorch planned memory: %.0f MiB (budget %d MiB)", planned, budget)
    if planned > budget:
        where = (
            f"the dynamic axes are bounded by batch <= {bounds.batch} and other axes <= {bounds.other} "
            f"({bounds.source}); lower ExecutorchConfig(max_batch_size=...) or (max_seq_len=...)"
            if bounds is not None
            else "lower the Dim(max=...) bounds of the dynamic axes"
        )
        raise ConfigError(
            f"the ExecuTorch program plans {planned:.0f} MiB of memory, over the budget of {budget} MiB: {where}, "
            "or raise ExecutorchConfig(max_planned_memory_mb=...)"
        )
    return program


# --- artifact kinds --------------------------------------------------------------------------------


def _edge_text(edge: Any) -> str:
    return str(edge.exported_program())


def _edge_histogram(edge: Any) -> collections.Counter:
    return graph_histogram(edge.exported_program().graph)


def run_pte(program: Any, inputs: dict[str, Any]) -> list[Any]:
    """The program's user outputs (not its cache write-backs) on the ExecuTorch runtime."""
    from hfexport.targets.executorch.runner import ExecutorchRunner

    runner = ExecutorchRunner(program)
    # the program's state starts as the sample's values (cache_as_program_state): the sample's
    # own are left out rather than refused
    returned = iter(runner.run(inputs, state_given=True))
    user = {}
    for spec in runner.spec.outputs:
        value = None if spec.kind == "state" else next(returned)
        if spec.kind != "write_back":
            user[spec.path] = value
    # a program keeping state returns its outputs by name (the ones it keeps inside as None)
    return user if None in user.values() else list(user.values())


def _snapshot(edge: Any) -> Any:
    import copy

    return copy.deepcopy(edge)


def _register() -> None:
    from executorch.exir import EdgeProgramManager, ExecutorchProgramManager

    register_artifact_kind(
        EdgeProgramManager,
        ArtifactKind(
            suffix=".pt2", text=_edge_text, histogram=_edge_histogram, save=None, run=None, snapshot=_snapshot
        ),
    )
    register_artifact_kind(
        ExecutorchProgramManager,
        ArtifactKind(
            suffix=".pte",
            text=lambda p: str(p.exported_program()),
            histogram=lambda p: graph_histogram(p.exported_program().graph),
            save=lambda program, path: program.save(str(path)),
            run=run_pte,
            snapshot=_snapshot,
        ),
    )


require_backend("executorch", ("executorch",))
_register()
