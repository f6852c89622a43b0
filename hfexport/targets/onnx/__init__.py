"""The ONNX target: ``to_onnx`` (torch.onnx on the captured program) then the ONNX-level passes;
``.onnx`` artifacts run by ONNX Runtime (:class:`OnnxRunner`, :class:`OnnxDecoder`). The ONNX
packages are imported only when a stage or a runner runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hfexport.pipeline.capture import Captured
from hfexport.targets import Target
from hfexport.targets.manifest import ComponentSpec, Manifest
from hfexport.targets.onnx import passes
from hfexport.targets.onnx.runner import OnnxDecoder, OnnxRunner


class OnnxTarget(Target):
    """``ExportedProgram`` → ``torch.onnx.ONNXProgram`` → ``.onnx``."""

    name = "onnx"
    suffix = ".onnx"
    config_class = "hfexport.configs:OnnxConfig"
    default_passes = passes.DEFAULT_PASSES
    dtypes = ("float32", "float16")  # ONNX Runtime's CPU kernels: none for bfloat16 (MatMul, RotaryEmbedding, …)
    runtime = "ONNX Runtime's CPU provider"

    def keeps_stored(self, config: Any, module: torch.nn.Module) -> bool:
        # every cast of a stored weight is folded into the initializer written converted
        # (initializers.stored_weights_made_when_written)
        return True

    def runtime_loop(self, config: Any) -> str | None:
        return "ONNX Runtime GenAI" if config.genai else None

    def pass_list(self, config: Any) -> list[Any]:
        return passes.pass_list(config)

    def stages(self, config: Any) -> list[Any]:
        from hfexport.pipeline.pipeline import TransformStage
        from hfexport.targets.onnx.lowering import to_onnx

        def lower(program: Any, run: Any) -> Any:
            windows = run.captured.attention_windows if run.captured is not None else {}
            return to_onnx(program, config.opset_version, windows)

        stages: list[Any] = [TransformStage("to_onnx", lower), "onnx_passes"]
        if config.genai:
            from hfexport.targets.onnx.genai import genai_io

            stages.append(TransformStage("genai_io", lambda program, run: genai_io(program)))
        return stages

    def save(self, program: Any, path: Path) -> None:
        from hfexport.targets.onnx.lowering import save_onnx

        save_onnx(program, path)

    def runtime_files(self, manifest: Manifest) -> dict[str, str]:
        from hfexport.targets.onnx.genai import GENAI_CONFIG, INTERFACE, genai_config

        decode = manifest.components.get("decode")
        if decode is None or decode.interface != INTERFACE:
            return {}
        return {GENAI_CONFIG: json.dumps(genai_config(manifest), indent=2) + "\n"}

    def load_program(self, path: Path, trust: bool = False) -> Any:
        from hfexport.targets.onnx.lowering import load_onnx

        return load_onnx(path)

    def component(self, program: Any, captured: Captured | None) -> ComponentSpec:
        from hfexport.targets.onnx.lowering import onnx_component

        return onnx_component(program, captured)

    def runner(self, path: Path, spec: ComponentSpec, trust: bool = False) -> OnnxRunner:
        return OnnxRunner(path, spec)

    def decoder(self, folder: Path, manifest: Manifest, batch_size: int, trust: bool = False) -> OnnxDecoder:
        spec = manifest.component("decode")
        return OnnxDecoder(folder / spec.file, batch_size, spec)


__all__ = ["OnnxDecoder", "OnnxRunner", "OnnxTarget"]
