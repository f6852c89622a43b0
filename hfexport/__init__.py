"""hfexport: export Hugging Face transformers models through a staged, inspectable pipeline.

capture (torch.export) → named FX passes → lowering (torch.export / ONNX / ExecuTorch), where
every stage can dump its graph, be timed and be checked against eager PyTorch.
"""

# first: the export command's own process is set up before torch loads
import hfexport.export_process

# registers the built-in passes: the target-neutral ones, then each target's own
import hfexport.passes
import hfexport.targets.executorch.passes
import hfexport.targets.onnx.passes  # noqa: F401
from hfexport.auto import AutoExportConfig, AutoHfExporter
from hfexport.configs import DynamoConfig, ExecutorchConfig, OnnxConfig
from hfexport.errors import (
    ArtifactError,
    CaptureError,
    ConfigError,
    HfExportError,
    PassError,
    PassOrderError,
    RuntimeInterfaceError,
    StageError,
    UnsupportedModelError,
    VerificationError,
)
from hfexport.exporters import (
    DynamoExporter,
    ExecutorchExporter,
    HfExporter,
    OnnxExporter,
    export_targets,
    run_for_generation,
    run_targets,
)
from hfexport.generation import Sampling
from hfexport.models.caches import register_pytree_node
from hfexport.models.generation import decompose_for_generation
from hfexport.pipeline.capture import Captured
from hfexport.pipeline.dynamic_shapes import AxisBounds
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
from hfexport.targets import ExportFolder, Target, get_target, register_target, save_export
from hfexport.targets.dynamo import load_exported_program
from hfexport.targets.executorch.runner import ExecutorchRunner
from hfexport.targets.manifest import ComponentSpec, Manifest
from hfexport.targets.onnx.runner import OnnxRunner
from hfexport.text_generator import TextGenerator, load

__all__ = [
    "PATCHES",
    "ArtifactError",
    "AutoExportConfig",
    "AutoHfExporter",
    "AxisBounds",
    "CaptureError",
    "Captured",
    "ComponentSpec",
    "ConfigError",
    "DynamoConfig",
    "DynamoExporter",
    "ExecutorchConfig",
    "ExecutorchExporter",
    "ExecutorchRunner",
    "ExportFolder",
    "HfExportError",
    "HfExporter",
    "Instrument",
    "Manifest",
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
    "RuntimeInterfaceError",
    "Sampling",
    "StageError",
    "StepRecord",
    "Target",
    "TextGenerator",
    "UnsupportedModelError",
    "VerificationError",
    "decompose_for_generation",
    "export_targets",
    "get_pass",
    "get_target",
    "graph_pass",
    "load",
    "load_exported_program",
    "patches_applied",
    "register_pass",
    "register_patch",
    "register_pytree_node",
    "register_target",
    "registered_passes",
    "run_for_generation",
    "run_targets",
    "save_export",
]
