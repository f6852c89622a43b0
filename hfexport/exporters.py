"""The exporters: thin facades that build a :class:`~hfexport.Pipeline` from a config and run it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.configs import DynamoConfig, ExecutorchConfig, OnnxConfig
from hfexport.errors import ConfigError, HfExportError
from hfexport.pipeline.instruments import Instrument
from hfexport.pipeline.pass_manager import PassManager, resolve_passes
from hfexport.pipeline.pipeline import (
    CaptureStage,
    PassStage,
    Pipeline,
    PipelineResult,
    PipelineRun,
    Stage,
    TransformStage,
)
from hfexport.versions import warn_on_version_drift

FX_PASSES = "fx_passes"


class HfExporter:
    """Base of the exporters.

    A subclass sets ``export_format``, ``config_class`` and ``default_passes`` (pass names of any
    of its pass stages, in order) and lists its stages after the FX passes in
    :meth:`lowering_stages`: :class:`~hfexport.pipeline.pipeline.Stage` objects, and the names of
    pass stages, which receive the passes whose ``stage`` is that name.
    """

    export_format: ClassVar[str]
    config_class: ClassVar[type[DynamoConfig]]
    default_passes: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        warn_on_version_drift()

    def lowering_stages(self, config: Any) -> list[Stage | str]:
        """The stages after the FX passes (none for the Dynamo exporter)."""
        return []

    def capture_stage(self, config: Any) -> CaptureStage:
        """The capture stage (backends that need bounded dynamic axes override this)."""
        return CaptureStage()

    def pass_list(self, config: Any) -> list[Any]:
        """The configured pass list: ``config.passes`` or the default list."""
        return list(self.default_passes) if config.passes is None else list(config.passes)

    def _check_config(self, config: Any) -> Any:
        if config is None:
            return self.config_class()
        if not isinstance(config, self.config_class):
            raise ConfigError(
                f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}; "
                "use AutoHfExporter.from_config(config) to pick the exporter matching a config"
            )
        return config

    def build_pipeline(self, config: Any = None, instruments: tuple[Instrument, ...] = ()) -> Pipeline:
        """The pipeline :meth:`export` runs: capture → FX passes → lowering stages, with the
        passes of ``config.passes`` (or the default list) split among the pass stages, and the
        instruments the config asks for. Edit its ``passes`` and call :meth:`Pipeline.run` to run
        a custom pass list."""
        config = self._check_config(config)
        layout = [FX_PASSES, *self.lowering_stages(config)]
        stage_names = [s for s in layout if isinstance(s, str)]
        by_stage: dict[str, list[Any]] = {name: [] for name in stage_names}
        for pass_ in resolve_passes(self.pass_list(config)):
            if pass_.stage not in by_stage:
                raise ConfigError(
                    f"pass {pass_.name!r} runs in stage {pass_.stage!r}, which the {self.export_format} "
                    f"pipeline does not have (its pass stages: {', '.join(stage_names)})"
                )
            by_stage[pass_.stage].append(pass_)
        stages = [PassStage(s, PassManager(by_stage[s])) if isinstance(s, str) else s for s in layout]
        return Pipeline.for_config(stages, config, instruments, self.capture_stage(config))

    def run(
        self, model: torch.nn.Module, inputs: Any, config: Any = None, instruments: tuple[Instrument, ...] = ()
    ) -> PipelineResult:
        """Export and return the whole :class:`PipelineResult` (program, per-step records, report)."""
        config = self._check_config(config)
        return self.build_pipeline(config, instruments).run(model, inputs, config)

    def export(self, model: torch.nn.Module, inputs: Any, config: Any = None) -> Any:
        """Export ``model(**inputs)`` and return the backend's program. The model and the inputs
        are not modified."""
        return self.run(model, inputs, config).program

    def export_for_generation(
        self,
        model: torch.nn.Module,
        inputs: Any,
        config: Any = None,
        generation_config: Any = None,
        multi_token_decode: bool = False,
    ) -> dict[str, Any]:
        """Export each component of ``model``'s generation loop (see
        :func:`~hfexport.decompose_for_generation`): ``{component: program}``.

        ``config`` is one config for every component or ``{component: config}``; with a
        ``dump_dir``, each component dumps into its own subfolder. A failing component raises
        :class:`~hfexport.HfExportError` naming it.
        """
        from hfexport.pipeline.generation import decompose_for_generation

        components = decompose_for_generation(model, inputs, generation_config, multi_token_decode)
        programs = {}
        for name, (module, kwargs) in components.items():
            component_config = config.get(name) if isinstance(config, dict) else config
            component_config = copy.deepcopy(self._check_config(component_config))
            if component_config.dump_dir:
                component_config.dump_dir = str(Path(component_config.dump_dir) / name)
            try:
                programs[name] = self.export(module, kwargs, component_config)
            except HfExportError as error:
                raise type(error)(f"component {name!r}: {error}") from error
            except Exception as error:
                raise HfExportError(f"component {name!r} failed: {type(error).__name__}: {error}") from error
        return programs


CLEANUP_PASSES = ("remove_tensor_metadata_asserts", "remove_noop_conversions", "mark_cache_mutations")


class DynamoExporter(HfExporter):
    """Export to a ``torch.export`` ``ExportedProgram``: ``exported.module()(**inputs)`` runs it."""

    export_format = "dynamo"
    config_class = DynamoConfig
    default_passes = (*CLEANUP_PASSES, "dead_code_elimination")


class OnnxExporter(HfExporter):
    """Export to a ``torch.onnx.ONNXProgram``: ``.save("model.onnx")``, then run it with ONNX
    Runtime fed with the model's keyword inputs by name."""

    export_format = "onnx"
    config_class = OnnxConfig
    default_passes = (
        *CLEANUP_PASSES,
        "grouped_mm_to_batched_mm",
        "whole_input_convolutions_as_linear",
        "explicit_contiguous_copies",
        "zero_fully_masked_attention_rows",
        "dead_code_elimination",
        "onnx_optimizer",
    )

    def pass_list(self, config: OnnxConfig) -> list[Any]:
        passes = super().pass_list(config)
        if config.passes is None and not config.optimize:
            passes.remove("onnx_optimizer")
        return passes

    def lowering_stages(self, config: OnnxConfig) -> list[Stage | str]:
        from hfexport.lowering.onnx import to_onnx
        from hfexport.pipeline.windowed_cache import attention_windows

        def lower(program: torch.export.ExportedProgram, run: PipelineRun) -> Any:
            return to_onnx(program, config.opset_version, run.input_axes, attention_windows(run.inputs))

        return [TransformStage("to_onnx", lower), "onnx_passes"]


class ExecutorchExporter(HfExporter):
    """Export to an ExecuTorch ``ExecutorchProgramManager`` (XNNPACK-delegated by default):
    ``.save("model.pte")``, then run it with ``executorch.runtime``."""

    export_format = "executorch"
    config_class = ExecutorchConfig
    default_passes = (
        *CLEANUP_PASSES,
        "grouped_mm_to_batched_mm",
        "whole_input_convolutions_as_linear",
        "histc_to_comparisons",
        "sort_to_topk",
        "empty_like_to_zeros_like",
        "explicit_contiguous_copies",
        "dead_code_elimination",
    )

    def capture_stage(self, config: ExecutorchConfig) -> CaptureStage:
        from hfexport.lowering.executorch import BoundedCaptureStage

        return BoundedCaptureStage()

    def lowering_stages(self, config: ExecutorchConfig) -> list[Stage | str]:
        from hfexport.lowering import executorch
        from hfexport.pipeline.windowed_cache import attention_windows

        def to_executorch(edge: Any, run: PipelineRun) -> Any:
            return executorch.to_executorch(edge, config, run.input_axes, attention_windows(run.inputs))

        partitioners = executorch.partitioners(config.backend)
        return [
            TransformStage("to_edge", lambda program, run: executorch.to_edge(program, partitioners)),
            TransformStage("delegate", lambda edge, run: executorch.delegate(edge, partitioners, run)),
            TransformStage("to_executorch", to_executorch),
        ]
