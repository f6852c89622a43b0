"""Configs and auto classes."""

import pytest
import torch

from hfexport import AutoExportConfig, AutoHfExporter, ConfigError, DynamoConfig, DynamoExporter


def test_round_trip_through_json_with_dims():
    batch = torch.export.Dim("batch", min=1, max=32)
    seq = torch.export.Dim("seq", min=1, max=2048)
    config = DynamoConfig(
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
        passes="remove_tensor_metadata_asserts,dead_code_elimination",
        dump_dir="d",
        verify=True,
    )
    data = config.to_dict()
    assert data["export_format"] == "dynamo"
    assert data["passes"] == ["remove_tensor_metadata_asserts", "dead_code_elimination"]
    again = DynamoConfig.from_json(config.to_json())
    assert again.to_dict() == data
    shapes = again.dynamic_shapes
    assert shapes["input_ids"][0] is shapes["attention_mask"][0]  # one Dim object per name
    assert (shapes["input_ids"][1].min, shapes["input_ids"][1].max) == (1, 2048)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match="unknown DynamoConfig key.*'dynamik'.*valid keys: dynamic, dynamic_shapes"):
        DynamoConfig.from_dict({"dynamik": True})


def test_auto_classes():
    config = AutoExportConfig.from_dict({"export_format": "dynamo", "dynamic": True})
    assert isinstance(config, DynamoConfig) and config.dynamic
    assert isinstance(AutoHfExporter.from_config(config), DynamoExporter)


def test_unknown_format_lists_valid_ones():
    with pytest.raises(ConfigError, match="unknown export_format 'tflite'; valid formats: dynamo"):
        AutoExportConfig.from_dict({"export_format": "tflite"})
    with pytest.raises(ConfigError, match="'export_format'"):
        AutoExportConfig.from_dict({"dynamic": True})


def test_dynamic_and_explicit_shapes_conflict():
    with pytest.raises(ConfigError, match="either dynamic=True"):
        DynamoConfig(dynamic=True, dynamic_shapes={"input_ids": {0: torch.export.Dim.AUTO}})


def test_exporter_rejects_a_config_of_another_kind():
    with pytest.raises(ConfigError, match="DynamoExporter takes a DynamoConfig"):
        DynamoExporter().build_pipeline(object())
