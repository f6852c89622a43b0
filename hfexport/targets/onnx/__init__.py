"""The ONNX target: ``to_onnx`` (torch.onnx on the captured program) then the ONNX-level passes;
``.onnx`` artifacts run by ONNX Runtime (:class:`OnnxRunner`, :class:`OnnxDecoder`). The ONNX
packages are imported only when a stage or a runner runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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

    def pass_list(self, config: Any) -> list[Any]:
        return passes.pass_list(config)

    def stages(self, config: Any) -> list[Any]:
        from hfexport.pipeline.pipeline import TransformStage
        from hfexport.targets.onnx.lowering import to_onnx

        return [TransformStage("to_onnx", lambda program, run: to_onnx(program, config.opset_version)), "onnx_passes"]

    def save(self, program: Any, path: Path) -> None:
        from hfexport.targets.onnx.lowering import save_onnx

        save_onnx(program, path)

    def load_program(self, path: Path, trust: bool = False) -> Any:
        from hfexport.targets.onnx.lowering import load_onnx

        return load_onnx(path)

    def component(self, program: Any, captured: Captured | None) -> ComponentSpec:
        from hfexport.targets.onnx.lowering import onnx_component

        return onnx_component(program.exported_program, captured)

    def runner(self, path: Path, spec: ComponentSpec, trust: bool = False) -> OnnxRunner:
        return OnnxRunner(path, spec)

    def decoder(self, folder: Path, manifest: Manifest, batch_size: int, trust: bool = False) -> OnnxDecoder:
        spec = manifest.component("decode")
        return OnnxDecoder(folder / spec.file, batch_size, spec)


__all__ = ["OnnxDecoder", "OnnxRunner", "OnnxTarget"]
