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


def _imports(path: Path) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
    return found


FORBIDDEN_IN_PIPELINE = ("transformers", "hfexport.passes", "hfexport.targets", "hfexport.models", "hfexport.exporters")


def test_pipeline_knows_no_model_no_pass_and_no_target():
    files = sorted((PACKAGE / "pipeline").glob("*.py"))
    assert len(files) >= 8
    offenders = {
        f"{path.name}: {name}"
        for path in files
        for name in _imports(path)
        if name.startswith(FORBIDDEN_IN_PIPELINE) or name.split(".")[0] in BACKENDS
    }
    assert offenders == set()


def test_every_attribute_patch_goes_through_the_registry():
    import ast

    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "pipeline" / "patches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            function = node.func
            if isinstance(function, ast.Name) and function.id in ("setattr", "delattr"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {function.id}")
            # vars(module).update(...) / vars(module)[name] = ... rebinding another module's names
            if isinstance(function, ast.Attribute) and function.attr == "update":
                owner = function.value
                if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "vars":
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} vars(...).update")
    assert offenders == []


def _patched_state():
    from hfexport import PATCHES

    state = {}
    for patch in PATCHES.values():
        for owner, attribute in patch.owners():
            # None: a builtin the module only shadows while patched (``module:bytes``)
            state[patch.name, getattr(owner, "__name__", repr(owner)), attribute] = getattr(owner, attribute, None)
    return state


def test_every_registered_patch_is_restored_after_a_failing_capture_and_decomposition(monkeypatch):
    import executorch.exir.program._program as executorch_program
    import pytest
    import transformers.models.canine.modeling_canine  # targets of canine_local_attention_as_a_block_mask, ...
    import transformers.models.cpmant.modeling_cpmant  # a target of cpmant_padding_mask_from_arange
    import transformers.models.deepseek_v4.modeling_deepseek_v4  # targets of deepseek_v4_*_for_any_window_count
    import transformers.models.encodec.modeling_encodec  # targets of the codec convolutions' patches
    import transformers.models.llava.modeling_llava  # a target of llava_image_features_split_when_read
    import transformers.models.mamba.modeling_mamba  # a target of selective_scan_as_scan_op
    import transformers.models.mimi.modeling_mimi
    import transformers.models.ovis2.modeling_ovis2  # a target of ovis2_visual_indicators_by_where
    import transformers.models.pixtral.modeling_pixtral  # a target of pixtral_images_of_one_size_without_a_loop
    import transformers.models.pocket_tts_audio_tokenizer.modeling_pocket_tts_audio_tokenizer
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # a target of vision_window_index_per_token
    import transformers.models.qwen2_vl.modeling_qwen2_vl
    import transformers.models.qwen3_vl.modeling_qwen3_vl  # a target of vision_interpolation_per_token
    import transformers.models.reformer.modeling_reformer  # a target of reformer_axial_positions_by_indexing
    import transformers.models.rwkv.modeling_rwkv  # a target of rwkv_recurrence_as_scan_op
    import transformers.models.switch_transformers.modeling_switch_transformers  # switch_experts_dense
    import transformers.models.wavtokenizer.modeling_wavtokenizer  # noqa: F401

    import hfexport.targets.executorch.lowering
    import hfexport.targets.onnx.lowering  # noqa: F401  (registers the to_onnx patch)
    from hfexport import (
        PATCHES,
        CaptureError,
        DynamoExporter,
        ExecutorchExporter,
        HfExportError,
        OnnxExporter,
        decompose_for_generation,
    )
    from hfexport.presets import PRESETS, sample_inputs

    scopes = {patch.scope for patch in PATCHES.values()}
    assert scopes == {"capture", "generate", "to_onnx", "onnx_passes", "to_edge", "delegate", "to_executorch"}
    before = _patched_state()
    assert {name for name, _, _ in before} == set(PATCHES)  # every patch has at least one target here
    seen: dict = {}

    def failing_export(*args, **kwargs):
        seen["capture"] = _patched_state()
        raise RuntimeError("capture failed on purpose")

    model = PRESETS["tiny-llama"].build()
    with monkeypatch.context() as patched:
        patched.setattr(torch.export, "export", failing_export)
        with pytest.raises(CaptureError, match="capture failed on purpose"):
            DynamoExporter().export(model, sample_inputs(model))
    assert _patched_state() == before

    def failing_forward(module, args, kwargs):
        seen["generate"] = _patched_state()
        raise RuntimeError("generate failed on purpose")

    handle = model.register_forward_pre_hook(failing_forward, with_kwargs=True)
    try:
        with pytest.raises((RuntimeError, HfExportError), match="generate failed on purpose"):
            decompose_for_generation(model, sample_inputs(model))
    finally:
        handle.remove()
    assert _patched_state() == before

    def failing_translation(*args, **kwargs):
        seen["to_onnx"] = _patched_state()
        raise RuntimeError("translation failed on purpose")

    with monkeypatch.context() as patched:
        patched.setattr(torch.onnx, "export", failing_translation)
        with pytest.raises(HfExportError, match="translation failed on purpose"):
            OnnxExporter().export(model, sample_inputs(model))
    assert _patched_state() == before

    import onnxscript.optimizer

    def failing_folding(*args, **kwargs):
        seen["onnx_passes"] = _patched_state()
        raise RuntimeError("folding failed on purpose")

    with monkeypatch.context() as patched:
        patched.setattr(onnxscript.optimizer, "fold_constants", failing_folding)
        with pytest.raises(HfExportError, match="folding failed on purpose"):
            OnnxExporter().export(model, sample_inputs(model))
    assert _patched_state() == before

    def failing_edge(*args, **kwargs):
        seen["to_edge"] = _patched_state()
        raise RuntimeError("edge conversion failed on purpose")

    with monkeypatch.context() as patched:
        patched.setattr(executorch_program, "_gen_edge_manager_for_partitioners", failing_edge)
        with pytest.raises(HfExportError, match="edge conversion failed on purpose"):
            ExecutorchExporter().export(model, sample_inputs(model))
    assert _patched_state() == before

    def failing_delegation(*args, **kwargs):
        seen["delegate"] = _patched_state()
        raise RuntimeError("delegation failed on purpose")

    with monkeypatch.context() as patched:
        patched.setattr(executorch_program.EdgeProgramManager, "to_backend", failing_delegation)
        with pytest.raises(HfExportError, match="delegation failed on purpose"):
            ExecutorchExporter().export(model, sample_inputs(model))
    assert _patched_state() == before

    def failing_emission(*args, **kwargs):
        seen["to_executorch"] = _patched_state()
        raise RuntimeError("emission failed on purpose")

    with monkeypatch.context() as patched:
        patched.setattr(executorch_program.EdgeProgramManager, "to_executorch", failing_emission)
        with pytest.raises(HfExportError, match="emission failed on purpose"):
            ExecutorchExporter().export(model, sample_inputs(model))
    assert _patched_state() == before
    assert set(seen) == {"capture", "generate", "to_onnx", "onnx_passes", "to_edge", "delegate", "to_executorch"}
    # inside each scope, exactly that scope's patches were on (an attribute two scopes patch, such as
    # get_vision_position_ids, changes in both)
    for scope, state in seen.items():
        for key, value in state.items():
            scopes = {PATCHES[name].scope for name, owner, attribute in state if (owner, attribute) == key[1:]}
            assert (value is not before[key]) == (scope in scopes), (scope, key)


def test_readme_layout_matches_the_tree():
    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    block = layout[layout.index("```") + 3 : layout.index("```", layout.index("```") + 3)]
    named = set(re.findall(r"^\s{2}([a-z_]+(?:/|\.py))", block, re.M))
    actual = {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    actual |= {p.name for p in PACKAGE.glob("*.py") if p.name in {"exporters.py", "generation.py", "cli.py"}}
    assert actual <= named, f"not described in the README layout: {sorted(actual - named)}"
    for name in named:
        assert (PACKAGE / name.rstrip("/")).exists(), f"README layout names {name}, which does not exist"
    for target in ("dynamo", "onnx", "executorch"):
        assert (PACKAGE / "targets" / target / "__init__.py").is_file() and f"{target}/" in block


TARGET_FOLDERS = sorted(p.name for p in (PACKAGE / "targets").iterdir() if (p / "__init__.py").is_file())


def _module_imports(folder: Path) -> dict[str, list[str]]:
    return {str(path.relative_to(PACKAGE)): _imports(path) for path in sorted(folder.rglob("*.py"))}


def test_the_pass_library_imports_no_target_and_no_backend():
    offenders = {
        f"{path}: {name}"
        for path, names in _module_imports(PACKAGE / "passes").items()
        for name in names
        if name.startswith(("hfexport.targets", "hfexport.exporters")) or name.split(".")[0] in BACKENDS
    }
    assert offenders == set()


def test_no_target_imports_another_target():
    assert TARGET_FOLDERS == ["dynamo", "executorch", "onnx"]
    offenders = {
        f"{path}: {name}"
        for target in TARGET_FOLDERS
        for path, names in _module_imports(PACKAGE / "targets" / target).items()
        for name in names
        if any(name.startswith(f"hfexport.targets.{other}") for other in TARGET_FOLDERS if other != target)
    }
    assert offenders == set()


def _home(pass_) -> str:
    """The module a registered pass is defined in."""
    rules = getattr(pass_, "rules", None)
    implementation = rules[0].rewrite if rules else getattr(pass_, "fn", type(pass_))
    return implementation.__module__


def test_every_default_pass_is_registered_and_the_pass_library_serves_more_than_one_target():
    from hfexport.pipeline.pass_manager import get_pass, registered_passes

    defaults = {name: set(hfexport.get_target(name).default_passes) for name in TARGET_FOLDERS}
    for target, names in defaults.items():
        for name in names:
            assert get_pass(name, missing_ok=True) is not None, (
                f"{target}'s default list names {name!r}, not registered"
            )
    by_module: dict[str, set[str]] = {}
    for name, pass_ in registered_passes().items():
        by_module.setdefault(_home(pass_), set()).add(name)
    library = {module for module in by_module if module.startswith("hfexport.passes.")}
    assert len(library) >= 6, sorted(by_module)
    for module in library:
        users = sorted(target for target, names in defaults.items() if names & by_module[module])
        assert len(users) != 1, f"{module} serves {users[0]} only: move it to hfexport/targets/{users[0]}/passes/"
    for target in ("onnx", "executorch"):  # a target's own passes live in its folder
        own = {module for module in by_module if module.startswith(f"hfexport.targets.{target}.passes")}
        assert own and all(by_module[module] for module in own)


def test_every_built_in_pass_says_when_to_leave_it_out():
    from hfexport.pipeline.pass_manager import _is_builtin, registered_passes

    silent = sorted(name for name, pass_ in registered_passes().items() if _is_builtin(pass_) and not pass_.remove_when)
    assert silent == [], "give these passes a remove_when line (the pass catalogue prints it)"
