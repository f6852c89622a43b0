"""ONNX lowering: the captured ``ExportedProgram`` → ``torch.onnx.ONNXProgram`` (no second trace).

Inputs and outputs get the names of their pytree paths (``input_ids``, ``logits``,
``cache.layers.0.keys``), so an ONNX Runtime session is fed with the model's own keyword names.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind, TensorArgument

from hfexport.pipeline.artifacts import ArtifactKind, register_artifact_kind
from hfexport.pipeline.capture import InputAxis, sample_shapes
from hfexport.pipeline.io_names import program_io_names
from hfexport.versions import require_backend

ONNX_MODULES = ("onnx", "onnxscript", "onnxruntime")


@contextlib.contextmanager
def _quiet_torch_onnx() -> Iterator[None]:
    # torch.onnx warns once per missing optional op library (torchvision) on every export.
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        yield
    finally:
        registration.setLevel(level)


def to_onnx(
    program: torch.export.ExportedProgram,
    opset_version: int | None = None,
    input_axes: list[InputAxis] = (),
    attention_windows: dict[str, int] | None = None,
) -> torch.onnx.ONNXProgram:
    """Translate an ``ExportedProgram`` to ONNX with torch.onnx (translation only: the optimizer
    runs as the ``onnx_optimizer`` pass).

    The model's metadata records the capture's input-axis bounds (``hfexport.input_axes``, read
    by :class:`~hfexport.runtime.OnnxRunner` to reject out-of-range inputs by name) and which
    outputs are symbolic integers rather than tensors (``hfexport.scalar_outputs``), and the
    sliding windows of windowed static-cache layers (``hfexport.attention_windows``, read by
    :class:`~hfexport.runtime.OnnxDecoder` to build each layer type's mask).
    """
    require_backend("onnx", ONNX_MODULES)
    input_names, output_names = program_io_names(program)
    # constants (flags like return_dict) are user inputs of the program but not ONNX inputs
    user_inputs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    input_names = [n for n, s in zip(input_names, user_inputs, strict=True) if not isinstance(s.arg, ConstantArgument)]
    with _quiet_torch_onnx():
        onnx_program = torch.onnx.export(
            program,
            (),
            dynamo=True,
            optimize=False,
            opset_version=opset_version,
            input_names=input_names,
            output_names=output_names,
            verbose=False,
        )
    _name_cache_io(onnx_program, input_names, output_names)
    user_outputs = [s for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    scalars = [
        name for name, spec in zip(output_names, user_outputs, strict=True) if not isinstance(spec.arg, TensorArgument)
    ]
    metadata = onnx_program.model.metadata_props
    metadata["hfexport.scalar_outputs"] = ",".join(scalars)
    metadata["hfexport.input_axes"] = json.dumps([dataclasses.asdict(axis) for axis in input_axes])
    metadata["hfexport.sample_shapes"] = json.dumps(sample_shapes(input_axes))
    metadata["hfexport.attention_windows"] = json.dumps(attention_windows or {})
    return onnx_program


def _name_cache_io(onnx_program: torch.onnx.ONNXProgram, input_names: list[str], output_names: list[str]) -> None:
    """Name the graph's inputs and outputs after their pytree paths; an input the program writes
    in place (a static cache) becomes ``input.<name>`` and the output carrying its new value
    ``output.<name>``, so a runtime can bind each pair to one buffer; any other output named like
    an input (a dynamic cache returned grown) becomes ``present.<name>``."""
    exported = onnx_program.exported_program
    signature = exported.graph_signature
    user_inputs = [
        s.arg.name
        for s in signature.input_specs
        if s.kind == InputKind.USER_INPUT and not isinstance(s.arg, ConstantArgument)
    ]
    name_of_placeholder = dict(zip(user_inputs, input_names, strict=False))
    written = {
        s.arg.name: name_of_placeholder[s.target]
        for s in signature.output_specs
        if s.kind == OutputKind.USER_INPUT_MUTATION and s.target in name_of_placeholder
    }
    mutated = set(written.values())
    graph = onnx_program.model.graph
    for value, name in zip(graph.inputs, input_names, strict=False):
        value.name = f"input.{name}" if name in mutated else name
    user_outputs = [s for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    names = [
        f"output.{written[spec.arg.name]}" if getattr(spec.arg, "name", None) in written else name
        for spec, name in zip(user_outputs, output_names, strict=False)
    ]
    # a new value of an input that is not written in place (a dynamic cache grown by concat) is
    # "present.<name>": ONNX names are unique across inputs and outputs
    taken = {value.name for value in graph.inputs}
    names = [f"present.{name}" if name in taken else name for name in names]
    _name_outputs(onnx_program, names)


def _name_outputs(onnx_program: torch.onnx.ONNXProgram, names: list[str]) -> None:
    """Give every graph output its own value and name. torch.onnx names outputs by renaming their
    values, so one value returned twice (two cache layers' token counters are the same symbol)
    keeps only the last name, and an input returned as an output would be renamed; each such
    output gets an Identity of its own."""
    import onnx_ir as ir

    graph = onnx_program.model.graph
    outputs = list(graph.outputs)
    if len(outputs) != len(names):
        return
    # an output that is also a graph input (a model returning an input unchanged) needs its own
    # value too, or naming it would rename the input
    seen: set[int] = {id(value) for value in graph.inputs}
    for index, (value, name) in enumerate(zip(outputs, names, strict=True)):
        if id(value) in seen:
            node = ir.Node("", "Identity", inputs=[value], num_outputs=1)
            graph.append(node)
            copy = node.outputs[0]
            copy.shape, copy.type = value.shape, value.type
            graph.outputs[index] = copy
            value = copy
        seen.add(id(value))
        value.name = name


def onnx_text(program: torch.onnx.ONNXProgram) -> str:
    return str(program.model)


def onnx_histogram(program: torch.onnx.ONNXProgram) -> collections.Counter:
    import onnx_ir as ir

    return collections.Counter(
        f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        for node in ir.traversal.RecursiveGraphIterator(program.model.graph)
    )


def save_onnx(program: torch.onnx.ONNXProgram, path: Path) -> None:
    """Save ``path`` (weights over 2 GB go to external data next to it, as torch.onnx does)."""
    program.save(str(path))


def snapshot_onnx(program: torch.onnx.ONNXProgram) -> torch.onnx.ONNXProgram:
    import onnx_ir as ir

    return torch.onnx.ONNXProgram(ir.serde.deserialize_model(ir.serde.serialize_model(program.model)), None)


def run_onnx_program(program: torch.onnx.ONNXProgram, inputs: dict[str, Any]) -> list[Any]:
    """Save to a temporary file and run it in a real ONNX Runtime session; the tensor outputs,
    in order."""
    from hfexport.runtime import OnnxRunner

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.onnx"
        save_onnx(program, path)
        return OnnxRunner(path).run(inputs, tensors_only=True)


register_artifact_kind(
    torch.onnx.ONNXProgram,
    ArtifactKind(
        suffix=".onnx",
        text=onnx_text,
        histogram=onnx_histogram,
        save=save_onnx,
        run=run_onnx_program,
        snapshot=snapshot_onnx,
        save_each_pass=True,
    ),
)
