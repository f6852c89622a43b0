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
from pathlib import Path
from typing import Any

import torch

import hfexport.targets.executorch.retraces  # noqa: F401  (registers the delegate stage's patch)
from hfexport.configs import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_SEQ_LEN
from hfexport.errors import ConfigError, UnsupportedModelError
from hfexport.pipeline.artifacts import ArtifactKind, graph_histogram, register_artifact_kind
from hfexport.pipeline.dynamic_shapes import AxisBounds
from hfexport.pipeline.patches import patches_applied, register_patch
from hfexport.pipeline.pipeline import PipelineRun
from hfexport.targets.executorch.shared_weights import WeightCheckedProgram, weights_viewed
from hfexport.targets.manifest import STATE_PREFIX, kept_inside
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


@register_patch(
    "torch.export.exported_program:ExportedProgram.run_decompositions",
    name="edge_decomposes_once",
    reason=(
        "ExecuTorch's edge conversion re-traces the whole program three times: to functionalize it, to decompose "
        "it keeping the partitioners' ops, and to decompose those of them the partitioners then refuse (a "
        "Llama-3.2-1B-shaped export: 3.5 s each in float32; an 8da4w one re-runs torchao's quantization "
        "primitives each time). to_edge decomposes once itself; a program in the ATen dialect with no op the "
        "table decomposes comes out of a re-trace as it went in, so that re-trace is skipped"
    ),
    upstream="https://github.com/pytorch/executorch/blob/v1.4.1/exir/program/_program.py#L1113",
    scope="to_edge",
)
def _decomposing_only_what_is_left(original: Any) -> Any:
    @functools.wraps(original)
    def run_decompositions(self: Any, decomp_table: Any = None, *args: Any, **kwargs: Any) -> Any:
        if decomp_table is not None and self.dialect == "ATEN" and not _decomposes_any(self, decomp_table):
            return self
        return original(self, decomp_table, *args, **kwargs)

    return run_decompositions


def _decomposes_any(program: torch.export.ExportedProgram, table: Any) -> bool:
    """Whether a node of ``program`` (its control flow's subgraphs too) calls an op ``table`` decomposes."""
    # a dynamic size's query stays one: a re-trace records it again
    ops = set(table.keys()) - {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    }
    return any(
        node.op == "call_function" and node.target in ops
        for module in program.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    )


def _first_decomposition_table(program: torch.export.ExportedProgram, partitioners: list[Any], config: Any) -> Any:
    """The table ExecuTorch's edge conversion decomposes with first: its default one without the
    ops the first partitioner keeps whole (none: without the config's preserved ops)."""
    from executorch.exir.program._program import _remove_invalid_ops_for_not_decompose
    from executorch.exir.tracer import _default_decomposition_table

    table = _default_decomposition_table()
    kept = list(config.preserve_ops)
    if partitioners:
        kept, check_op_support = partitioners[0].ops_to_not_decompose(program)
        if check_op_support is not None:
            kept = _remove_invalid_ops_for_not_decompose(kept)
    for op in kept:
        table.pop(op, None)
    return table


def to_edge(program: torch.export.ExportedProgram, partitioners: list[Any]) -> Any:
    """ATen → ExecuTorch edge dialect, keeping whole the ops the partitioners take undecomposed
    (linear, SDPA, … for XNNPACK), exactly as ``to_edge_transform_and_lower`` does before it
    delegates; the rewrites of the edge program are the ``edge_passes`` stage's passes
    (:mod:`hfexport.targets.executorch.passes.edge`), and the delegation is its own stage, so
    each can be dumped and timed."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program._program import _gen_edge_manager_for_partitioners
    from torch.nn.attention import SDPBackend, sdpa_kernel

    refuse_scans_over_a_dynamic_state(program)
    config = EdgeCompileConfig(_check_ir_validity=False)
    # Decompose SDPA with the math backend: the CPU fused kernel's decomposition lays its output
    # out differently from what capture recorded, and a view after it (GPT-2's Conv1D) then
    # fails with "Cannot view a tensor with shape ... and strides ..." (pytorch/pytorch#136543).
    with sdpa_kernel(SDPBackend.MATH), patches_applied(scope="to_edge"):
        # functionalized and decomposed in one re-trace; ExecuTorch's own decompositions then
        # re-trace only if the partitioners refuse some of the ops kept whole
        program = program.run_decompositions(_first_decomposition_table(program, partitioners, config))
        return _gen_edge_manager_for_partitioners({"forward": partitioners}, {"forward": program}, config, None, False)


def delegate(edge: Any, partitioners: list[Any], run: PipelineRun) -> Any:
    """Partition and delegate (no partitioners: nothing is delegated), and record a delegation
    summary (``delegation.md`` in the dump, counts in the report)."""
    # XnnpackPartitioner warns that to_backend outside to_edge_transform_and_lower is deprecated;
    # this is that function's own sequence, split in two stages, so the warning does not apply.
    partition_logger = logging.getLogger("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    level = partition_logger.level
    partition_logger.setLevel(logging.ERROR)
    try:
        with patches_applied(scope="delegate"), weights_viewed(edge.exported_program()):
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
            with patches_applied(scope="to_executorch"), weights_viewed(edge.exported_program()):
                program = edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=planning))
            program.__class__ = WeightCheckedProgram  # its .pte bytes view the model's weights
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


def run_edge(edge: Any, inputs: dict[str, Any]) -> Any:
    """The edge program's outputs on the sample, run by PyTorch as :func:`run_pte` returns them
    (by name, ``None`` for each one it keeps as its state, once ``program_state`` ran), so
    ``verify="passes"`` checks each of the ``edge_passes``. The state's stored initial values are
    not touched (the run writes into copies)."""
    from torch.export.graph_signature import InputKind, OutputKind

    from hfexport.pipeline.artifacts import artifact_kind
    from hfexport.pipeline.inputs import copy_inputs
    from hfexport.targets.runner import flat_inputs

    exported = edge.exported_program()
    out_spec = exported.call_spec.out_spec
    if not kept_inside(out_spec):
        return artifact_kind(exported).run(exported, inputs)
    # the keyword paths of a program keeping state are not Python names, so its graph is called
    # directly, with its weights and state (copied) in the signature's order
    values = flat_inputs(copy_inputs(inputs))
    fed = iter(values[path] for path in exported.call_spec.in_spec.children()[1].context)
    args = []
    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            args.append(next(fed))
        elif spec.target in exported.state_dict:
            value = exported.state_dict[spec.target]
            args.append(value.clone() if spec.target.startswith(STATE_PREFIX) else value)
        else:
            args.append(exported.constants[spec.target])
    with torch.no_grad():
        flat = exported.graph_module(*args)
    returned = iter(
        value
        for value, spec in zip(flat, exported.graph_signature.output_specs, strict=True)
        if spec.kind == OutputKind.USER_OUTPUT
    )
    return {
        name: None if child.type is tuple and child.num_leaves == 0 else next(returned)
        for name, child in zip(out_spec.context, out_spec.children(), strict=True)
    }


def save_edge(edge: Any, path: Path) -> None:
    """Write the edge program with ExecuTorch's edge-dialect serialiser (a failing edge pass's
    input, which ``hfexport replay`` reads back with :func:`load_edge`)."""
    from executorch.exir.serde.serialize import save

    save(edge.exported_program(), str(path))


def load_edge(path: str | Path, trust: bool = False) -> Any:
    """Read an edge program :func:`save_edge` wrote, as the ``EdgeProgramManager`` the
    ``edge_passes`` take. Nothing beyond tensors is unpickled unless ``trust``."""
    import pickle
    import zipfile

    from executorch.exir import EdgeCompileConfig, EdgeProgramManager
    from executorch.exir.serde.serialize import load

    from hfexport.errors import ArtifactError
    from hfexport.targets.untrusted import refused, weights_only_loads
    from hfexport.versions import quiet_loggers

    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        raise ArtifactError(f"{path} is not an edge program written by hfexport (a zip file); dump it again")
    try:
        # the reader warns once per unbacked size that only the source graph's sizes named
        with weights_only_loads(trust), quiet_loggers("executorch.exir.serde.export_serialize"):
            program = load(str(path))
    except pickle.UnpicklingError as error:
        raise refused(path, error) from error
    except (zipfile.BadZipFile, KeyError, ValueError, RuntimeError) as error:
        raise ArtifactError(f"{path} is not a readable edge program ({type(error).__name__}: {error})") from error
    return EdgeProgramManager({"forward": program}, compile_config=EdgeCompileConfig(_check_ir_validity=False))


def write_pte(program: Any, path: Path) -> None:
    """Write ``program``'s ``.pte`` to ``path``, past the page cache where the file system allows
    (:mod:`~hfexport.direct_writes`). Not ``ExecutorchProgramManager.save``: it logs an error in
    writing (a full disk) and returns, leaving a truncated file."""
    from hfexport.direct_writes import STAGE_BYTES, aligned_empty, direct_stream

    with open(path, "wb") as file:
        stream = direct_stream(file, aligned_empty(STAGE_BYTES))
        if stream is None:
            program.write_to_file(file)
            return
        with stream:
            program.write_to_file(stream)


def _snapshot(edge: Any) -> Any:
    import copy

    return copy.deepcopy(edge)


def _register() -> None:
    from executorch.exir import EdgeProgramManager, ExecutorchProgramManager

    register_artifact_kind(
        EdgeProgramManager,
        ArtifactKind(
            suffix=".edge.pt2",
            text=_edge_text,
            histogram=_edge_histogram,
            save=save_edge,
            run=run_edge,
            snapshot=_snapshot,
            save_at_stages=False,
        ),
    )
    register_artifact_kind(
        ExecutorchProgramManager,
        ArtifactKind(
            suffix=".pte",
            text=lambda p: str(p.exported_program()),
            histogram=lambda p: graph_histogram(p.exported_program().graph),
            save=write_pte,
            run=run_pte,
            snapshot=_snapshot,
        ),
    )


require_backend("executorch", ("executorch",))
_register()
