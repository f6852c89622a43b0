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
from hfexport.targets.executorch.manifest_entry import pte_component
from hfexport.targets.executorch.runner import ExecutorchDecoder, ExecutorchRunner
from hfexport.targets.manifest import ComponentSpec, Manifest


class ExecutorchTarget(Target):
    """``ExportedProgram`` → edge dialect → delegated → ``ExecutorchProgramManager`` → ``.pte``."""

    name = "executorch"
    suffix = ".pte"
    config_class = "hfexport.configs:ExecutorchConfig"
    exporter_class = "hfexport.exporters:ExecutorchExporter"
    runtime = "the ExecuTorch runtime"

    def stages(self, config: Any) -> list[Any]:
        from hfexport.pipeline.pipeline import TransformStage
        from hfexport.targets.executorch import lowering

        partitioners = lowering.partitioners(config.backend)
        return [
            TransformStage(
                "to_edge",
                lambda program, run: lowering.to_edge(
                    program, partitioners, run.inputs if config.cache_in_program and config.alloc_graph_input else None
                ),
            ),
            TransformStage("delegate", lambda edge, run: lowering.delegate(edge, partitioners, run)),
            TransformStage("to_executorch", lambda edge, run: lowering.to_executorch(edge, config, run)),
        ]

    def bounds(self, model: torch.nn.Module, config: Any) -> AxisBounds:
        from hfexport.targets.executorch.lowering import memory_planning_bounds

        return memory_planning_bounds(model, config)

    def save(self, program: Any, path: Path) -> None:
        program.save(str(path))

    def component(self, program: Any, captured: Captured | None) -> ComponentSpec:
        return pte_component(program, captured)

    def runner(self, path: Path, spec: ComponentSpec, trust: bool = False) -> ExecutorchRunner:
        return ExecutorchRunner(path, spec)

    def decoder(self, folder: Path, manifest: Manifest, batch_size: int, trust: bool = False) -> ExecutorchDecoder:
        spec = manifest.component("decode")
        return ExecutorchDecoder(folder / spec.file, batch_size, spec)


__all__ = ["ExecutorchDecoder", "ExecutorchRunner", "ExecutorchTarget"]
