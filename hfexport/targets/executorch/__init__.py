"""The ExecuTorch target: ``to_edge`` → ``delegate`` (XNNPACK by default) → ``to_executorch``; ``.pte``
artifacts run by the ExecuTorch runtime (:class:`ExecutorchRunner`, :class:`ExecutorchDecoder`).
Memory planning needs bounded dynamic axes, so a capture for this target is bounded
(:meth:`ExecutorchTarget.bounds`). The executorch package is imported only when a stage or a
runner runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hfexport.pipeline.capture import Captured
from hfexport.pipeline.dynamic_shapes import AxisBounds
from hfexport.targets import Target
from hfexport.targets.executorch import passes
from hfexport.targets.executorch.manifest_entry import pte_component
from hfexport.targets.executorch.runner import ExecutorchDecoder, ExecutorchRunner
from hfexport.targets.manifest import ComponentSpec, Manifest


class ExecutorchTarget(Target):
    """``ExportedProgram`` → edge dialect → delegated → ``ExecutorchProgramManager`` → ``.pte``."""

    name = "executorch"
    suffix = ".pte"
    config_class = "hfexport.configs:ExecutorchConfig"
    program_suffix = ".edge.pt2"  # an edge program (a failing edge pass's dumped input)
    default_passes = passes.DEFAULT_PASSES
    runtime = "the ExecuTorch runtime"

    def why_auto_converts(self, config: Any, dtype: str) -> str | None:
        # XNNPACK's partitioner takes float32 and float16 nodes only
        # (executorch/backends/xnnpack/partition/config/xnnpack_config.py): a bfloat16 program
        # runs every op on the portable kernels, and its 8da4w linears could not be lowered at all
        if dtype == "bfloat16" and config.backend == "xnnpack":
            return "XNNPACK runs no bfloat16"
        return super().why_auto_converts(config, dtype)

    def keeps_stored(self, config: Any, module: torch.nn.Module) -> bool:
        # a linear layer's: the stored_weights_as_float32 pass converts its weight for the program
        # one at a time (stored_weights.py). Not under quantization, whose pass reads the float32
        # weights the capture holds, nor for other modules (FX passes rewrite convolutions' weights)
        return not config.quantize and isinstance(module, torch.nn.Linear)

    def pass_list(self, config: Any) -> list[Any]:
        return passes.pass_list(config)

    def generation_config(self, config: Any, *, longest: int | None, carries_state: bool) -> Any:
        """Memory is planned for the largest shapes: a component's token axes are bounded by the
        static cache's length (unless ``max_seq_len`` is given), and one that carries a state
        takes one sequence (unless ``max_batch_size`` is given)."""
        if longest and config.max_seq_len is None:
            config.max_seq_len = longest
        if carries_state and self.batch_of_one(config):
            config.max_batch_size = 1
        return config

    def runtime_loop(self, config: Any) -> str | None:
        return "ExecuTorch's LLM runner" if config.llm_runner else None

    def batch_of_one(self, config: Any) -> bool:
        return config.max_batch_size is None

    def stages(self, config: Any) -> list[Any]:
        from hfexport.pipeline.pipeline import TransformStage
        from hfexport.targets.executorch import lowering
        from hfexport.targets.executorch.passes.edge import EDGE_PASSES
        from hfexport.targets.executorch.program_state import program_state

        partitioners = lowering.partitioners(config.backend)
        stages: list[Any] = [TransformStage("to_edge", lambda program, run: lowering.to_edge(program, partitioners))]
        if config.cache_in_program and config.alloc_graph_input:
            stages.append(TransformStage("program_state", program_state))
        if config.llm_runner:
            from hfexport.targets.executorch.llm_runner import llm_runner_io

            stages.append(TransformStage("llm_runner_io", llm_runner_io))
        return [
            *stages,
            EDGE_PASSES,
            TransformStage("delegate", lambda edge, run: lowering.delegate(edge, partitioners, run)),
            TransformStage("to_executorch", lambda edge, run: lowering.to_executorch(edge, config, run)),
        ]

    def bounds(self, model: torch.nn.Module, config: Any) -> AxisBounds:
        from hfexport.targets.executorch.lowering import memory_planning_bounds

        return memory_planning_bounds(model, config)

    def load_program(self, path: Path, trust: bool = False) -> Any:
        from hfexport.targets.executorch.lowering import load_edge

        return load_edge(path, trust)

    def save(self, program: Any, path: Path) -> None:
        from hfexport.targets.executorch.lowering import write_pte

        write_pte(program, path)

    def component(self, program: Any, captured: Captured | None) -> ComponentSpec:
        return pte_component(program, captured)

    def runner(self, path: Path, spec: ComponentSpec, trust: bool = False) -> ExecutorchRunner:
        return ExecutorchRunner(path, spec)

    def decoder(self, folder: Path, manifest: Manifest, batch_size: int, trust: bool = False) -> ExecutorchDecoder:
        spec = manifest.component("decode")
        return ExecutorchDecoder(folder / spec.file, batch_size, spec)


__all__ = ["ExecutorchDecoder", "ExecutorchRunner", "ExecutorchTarget"]
