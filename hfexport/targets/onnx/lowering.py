"""ONNX lowering: the captured ``ExportedProgram`` → ``torch.onnx.ONNXProgram`` (no second trace).

Inputs and outputs get the names of their keyword paths (``input_ids``, ``logits``,
``cache.layers.0.keys``), so an ONNX Runtime session is fed with the model's own keyword names. An
input the program writes in place (a static cache) is ``input.<path>`` and the output carrying its
new value ``output.<path>``, so a runtime can bind each pair to one buffer; any other output named
like an input (a dynamic cache returned grown) is ``present.<path>``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import json
import operator
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch.export.graph_signature import ConstantArgument, ExportGraphSignature, OutputKind, TensorArgument
from torch.export.graph_signature import OutputSpec as SignatureOutput

from hfexport.passes.cache import mutated_argument
from hfexport.pipeline.artifacts import ArtifactKind, register_artifact_kind, snapshot_program
from hfexport.pipeline.capture import Captured
from hfexport.pipeline.graph_edit import GraphEditor, arguments, redirect_users, replace_node
from hfexport.pipeline.io_names import program_io_names, user_input_names
from hfexport.pipeline.pass_manager import own_weights
from hfexport.pipeline.patches import patches_applied, register_patch
from hfexport.targets.manifest import ComponentSpec, OutputSpec, captured_facts, program_inputs
from hfexport.versions import quiet_loggers, require_backend

ONNX_MODULES = ("onnx", "onnxscript", "onnxruntime")


def _quiet_torch_onnx() -> contextlib.AbstractContextManager[None]:
    # torch.onnx warns once per missing optional op library (torchvision) on every export.
    return quiet_loggers("torch.onnx._internal.exporter._registration")


def _input_name(path: str, written: bool) -> str:
    return f"input.{path}" if written else path


def onnx_component(program: torch.onnx.ONNXProgram, captured: Captured | None = None) -> ComponentSpec:
    """The manifest entry of an ONNX model: the names :func:`to_onnx` gives its graph inputs and
    outputs and what each output is, as its ``exported_program`` says, in the interface the
    ONNX passes gave it (ONNX Runtime GenAI's: see :func:`~.genai.genai_component`)."""
    from hfexport.targets.onnx.genai import INTERFACE, INTERFACE_KEY, genai_component

    spec = program_component(program.exported_program, captured)
    if program.model.metadata_props.get(INTERFACE_KEY) == INTERFACE:
        return genai_component(spec)
    return spec


def program_component(program: torch.export.ExportedProgram, captured: Captured | None = None) -> ComponentSpec:
    """The manifest entry of the ONNX model :func:`to_onnx` lowers ``program`` to."""
    inputs = program_inputs(program, captured, _input_name)
    signature = program.graph_signature
    path_of = user_input_names(program)
    written = {
        s.arg.name: path_of[s.target] for s in signature.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION
    }
    taken = {spec.name for spec in inputs}
    user_outputs = [s for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    outputs = []
    for spec, path in zip(user_outputs, program_io_names(program)[1], strict=True):
        if isinstance(spec.arg, ConstantArgument):
            continue  # a constant output (None in a model output's tuple) is not an ONNX graph output
        target = written.get(getattr(spec.arg, "name", None))
        if target is not None:
            outputs.append(OutputSpec(f"output.{target}", path, "write_back", target))
        else:
            kind = "tensor" if isinstance(spec.arg, TensorArgument) else "scalar"
            outputs.append(OutputSpec(f"present.{path}" if path in taken else path, path, kind))
    return ComponentSpec("", inputs, outputs, **captured_facts(captured))


def _missing_translations() -> dict[Any, Any]:
    """ONNX functions for ops torch.onnx has none for. ``aten._is_all_true`` comes from a model's
    ``torch._check((tensor).all())``-style checks (LLaVA's image-token count check) and is
    ``aten.all``."""
    from onnxscript.function_libs.torch_lib.ops.core import aten_all

    return {torch.ops.aten._is_all_true.default: aten_all}


@register_patch(
    "torch.onnx._internal.exporter._fx_passes:decompose_with_registry",
    name="onnx_functional_without_retrace",
    reason=(
        "torch.onnx.export decomposes every ExportedProgram with run_decompositions, which on "
        "torch.export's training IR traces the whole graph again (SmolLM2-135M: 11 of to_onnx's 17 s) "
        "to make the cache writes functional when every op already has an ONNX translation; "
        ":func:`translatable_program` does that on the graph, and torch.onnx's decomposition runs "
        "only for a program it does not hold for"
    ),
    upstream="https://github.com/pytorch/pytorch/pull/129249",
    scope="to_onnx",
)
def _functional_without_retrace(original: Any) -> Any:
    @functools.wraps(original)
    def decompose_with_registry(exported_program: Any, registry: Any) -> Any:
        functional = translatable_program(exported_program, registry)
        return functional if functional is not None else original(without_scalar_rsub(exported_program), registry)

    return decompose_with_registry


@register_patch(
    "torch.onnx._internal.exporter._fx_passes:insert_type_promotion_nodes",
    name="onnx_type_promotion_from_metadata",
    reason=(
        "torch.onnx's type promotion (torch/onnx/_internal/fx/passes/type_promotion.py) runs every node of "
        "the program again on fake tensors, with symbolic shapes, only to learn the dtypes each node's "
        "recorded value already holds (SmolLM2-135M's decode graph: 4.4 of to_onnx's 8.8 s). The same "
        "rules and the same rewrites run here, reading each node's recorded value; only a node the rules "
        "change (and a cast they insert) runs again"
    ),
    upstream="https://github.com/pytorch/pytorch/pull/104064",
    scope="to_onnx",
)
def _type_promotion_from_metadata(original: Any) -> Any:
    from torch.onnx._internal.fx.passes import type_promotion

    class RecordedValues(type_promotion._TypePromotionInterpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            recorded = node.meta.get("val")
            if node.op != "call_function" or recorded is None:
                return super().run_node(node)
            with self._set_current_node(node):
                rule = type_promotion.get_type_promotion_rule(node, self.type_promotion_table)
                if rule is not None:
                    self._maybe_promote_node(node, rule)  # a changed node runs again and records its value
            return node.meta["val"]

    class Promotion(type_promotion.InsertTypePromotion):
        def __init__(self, module: torch.fx.GraphModule) -> None:
            super().__init__(module)
            self.interpreter = RecordedValues(module, type_promotion.TypePromotionTable())

    @functools.wraps(original)
    def insert_type_promotion_nodes(graph_module: torch.fx.GraphModule) -> None:
        for module in graph_module.modules():
            Promotion(module).run()

    return insert_type_promotion_nodes


@register_patch(
    "torch.onnx._internal.exporter._core:_handle_output_node",
    name="onnx_constant_outputs_skipped",
    reason=(
        "torch.onnx leaves a None output out of the ONNX graph but fails on any other constant output "
        "(\"'int' object has no attribute 'name'\": MaskFormer-Swin returns its stages' feature-map sizes, "
        "fixed at export, as ints). Every constant output is left out, as onnx_component's manifest already "
        "lists none of them"
    ),
    upstream="https://github.com/pytorch/pytorch/blob/v2.13.0/torch/onnx/_internal/exporter/_core.py",
    scope="to_onnx",
)
def _constant_outputs_skipped(original: Any) -> Any:
    @functools.wraps(original)
    def handle_output_node(node: torch.fx.Node, *args: Any, **kwargs: Any) -> None:
        outputs = node.args[0]
        if isinstance(outputs, (list, tuple)) and any(not isinstance(o, torch.fx.Node) for o in outputs):
            kept = tuple(o if isinstance(o, torch.fx.Node) else None for o in outputs)
            node = SimpleNamespace(name=node.name, args=(kept,))
        return original(node, *args, **kwargs)

    return handle_output_node


def _onnx_op_tables(registry: Any) -> tuple[set[Any], set[Any]]:
    """(the ATen overloads ``registry`` translates, the ones torch.onnx's decomposition rewrites)."""
    from torch.onnx._internal.exporter import _decomp

    implemented = set(_decomp.get_onnx_implemented_overloads(registry))
    return implemented, set(_decomp.create_onnx_friendly_decomposition_table(implemented))


def _functional_variant(target: Any) -> Any:
    """``aten.scatter_.src`` → ``aten.scatter.src`` (None for an op with no such variant)."""
    name = target.overloadpacket.__name__
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _sizes_from_inputs(program: torch.export.ExportedProgram, user_inputs: set[str]) -> None:
    """Read every symbolic size off the first user input that has it, once. torch.export reads a
    size off whichever tensor the code asked (each layer's keys after its rotary embedding), and
    torch.onnx translates each such read as a ``Shape`` of that tensor and a ``Concat``, which the
    optimizer cannot merge across layers (SmolLM2-135M: 90 more nodes); torch.onnx's own retrace
    reads each size off the inputs."""
    aten = torch.ops.aten
    graph = program.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    where: dict[Any, tuple[torch.fx.Node, int]] = {}
    for node in placeholders:
        value = node.meta.get("val")
        if node.name in user_inputs and isinstance(value, torch.Tensor):
            for axis, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    where.setdefault(size.node.expr, (node, axis))
    if not where:
        return
    shared: dict[Any, torch.fx.Node] = {}
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if node.op != "call_function" or node.target is not aten.sym_size.int or not isinstance(value, torch.SymInt):
            continue
        expr = value.node.expr
        if expr not in where or node.args == where[expr]:
            continue
        if expr not in shared:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            shared[expr] = GraphEditor(graph, first).call(aten.sym_size.int, *where[expr])
        replace_node(program, node, shared[expr])


# Python's operators on tensors, which torch.onnx's decomposition rewrites to their named ops
_OPERATOR_OPS = {
    torch.ops.aten.__and__.Tensor: torch.ops.aten.bitwise_and.Tensor,
    torch.ops.aten.__or__.Tensor: torch.ops.aten.bitwise_or.Tensor,
    torch.ops.aten.__xor__.Tensor: torch.ops.aten.bitwise_xor.Tensor,
}


def _fresh_tensor(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a tensor of its own, computed in the graph (no view or alias of another)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and not target.is_view
        and all(result.alias_info is None for result in target._schema.returns)
    )


def _is_scalar_rsub(node: torch.fx.Node) -> bool:
    return node.target is torch.ops.aten.rsub.Scalar and len(node.args) == 2 and not node.kwargs


def _rsub_as_negated_add(program: torch.export.ExportedProgram, node: torch.fx.Node) -> None:
    """``rsub(x, c)`` (``c - x``, as ``1.0 - mask``) as ``x * -1 + c``: the same numbers, exactly.
    torch.onnx's decomposition makes ``aten.sub.Tensor(c, x)`` of it, which fails ("Expected a
    value of type 'int' for argument 'b'": XLNet, ProphetNet)."""
    editor = GraphEditor(program.graph, node)
    negated = editor.call(torch.ops.aten.mul.Tensor, node.args[0], -1)
    replace_node(program, node, editor.call(torch.ops.aten.add.Tensor, negated, node.args[1]))


def without_scalar_rsub(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program``, or a copy of it with every ``rsub`` of a scalar as :func:`_rsub_as_negated_add` makes it."""
    if not any(_is_scalar_rsub(node) for node in program.graph.nodes):
        return program
    program = snapshot_program(program)
    for node in list(program.graph.nodes):
        if _is_scalar_rsub(node):
            _rsub_as_negated_add(program, node)
    program.graph_module.recompile()
    return program


def translatable_program(program: torch.export.ExportedProgram, registry: Any) -> torch.export.ExportedProgram | None:
    """A functional copy of ``program`` that torch.onnx can translate as it is with ``registry``
    (its ``ONNXRegistry``), or None.

    torch.export's program writes a static cache with in-place ops on its user inputs
    (``scatter_``, ``add_``); torch.onnx functionalises them by tracing the whole program again.
    Here each in-place write of a user input becomes its functional op, the input's later readers
    read the result, and the signature gains the input-mutation output torch's functionalisation
    would add; an in-place write of a tensor the graph computed (a prefill's fresh cache) becomes
    its functional op too; ``aten.to`` becomes ``_to_copy`` and ``__and__`` ``bitwise_and``.

    None (the caller lets torch.onnx decompose) when anything else needs it: an op torch.onnx has
    no translation for or decomposes, an in-place write of a buffer or of a view, a write to a
    tensor a view was taken of first, or a higher-order op."""
    aten = torch.ops.aten
    implemented, decomposed = _onnx_op_tables(registry)

    def translated(target: Any) -> bool:
        return target in implemented and target not in decomposed

    from torch._export.verifier import SpecViolationError

    graph_module = copy.deepcopy(program.graph_module)
    try:
        functional = torch.export.ExportedProgram(
            root=graph_module,
            graph=graph_module.graph,
            graph_signature=program.graph_signature,
            state_dict=program.state_dict,
            range_constraints=program.range_constraints,
            module_call_graph=copy.deepcopy(program.module_call_graph),
            example_inputs=program.example_inputs,
            constants=program.constants,
            verifiers=program.verifiers,
        )
    except SpecViolationError:  # a user pass left the signature out of step with the graph
        return None
    graph = functional.graph
    user_inputs = set(functional.graph_signature.user_inputs)
    _sizes_from_inputs(functional, user_inputs)
    order = {node: index for index, node in enumerate(graph.nodes)}
    latest: dict[str, torch.fx.Node] = {}  # a written user input's name -> the node holding its newest value
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            if target is operator.getitem or getattr(target, "__module__", None) == "_operator":
                continue  # tuple items and symbolic size arithmetic
            return None
        if target in (aten.to.dtype, aten.to.device, aten.to.dtype_layout) and translated(aten._to_copy.default):
            if arguments(node).get("memory_format") not in (None, torch.preserve_format):
                return None
            dtype = node.meta["val"].dtype  # the device is not an ONNX graph's business
            copied = GraphEditor(graph, node).call(aten._to_copy.default, node.args[0], dtype=dtype)
            replace_node(functional, node, copied)
            continue
        if target in _OPERATOR_OPS and translated(_OPERATOR_OPS[target]):
            replace_node(functional, node, GraphEditor(graph, node).call(_OPERATOR_OPS[target], *node.args))
            continue
        if _is_scalar_rsub(node):
            _rsub_as_negated_add(functional, node)
            continue
        if not target._schema.is_mutable:
            if not translated(target):
                return None
            continue
        written, variant = mutated_argument(node), _functional_variant(target)
        if written is None or variant is None or not translated(variant):
            return None
        name = next((n for n, value in latest.items() if value is written), None)
        if written.op == "placeholder" and written.name in user_inputs:
            name = written.name
        elif name is None and not _fresh_tensor(written):
            return None  # a buffer, or a view whose write would reach its base
        if any(
            isinstance(user.target, torch._ops.OpOverload) and user.target.is_view
            for user in written.users
            if order.get(user, len(order)) < order[node]
        ):
            return None
        rewritten = GraphEditor(graph, node).call(variant, *node.args, **node.kwargs)
        later = {user for user in written.users if user is not node and order.get(user, -1) > order[node]}
        redirect_users(functional, written, rewritten, later)
        replace_node(functional, node, rewritten)
        if name is not None:
            latest[name] = rewritten
    if latest:
        output = graph.output_node()
        output.args = ((*latest.values(), *output.args[0]),)
        mutations = [
            SignatureOutput(OutputKind.USER_INPUT_MUTATION, TensorArgument(value.name), name)
            for name, value in latest.items()
        ]
        signature = functional.graph_signature
        functional._graph_signature = ExportGraphSignature(
            signature.input_specs, mutations + list(signature.output_specs)
        )
    functional.graph_module.recompile()
    return functional


def to_onnx(
    program: torch.export.ExportedProgram,
    opset_version: int | None = None,
    attention_windows: dict[str, int] | None = None,
) -> torch.onnx.ONNXProgram:
    """Translate an ``ExportedProgram`` to ONNX with torch.onnx (translation only: the optimizer
    runs as the ``onnx_optimizer`` pass), its inputs and outputs named as :func:`onnx_component` says.
    The initializers are the program's own copy of the weights, not the model's tensors. A program
    :func:`translatable_program` makes functional skips torch.onnx's decomposition (a second trace);
    the ONNX program's ``exported_program`` is that functional copy. torch.onnx's type promotion reads
    each node's recorded value instead of running the program again on fake tensors (the
    ``onnx_type_promotion_from_metadata`` patch). ``attention_windows`` (the capture's: each
    windowed layer type's window) go in the model's metadata, for the passes that build masks. A
    weight the model stores narrower than it computes is cast when the file is written
    (:func:`~hfexport.targets.onnx.initializers.stored_weights_made_when_written`)."""
    require_backend("onnx", ONNX_MODULES)
    from hfexport.targets.onnx.initializers import stored_weights_made_when_written

    program = own_weights(program)
    # flags and None leaves are not ONNX inputs
    fed = [i.path for i in program_inputs(program, None) if i.constant is None and not i.none]
    with (
        _quiet_torch_onnx(),
        patches_applied(
            ["onnx_functional_without_retrace", "onnx_type_promotion_from_metadata", "onnx_constant_outputs_skipped"],
            scope=None,
        ),
    ):
        onnx_program = torch.onnx.export(
            program,
            (),
            dynamo=True,
            optimize=False,
            opset_version=opset_version,
            input_names=fed,
            output_names=[o.path for o in program_component(program).outputs],
            custom_translation_table=_missing_translations(),
            verbose=False,
        )
    written = onnx_program.model.opset_imports.get("")
    if opset_version is not None and written != opset_version:
        from hfexport.errors import StageError

        # onnxscript's version converter logs a failure and returns the model unconverted
        raise StageError(f"torch.onnx could not convert the model to opset {opset_version} (it has opset {written})")
    # which inputs are written in place is read off the functionalised program torch.onnx translated
    spec = program_component(onnx_program.exported_program)
    graph = onnx_program.model.graph
    names = [i.name for i in spec.inputs if i.constant is None and not i.none]
    if len(graph.inputs) != len(names):
        from hfexport.errors import StageError

        raise StageError(
            f"torch.onnx produced {len(graph.inputs)} graph inputs for the program's {len(names)} inputs "
            f"({', '.join(names)}); cannot name them"
        )
    for value, name in zip(graph.inputs, names, strict=True):
        value.name = name
    _name_outputs(onnx_program, [o.name for o in spec.outputs])
    stored_weights_made_when_written(graph)
    if attention_windows:
        from hfexport.targets.onnx.genai import WINDOWS_KEY

        onnx_program.model.metadata_props[WINDOWS_KEY] = json.dumps(attention_windows)
    return onnx_program


def _name_outputs(onnx_program: torch.onnx.ONNXProgram, names: list[str]) -> None:
    """Give every graph output its own value and name. torch.onnx names outputs by renaming their
    values, so one value returned twice (two cache layers' token counters are the same symbol)
    keeps only the last name, and an input returned as an output would be renamed; each such
    output gets an Identity of its own."""
    import onnx_ir as ir

    from hfexport.errors import StageError

    graph = onnx_program.model.graph
    outputs = list(graph.outputs)
    if len(outputs) != len(names):
        raise StageError(
            f"torch.onnx produced {len(outputs)} graph outputs for the program's {len(names)} outputs "
            f"({', '.join(names)}); cannot name them"
        )
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


# torch.onnx's own threshold: above it the weights go to external data next to the file, below the
# 2 GB a protobuf message may hold
_ONE_FILE_BYTES = 1536 * 2**20


def save_onnx(program: torch.onnx.ONNXProgram, path: Path) -> None:
    """Save ``path`` as one file, a weight at a time (weights over 1.5 GB go to external data next
    to it, as torch.onnx does).

    ``program.save`` builds the whole ``ModelProto`` and then its serialized bytes, two copies of
    every weight at once: SmolLM2-135M's export peaked at 3.3 GB in the save, against 1.8 GB for
    every stage before it. Here the model is serialized without its top graph's initializers, then
    each initializer is appended as a ``ModelProto`` of its own holding just that initializer:
    protobuf parses concatenated messages as one, merged (repeated fields appended), so the file
    reads (``onnx.load``, ONNX Runtime) as the same model, and only one weight is copied at a time."""
    import onnx
    import onnx_ir as ir

    from hfexport.precision import buffers_reused

    graph = program.model.graph
    initializers = dict(graph.initializers)
    if sum(v.const_value.nbytes for v in initializers.values() if v.const_value is not None) > _ONE_FILE_BYTES:
        with buffers_reused():
            program.save(str(path))
        return
    graph.initializers.clear()  # restored below, as torch.onnx's own save does to leave them out
    try:
        head = ir.serde.serialize_model(program.model).SerializeToString()
    finally:
        graph.initializers.update(initializers)
    with open(path, "wb") as file:
        file.write(head)
        for value in initializers.values():
            if value.const_value is None:
                continue
            chunk = onnx.ModelProto()
            value.const_value.name = value.name
            ir.serde.serialize_tensor_into(chunk.graph.initializer.add(), from_=value.const_value)
            file.write(chunk.SerializeToString())


def load_onnx(path: str | Path) -> torch.onnx.ONNXProgram:
    """Read an ``.onnx`` file (:func:`save_onnx`'s, with its external data beside it) back as the
    ``torch.onnx.ONNXProgram`` the ONNX-level passes take, with no ``exported_program`` (a pass
    that runs it needs none). An ONNX file is protobuf data: reading it runs no code from it.
    :class:`~hfexport.ArtifactError` when it is missing or not an ONNX model."""
    import onnx_ir as ir
    from google.protobuf.message import DecodeError

    from hfexport.errors import ArtifactError

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist or is not a file; give the .onnx written by the export")
    try:
        model = ir.load(path)
    except (DecodeError, ValueError, OSError) as error:
        raise ArtifactError(
            f"{path} is not a readable ONNX model ({type(error).__name__}: {error}); it may be truncated or from "
            "another program: export again"
        ) from error
    if not model.graph.outputs:
        raise ArtifactError(f"{path} holds no ONNX graph (an empty file, or not a model): export again")
    return torch.onnx.ONNXProgram(model, None)


def snapshot_onnx(program: torch.onnx.ONNXProgram) -> torch.onnx.ONNXProgram:
    import onnx_ir as ir

    model = ir.serde.deserialize_model(ir.serde.serialize_model(program.model))
    return torch.onnx.ONNXProgram(model, program.exported_program)


def run_onnx_program(program: torch.onnx.ONNXProgram, inputs: dict[str, Any]) -> list[Any] | dict[str, Any]:
    """Save to a temporary file and run it in a real ONNX Runtime session; the tensor outputs,
    in order (by path for a graph in ONNX Runtime GenAI's interface, fed the sample as
    :func:`~.genai.genai_feed` makes it)."""
    from hfexport.targets.onnx.genai import INTERFACE, INTERFACE_KEY, genai_feed
    from hfexport.targets.onnx.runner import OnnxRunner

    spec = onnx_component(program)
    genai = program.model.metadata_props.get(INTERFACE_KEY) == INTERFACE
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.onnx"
        save_onnx(program, path)
        if not genai:
            return OnnxRunner(path, spec).run(inputs, tensors_only=True)
        outputs = OnnxRunner(path, spec).run(genai_feed(inputs), tensors_only=True)
    # by path, as eager returns them; None for the token counters, which ORT GenAI's interface derives
    tensors = [torch.from_numpy(np.asarray(output)) for output in outputs]
    returned = dict(zip([o.path for o in spec.returned if o.kind != "scalar"], tensors, strict=True))
    original = program_component(program.exported_program).returned
    return {o.path: returned.get(o.path) for o in original if o.kind != "scalar"}


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
