"""The exporters: thin facades that build a :class:`~hfexport.Pipeline` from a config and run it."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hfexport.configs import DynamoConfig
from hfexport.errors import ConfigError
from hfexport.pipeline.instruments import Instrument
from hfexport.pipeline.pass_manager import PassManager
from hfexport.pipeline.pipeline import PassStage, Pipeline, PipelineResult, Stage
from hfexport.versions import warn_on_version_drift


class HfExporter:
    """Base of the exporters. A subclass sets ``export_format``, ``config_class`` and
    ``default_passes``, and adds its lowering stages in :meth:`lowering_stages`."""

    export_format: ClassVar[str]
    config_class: ClassVar[type[DynamoConfig]]
    default_passes: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        warn_on_version_drift()

    def lowering_stages(self, config: DynamoConfig) -> list[Stage]:
        """The stages after the FX passes (none for the Dynamo exporter)."""
        return []

    def _check_config(self, config: DynamoConfig | None) -> DynamoConfig:
        if config is None:
            return self.config_class()
        if not isinstance(config, self.config_class):
            raise ConfigError(
                f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}; "
                "use AutoHfExporter.from_config(config) to pick the exporter matching a config"
            )
        return config

    def build_pipeline(self, config: DynamoConfig | None = None, instruments: tuple[Instrument, ...] = ()) -> Pipeline:
        """The pipeline :meth:`export` runs: capture → FX passes (``config.passes`` or the
        default list) → lowering stages, with the instruments the config asks for. Edit its
        ``passes`` and call :meth:`Pipeline.run` to run a custom pass list."""
        config = self._check_config(config)
        passes = PassManager(self.default_passes if config.passes is None else config.passes)
        stages = [PassStage("fx_passes", passes), *self.lowering_stages(config)]
        return Pipeline.for_config(stages, config, instruments)

    def run(
        self,
        model: torch.nn.Module,
        inputs: Any,
        config: DynamoConfig | None = None,
        instruments: tuple[Instrument, ...] = (),
    ) -> PipelineResult:
        """Export and return the whole :class:`PipelineResult` (program, per-step records, report)."""
        config = self._check_config(config)
        return self.build_pipeline(config, instruments).run(model, inputs, config)

    def export(self, model: torch.nn.Module, inputs: Any, config: DynamoConfig | None = None) -> Any:
        """Export ``model(**inputs)`` and return the backend's program. The model and the inputs
        are not modified."""
        return self.run(model, inputs, config).program


class DynamoExporter(HfExporter):
    """Export to a ``torch.export`` ``ExportedProgram``: ``exported.module()(**inputs)`` runs it."""

    export_format = "dynamo"
    config_class = DynamoConfig
    default_passes = ("remove_tensor_metadata_asserts", "remove_noop_conversions", "dead_code_elimination")
