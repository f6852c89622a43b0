"""ExecuTorch lowering: the captured ``ExportedProgram`` → edge dialect → delegation (XNNPACK) →
``ExecutorchProgramManager``, each a named, dumped, timed stage.

ExecuTorch plans memory for the largest allowed shapes, so capture bounds every dynamic axis
(:class:`BoundedCaptureStage`), and :class:`~hfexport.runtime.ExecutorchRunner` checks inputs
against those bounds before running.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch.export.graph_signature import OutputKind

from hfexport.errors import ConfigError
from hfexport.pipeline.artifacts import ArtifactKind, graph_histogram, register_artifact_kind
from hfexport.pipeline.capture import AxisBound, sample_shapes
from hfexport.pipeline.io_names import program_io_names, user_input_names
from hfexport.pipeline.pipeline import CaptureStage, PipelineRun
from hfexport.versions import require_backend

logger = logging.getLogger("hfexport")


def memory_planning_bounds(model: torch.nn.Module, config: Any) -> tuple[int, int, str]:
    """(batch bound, sequence bound, where the sequence bound comes from), by the policy of
    :class:`~hfexport.ExecutorchConfig`: ``max_seq_len``, else ``max_position_embeddings``."""
    if config.max_seq_len is not None:
        return config.max_batch_size, config.max_seq_len, "ExecutorchConfig.max_seq_len"
    model_config = getattr(model, "config", None)
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    seq = getattr(text_config, "max_position_embeddings", None)
    if seq is None:
        raise ConfigError(
            f"{type(model).__name__}'s config has no max_position_embeddings to bound the dynamic axes for "
            "ExecuTorch memory planning; set ExecutorchConfig(max_seq_len=...) or give Dim(max=...) bounds"
        )
    return config.max_batch_size, int(seq), "model config max_position_embeddings"


class BoundedCaptureStage(CaptureStage):
    """Capture with every unbounded dynamic axis bounded: axis 0 by ``max_batch_size``, other
    axes by ``max_seq_len`` / ``max_position_embeddings``. The bounds are logged and recorded."""

    def axis_bound(self, run: PipelineRun) -> AxisBound:
        batch, seq, source = memory_planning_bounds(run.model, run.config)
        logger.info(
            "ExecuTorch memory planning bounds: unbounded batch axes <= %d (max_batch_size), other "
            "unbounded dynamic axes <= %d (%s)",
            batch,
            seq,
            source,
        )
        run.current.counts.update({"max_batch_size": batch, "max_seq_len": seq})
        return lambda axis: batch if axis == 0 else seq


def partitioners(backend: str) -> list[Any]:
    """The partitioners of an ExecuTorch backend (``portable``: none)."""
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    if backend == "portable":
        return []
    raise ConfigError(f"ExecuTorch backend {backend!r} is not supported by this lowering; use 'xnnpack' or 'portable'")


def to_edge(program: torch.export.ExportedProgram, partitioners: list[Any]) -> Any:
    """ATen → ExecuTorch edge dialect, keeping whole the ops the partitioners take undecomposed
    (linear, SDPA, … for XNNPACK), exactly as ``to_edge_transform_and_lower`` does before it
    delegates; the delegation is the next stage so each can be dumped and timed."""
    from executorch.exir import EdgeCompileConfig
    from executorch.exir.program._program import _gen_edge_manager_for_partitioners
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = EdgeCompileConfig(_check_ir_validity=False)
    # Decompose SDPA with the math backend: the CPU fused kernel's decomposition lays its output
    # out differently from what capture recorded, and a view after it (GPT-2's Conv1D) then
    # fails with "Cannot view a tensor with shape ... and strides ..." (pytorch/pytorch#136543).
    with sdpa_kernel(SDPBackend.MATH):
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
        "by_op": {b.op_type: (b.delegated, b.non_delegated) for b in rows},
        "markdown": "\n".join(lines) + "\n",
    }


def to_executorch(
    edge: Any, config: Any, input_axes: list[Any] = (), attention_windows: dict[str, int] | None = None
) -> Any:
    """Edge → ExecuTorch program, with the config's memory-planning flags. The capture's sample
    input shapes and the windows of windowed static-cache layers ride along on the manager
    (``hfexport_sample_shapes``, ``hfexport_attention_windows``) for :func:`save_pte`."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    planning = MemoryPlanningPass(
        alloc_graph_input=config.alloc_graph_input,
        alloc_graph_output=config.alloc_graph_output,
        alloc_mutable_buffers=config.alloc_mutable_buffers,
    )
    program = edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=planning))
    program.hfexport_sample_shapes = sample_shapes(list(input_axes))
    program.hfexport_attention_windows = attention_windows or {}
    return program


# --- artifact kinds --------------------------------------------------------------------------------


def _edge_text(edge: Any) -> str:
    return str(edge.exported_program())


def _edge_histogram(edge: Any) -> collections.Counter:
    return graph_histogram(edge.exported_program().graph)


def pte_io_names(program: Any) -> tuple[list[str], list[str]]:
    """Input and output names of an ExecuTorch program, in its flat order. Outputs that write
    back an input the program mutates (a static cache) are ``output.<input name>``."""
    exported = program.exported_program()
    inputs, user_outputs = program_io_names(exported)
    name_of = user_input_names(exported)
    outputs, user_names = [], iter(user_outputs)
    for spec in exported.graph_signature.output_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            outputs.append(f"output.{name_of.get(spec.target, spec.target)}")
        elif spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(next(user_names))
    return inputs, outputs


def save_pte(program: Any, path: Path) -> None:
    """Write the ``.pte`` and, next to it, ``<name>.pte.json`` with the input and output names
    that :class:`~hfexport.runtime.ExecutorchRunner` uses for readable errors and cache write-back."""
    program.save(str(path))
    inputs, outputs = pte_io_names(program)
    sidecar = {
        "inputs": inputs,
        "outputs": outputs,
        "sample_shapes": getattr(program, "hfexport_sample_shapes", {}),
        "attention_windows": getattr(program, "hfexport_attention_windows", {}),
    }
    Path(f"{path}.json").write_text(json.dumps(sidecar, indent=2) + "\n")


def run_pte(program: Any, inputs: dict[str, Any]) -> list[Any]:
    """The program's user outputs (not its cache write-backs) on the ExecuTorch runtime."""
    from hfexport.runtime import ExecutorchRunner

    _, names = pte_io_names(program)
    outputs = ExecutorchRunner(program.buffer).run(inputs)
    return [o for name, o in zip(names, outputs, strict=True) if not name.startswith("output.")]


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
            save=save_pte,
            run=run_pte,
            snapshot=_snapshot,
        ),
    )


require_backend("executorch", ("executorch",))
_register()
