"""The manifest of an export folder, ``hfexport.json``: one writer, one reader.

It holds what running a saved program needs and what no artifact format carries on its own: the
target, and per component its file, its inputs (artifact name, keyword path, dtype, sample shape,
dynamic axes with their ranges; constants), its outputs (tensor, symbolic integer, or the write-back
of an input the program updates in place: a static cache's pairs), the bounds applied at capture,
the attention windows of windowed static caches, the pipeline that made it, and the versions of
the stack. Targets build a :class:`ComponentSpec` from their program; runners and decoders read it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind, TensorArgument

from hfexport.errors import HfExportError
from hfexport.pipeline.capture import Captured
from hfexport.pipeline.io_names import program_io_names, user_input_names

MANIFEST = "hfexport.json"
FORMAT_VERSION = 1


@dataclass
class InputSpec:
    """One input of a program: ``name`` in the artifact, ``path`` in the model's keyword inputs
    (``cache.layers.0.keys``), dtype, sample shape, and ``dynamic`` axes as ``{axis: [min, max]}``
    (``max`` None: unbounded), each with its size as the program's symbol expression in ``dims``
    (axes of several inputs with one expression must have one size). A constant input (a flag such
    as ``use_cache``) has ``constant`` set and is not fed. ``written``: the program updates this
    input in place. ``state``: the program keeps this tensor inside (an ExecuTorch program's static
    cache): it is not fed, and its shape and dtype say what the program holds. ``none``: the program
    takes None there (a layer type's mask the step does not use): not fed; an ExecuTorch method
    still has the slot."""

    name: str
    path: str
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    dynamic: dict[int, list[int | None]] = field(default_factory=dict)
    written: bool = False
    constant: Any = None
    dims: dict[int, str] = field(default_factory=dict)
    state: bool = False
    none: bool = False


@dataclass
class OutputSpec:
    """One output: ``kind`` is ``"tensor"``, ``"scalar"`` (a symbolic integer, such as a cache's
    token counter), ``"write_back"`` (the new value of the input ``writes``) or ``"state"`` (an
    output of the model the program keeps inside as its state and does not return)."""

    name: str
    path: str
    kind: str = "tensor"
    writes: str | None = None


@dataclass
class ComponentSpec:
    """What a runner needs to run one saved program of an export. ``dtype``: the floating-point
    dtype the program computes in (its weights'; ``""`` for a program without floating-point
    weights, or a manifest written before it was recorded)."""

    file: str
    inputs: list[InputSpec]
    outputs: list[OutputSpec]
    bounds: dict[str, int] | None = None
    attention_windows: dict[str, int] = field(default_factory=dict)
    pipeline: str = ""
    shape_relations: list[dict[str, Any]] = field(default_factory=list)  # see hfexport.targets.shape_relations
    shape_conditions: list[dict[str, Any]] = field(default_factory=list)  # named when the runtime fails
    dtype: str = ""
    interface: str = ""  # "" (the spec's), or the runtime whose own loop it was made for ("onnxruntime-genai")

    @property
    def fed(self) -> list[InputSpec]:
        """The inputs a caller feeds (constants and program state excluded), in the program's order."""
        return [spec for spec in self.inputs if spec.constant is None and not spec.state and not spec.none]

    @property
    def returned(self) -> list[OutputSpec]:
        """The outputs the program returns, in its order (not those it keeps as its state)."""
        return [o for o in self.outputs if o.kind != "state"]

    @property
    def write_backs(self) -> dict[str, str]:
        """``{input name: output name}`` of the inputs the program writes back (cache pairs)."""
        by_path = {spec.path: spec.name for spec in self.inputs}
        return {by_path[o.writes]: o.name for o in self.outputs if o.kind == "write_back" and o.writes in by_path}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ComponentSpec:
        inputs = [
            InputSpec(
                **{
                    **i,
                    "dynamic": {int(axis): r for axis, r in i.get("dynamic", {}).items()},
                    "dims": {int(axis): d for axis, d in i.get("dims", {}).items()},
                }
            )
            for i in data["inputs"]
        ]
        return cls(**{**data, "inputs": inputs, "outputs": [OutputSpec(**o) for o in data["outputs"]]})


@dataclass
class Manifest:
    """The manifest of one export folder: the target and its components."""

    target: str
    components: dict[str, ComponentSpec]
    model: str = ""
    generation: dict[str, Any] | None = None
    versions: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / MANIFEST
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, folder: str | Path) -> Manifest:
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise HfExportError(
                f"{folder} has no {MANIFEST}; it is not a folder written by hfexport "
                "(`hfexport export MODEL --out DIR`, or hfexport.save_export in Python)"
            )
        try:
            data = json.loads(path.read_text())
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}")
            components = {name: ComponentSpec.from_dict(c) for name, c in data.pop("components").items()}
            return cls(components=components, **data)
        except (ValueError, KeyError, TypeError) as error:
            raise HfExportError(f"{path} is not a valid hfexport manifest ({error}); export again") from error

    def component(self, name: str) -> ComponentSpec:
        if name not in self.components:
            raise HfExportError(f"the export has no component {name!r}; it has: {', '.join(self.components)}")
        return self.components[name]

    @classmethod
    def find(cls, artifact: str | Path) -> tuple[Manifest, str] | None:
        """The manifest next to ``artifact`` and the name of the component stored in it, if any."""
        artifact = Path(artifact)
        if not (artifact.parent / MANIFEST).is_file():
            return None
        manifest = cls.read(artifact.parent)
        for name, spec in manifest.components.items():
            if spec.file == artifact.name:
                return manifest, name
        return None


# --- describing an ExportedProgram's inputs and outputs --------------------------------------------


def _dtype(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return "int64" if isinstance(value, (int, torch.SymInt)) else ""


def program_inputs(
    program: torch.export.ExportedProgram, captured: Captured | None, name: Any = None
) -> list[InputSpec]:
    """The user inputs of ``program`` in its flat order, named ``name(path, written)`` (default:
    the path), with the sample shapes and dynamic ranges of ``captured``."""
    paths = program_io_names(program)[0]
    user = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    written = {s.target for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION}
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    axes: dict[str, list[Any]] = {}
    for axis in captured.input_axes if captured else ():
        axes.setdefault(axis.input, []).append(axis)
    specs = []
    for path, spec in zip(paths, user, strict=True):
        if isinstance(spec.arg, ConstantArgument):
            if spec.arg.value is None:  # a layer type's absent mask: nothing to feed, but a slot
                specs.append(InputSpec(name=path, path=path, none=True))
                continue
            specs.append(InputSpec(name=path, path=path, constant=_jsonable(spec.arg.value)))
            continue
        is_written = spec.arg.name in written
        rows = axes.get(path, [])
        specs.append(
            InputSpec(
                name=name(path, is_written) if name else path,
                path=path,
                dtype=_dtype(values.get(spec.arg.name)),
                shape=[row.size for row in rows],
                dynamic={row.axis: [row.min, row.max] for row in rows if row.dynamic},
                written=is_written,
                dims={row.axis: row.dim for row in rows if row.dynamic and row.dim},
            )
        )
    return specs + program_state(program)


STATE_PREFIX = "state."  # the buffer of an input a program keeps as its state: state.<input path>
INPUT_SHAPE = "hfexport.input_shape"  # meta of a state buffer laid out otherwise than its input


def program_state(program: torch.export.ExportedProgram) -> list[InputSpec]:
    """The inputs ``program`` keeps as its state (buffers named ``state.<input path>``: see
    :func:`hfexport.targets.executorch.lowering.cache_as_program_state`), in its order."""
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    return [
        InputSpec(
            name=spec.target.removeprefix(STATE_PREFIX),
            path=spec.target.removeprefix(STATE_PREFIX),
            dtype=_dtype(nodes[spec.arg.name].meta.get("val")),
            shape=nodes[spec.arg.name].meta.get(INPUT_SHAPE)
            or [int(size) for size in nodes[spec.arg.name].meta["val"].shape],
            written=True,
            state=True,
        )
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.BUFFER and (spec.target or "").startswith(STATE_PREFIX)
    ]


def program_outputs(program: torch.export.ExportedProgram) -> list[tuple[str, str, str | None]]:
    """``(path, kind, written input path)`` for every output of ``program`` in its flat order:
    user outputs (``"tensor"`` / ``"scalar"``) and the write-backs of inputs it mutates."""
    paths = program_io_names(program)[1]
    input_path = user_input_names(program)
    user_paths = iter(paths)
    found = [(path, "state", None) for path in kept_inside(program.call_spec.out_spec)]
    for spec in program.graph_signature.output_specs:
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            target = input_path.get(spec.target, spec.target)
            found.append((target, "write_back", target))
        elif spec.kind == OutputKind.USER_OUTPUT:
            kind = "tensor" if isinstance(spec.arg, TensorArgument) else "scalar"
            found.append((next(user_paths), kind, None))
    return found


def kept_inside(out_spec: Any) -> list[str]:
    """The outputs a program keeps as its state: the empty ``()`` entries of its flat output dict
    (see :func:`hfexport.targets.executorch.lowering.cache_as_program_state`)."""
    if out_spec is None or out_spec.type is not dict:
        return []
    return [
        key
        for key, child in zip(out_spec.context, out_spec.children(), strict=True)
        if child.type is tuple and child.num_leaves == 0
    ]


def _jsonable(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def captured_facts(captured: Captured | None) -> dict[str, Any]:
    """The :class:`ComponentSpec` fields that come from the capture."""
    if captured is None:
        return {}
    from hfexport.targets.shape_relations import shape_conditions, shape_relations

    ranges = {(axis.input, axis.axis): (axis.min, axis.max) for axis in captured.input_axes if axis.dynamic}
    bounds = captured.bounds.counts() if captured.bounds else None
    return {
        "bounds": bounds,
        "attention_windows": dict(captured.attention_windows),
        "shape_relations": shape_relations(captured.program),
        "shape_conditions": shape_conditions(captured.program, ranges),
        "dtype": program_dtype(captured.program),
    }


def program_dtype(program: torch.export.ExportedProgram) -> str:
    """The floating-point dtype holding most of ``program``'s weight elements (parameters,
    buffers, constants), as ``"bfloat16"``; ``""`` without floating-point weights. A weight the
    program only ever casts (one the model stores narrower than it computes:
    :class:`~hfexport.computed_weights.ComputedIn`) counts in the dtype it is cast to."""
    signature = program.graph_signature
    names = {
        **signature.inputs_to_parameters,
        **signature.inputs_to_buffers,
        **signature.inputs_to_lifted_tensor_constants,
    }
    cast_to: dict[str, torch.dtype] = {}
    for node in program.graph.nodes:
        users = [user for user in node.users if user.target != torch.ops.aten._assert_tensor_metadata.default]
        if node.op == "placeholder" and node.name in names and users:
            dtypes = {_cast_dtype(user) for user in users}
            if len(dtypes) == 1 and isinstance(next(iter(dtypes)), torch.dtype):
                cast_to[names[node.name]] = dtypes.pop()
    counts: dict[torch.dtype, int] = {}
    for name, tensor in [*program.state_dict.items(), *program.constants.items()]:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            dtype = cast_to.get(name, tensor.dtype)
            counts[dtype] = counts.get(dtype, 0) + tensor.numel()
    return _dtype(torch.empty(0, dtype=max(counts, key=counts.__getitem__))) if counts else ""


def _cast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype ``node`` casts its input to, if it is a cast (``Tensor.to(dtype)``)."""
    aten = torch.ops.aten
    if node.target == aten.to.dtype:
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    if node.target in (aten._to_copy.default, aten.to.dtype_layout):
        return node.kwargs.get("dtype")
    return None
