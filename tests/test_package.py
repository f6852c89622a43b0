"""Package-level rules: lazy backends, no forbidden imports, version drift warning."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import hfexport
from hfexport import versions

PACKAGE = Path(hfexport.__file__).parent

BACKENDS = ("onnx", "onnxscript", "onnxruntime", "onnx_ir", "executorch", "optimum")


def _site_without_backends(tmp_path: Path) -> Path:
    """A copy (by symlinks) of site-packages without the backend packages: as if only torch,
    transformers and their dependencies were installed."""
    site = Path(torch.__file__).parent.parent
    view = tmp_path / "site"
    view.mkdir()
    for entry in site.iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower()
        if top not in BACKENDS:
            (view / entry.name).symlink_to(entry)
    return view


def test_import_and_dynamo_export_work_without_backend_packages(tmp_path):
    code = """
import importlib.util, torch, hfexport
assert importlib.util.find_spec("onnx") is None and importlib.util.find_spec("executorch") is None
from hfexport.presets import PRESETS, sample_inputs
model = PRESETS['tiny-llama'].build()
program = hfexport.DynamoExporter().export(model, sample_inputs(model), hfexport.DynamoConfig(dynamic=True))
print('ok', type(program).__name__)
"""
    env = {**os.environ, "PYTHONPATH": f"{PACKAGE.parent}{os.pathsep}{_site_without_backends(tmp_path)}"}
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok ExportedProgram" in result.stdout


def test_no_transformers_exporters_or_optimum_imports():
    pattern = re.compile(r"^\s*(from|import)\s+(transformers\.exporters|optimum)\b|transformers\.exporters", re.M)
    offenders = [str(p) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_pins_are_read_from_pyproject():
    names = {r.name for r in versions.tested_requirements()}
    assert {"torch", "transformers", "onnxscript", "executorch"} <= names


def test_version_drift_warns_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="hfexport")
    monkeypatch.setattr(versions, "_checked", False)
    monkeypatch.setattr(versions.importlib.metadata, "version", lambda name: "0.0.1")
    versions.warn_on_version_drift()
    versions.warn_on_version_drift()
    drift = [r for r in caplog.records if "installed versions differ" in r.getMessage()]
    assert len(drift) == 1 and "torch 0.0.1" in drift[0].getMessage()


def test_installed_stack_has_no_drift():
    assert versions.version_drift() == []
