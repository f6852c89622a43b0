"""Configs and auto classes."""

import dataclasses
import re

import pytest
import torch

from hfexport import (
    AutoExportConfig,
    AutoHfExporter,
    ConfigError,
    DynamoConfig,
    DynamoExporter,
    ExecutorchConfig,
    OnnxConfig,
)


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


def _wrong_value(field):
    """A value of the wrong type for ``field``: a string where it takes a number, else a number."""
    takes_numbers = any(part.strip() in ("int", "float") for part in str(field.type).split("|"))
    return "42" if takes_numbers else 42


@pytest.mark.parametrize(
    ("config_class", "field"),
    [
        (config_class, field)
        for config_class in (DynamoConfig, OnnxConfig, ExecutorchConfig)
        for field in dataclasses.fields(config_class)
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else value.name,
)
def test_every_field_of_the_wrong_type_is_a_config_error_naming_it(config_class, field):
    value = _wrong_value(field)
    with pytest.raises(ConfigError) as caught:
        config_class(**{field.name: value})
    message = str(caught.value)
    assert "\n" not in message
    assert f"{config_class.__name__} {field.name}" in message, message
    assert f"got {value!r}" in message and "must be" in message, message


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"passes": 42}, "DynamoConfig passes must be a comma-separated string of pass names, a list of pass names"),
        ({"passes": ["dead_code_elimination", 42]}, "DynamoConfig passes[1] must be a pass name (str) or a Pass"),
        ({"passes": {"dead_code_elimination"}}, "DynamoConfig passes must be .*, got {'dead_code_elimination'} (set)"),
        ({"dynamic_shapes": "batch"}, "DynamoConfig dynamic_shapes must be a dict {input name: axes}"),
        ({"dump_dir": 3}, "DynamoConfig dump_dir must be str or Path or None, got 3 (int)"),
        ({"verify": 1}, "DynamoConfig verify must be True, False or 'passes', got 1 (int)"),
    ],
)
def test_a_field_of_the_wrong_type_says_what_it_takes(values, message):
    with pytest.raises(ConfigError, match=re.escape(message).replace(r"\.\*", ".*")):
        DynamoConfig(**values)


def test_a_dump_dir_may_be_a_path(tmp_path):
    assert DynamoConfig(dump_dir=tmp_path / "dumps").dump_dir == str(tmp_path / "dumps")
