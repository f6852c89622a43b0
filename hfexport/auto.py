"""Auto classes: pick the config class from a dict and the exporter from a config, through the
target registry (:mod:`hfexport.targets`)."""

from __future__ import annotations

from typing import Any

from hfexport.configs import DynamoConfig
from hfexport.errors import ConfigError
from hfexport.exporters import exporter_for
from hfexport.targets import Target, get_target, target_names


class AutoExportConfig:
    """``AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": True})``."""

    @staticmethod
    def from_dict(data: dict[str, Any]) -> DynamoConfig:
        if "export_format" not in data:
            raise ConfigError(
                f"the config dict needs an 'export_format' key; valid formats: {', '.join(target_names())}"
            )
        return Target.load_class(get_target(data["export_format"]).config_class).from_dict(data)


class AutoHfExporter:
    """``AutoHfExporter.from_config(config)``: the exporter for a config's ``export_format``."""

    @staticmethod
    def from_config(config: DynamoConfig) -> Any:
        return exporter_for(getattr(config, "export_format", None))
