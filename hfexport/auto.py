"""Auto classes: pick the config class from a dict and the exporter from a config."""

from __future__ import annotations

import importlib
from typing import Any

from hfexport.configs import DynamoConfig
from hfexport.errors import ConfigError

# export_format -> ("module:ConfigClass", "module:ExporterClass"); imported on first use so a
# backend's packages load only when that backend is asked for.
BACKENDS: dict[str, tuple[str, str]] = {
    "dynamo": ("hfexport.configs:DynamoConfig", "hfexport.exporters:DynamoExporter"),
    "onnx": ("hfexport.configs:OnnxConfig", "hfexport.exporters:OnnxExporter"),
    "executorch": ("hfexport.configs:ExecutorchConfig", "hfexport.exporters:ExecutorchExporter"),
}


def register_backend(export_format: str, config_class: str, exporter_class: str) -> None:
    """Register a backend by the dotted ``module:Class`` paths of its config and exporter."""
    BACKENDS[export_format] = (config_class, exporter_class)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _backend(export_format: Any) -> tuple[str, str]:
    if export_format not in BACKENDS:
        raise ConfigError(f"unknown export_format {export_format!r}; valid formats: {', '.join(BACKENDS)}")
    return BACKENDS[export_format]


class AutoExportConfig:
    """``AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": True})``."""

    @staticmethod
    def from_dict(data: dict[str, Any]) -> DynamoConfig:
        if "export_format" not in data:
            raise ConfigError(f"the config dict needs an 'export_format' key; valid formats: {', '.join(BACKENDS)}")
        config_path, _ = _backend(data["export_format"])
        return _load(config_path).from_dict(data)


class AutoHfExporter:
    """``AutoHfExporter.from_config(config)``: the exporter for a config's ``export_format``."""

    @staticmethod
    def from_config(config: DynamoConfig) -> Any:
        _, exporter_path = _backend(getattr(config, "export_format", None))
        return _load(exporter_path)()
