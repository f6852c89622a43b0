"""hfexport: export Hugging Face transformers models through a staged, inspectable pipeline.

capture (torch.export) → named FX passes → lowering (torch.export / ONNX / ExecuTorch), where
every stage can dump its graph, be timed and be checked against eager PyTorch.
"""

from hfexport.auto import AutoExportConfig, AutoHfExporter, register_backend
from hfexport.configs import DynamoConfig, ExecutorchConfig, OnnxConfig
from hfexport.errors import (
    CaptureError,
    ConfigError,
    HfExportError,
    PassError,
    PassOrderError,
    StageError,
    UnsupportedModelError,
    VerificationError,
)
from hfexport.exporters import DynamoExporter, ExecutorchExporter, HfExporter, OnnxExporter
from hfexport.pipeline.generation import decompose_for_generation
from hfexport.pipeline.instruments import Instrument, StepRecord
from hfexport.pipeline.pass_manager import (
    Pass,
    PassManager,
    PassResult,
    get_pass,
    graph_pass,
    register_pass,
    registered_passes,
)
from hfexport.pipeline.patches import PATCHES, Patch, patches_applied, register_patch
from hfexport.pipeline.pipeline import Pipeline, PipelineResult
from hfexport.pipeline.pytree import register_pytree_node
from hfexport.runtime import ExecutorchRunner, OnnxRunner, load_exported_program

__all__ = [
    "PATCHES",
    "AutoExportConfig",
    "AutoHfExporter",
    "CaptureError",
    "ConfigError",
    "DynamoConfig",
    "DynamoExporter",
    "ExecutorchConfig",
    "ExecutorchExporter",
    "ExecutorchRunner",
    "HfExportError",
    "HfExporter",
    "Instrument",
    "OnnxConfig",
    "OnnxExporter",
    "OnnxRunner",
    "Pass",
    "PassError",
    "PassManager",
    "PassOrderError",
    "PassResult",
    "Patch",
    "Pipeline",
    "PipelineResult",
    "StageError",
    "StepRecord",
    "UnsupportedModelError",
    "VerificationError",
    "decompose_for_generation",
    "get_pass",
    "graph_pass",
    "load_exported_program",
    "patches_applied",
    "register_backend",
    "register_pass",
    "register_patch",
    "register_pytree_node",
    "registered_passes",
]
