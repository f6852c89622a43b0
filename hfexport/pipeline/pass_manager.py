"""Passes, the pass registry, ordering constraints, and the PassManager that runs a pass list."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch

from hfexport.errors import ConfigError, PassError, PassOrderError
from hfexport.pipeline.graph_edit import synced_output_specs


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) program, whether it changed, named counts (e.g.
    ``{"rewritten": 3}``) and optional text files for its dump folder."""

    program: Any
    modified: bool
    counts: dict[str, int] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # written into the pass's dump folder


class Pass:
    """A named program → program rewrite.

    Subclasses set ``name`` (the registry key used in configs, dumps, the CLI and errors), a
    one-line ``description``, optionally ``stage`` (the pipeline stage it belongs to, e.g.
    ``"fx_passes"`` or ``"onnx_passes"``) and the ordering constraints ``runs_after`` /
    ``runs_before`` (names of passes that, when present in the same list, must run before / after
    this one), optionally ``remove_when`` (one line for the pass catalogue: when to leave it out
    of a list, and what happens without it), and implement ``__call__``.

    A pass on an ``ExportedProgram`` rewrites ``program.graph_module`` in place or returns a new
    program; either way it must keep the graph signature valid (same user inputs, same number of
    outputs; weights may be replaced), so no pass ever forces a re-export.
    """

    name: str = ""
    description: str = ""
    stage: str = "fx_passes"
    runs_after: tuple[str, ...] = ()
    runs_before: tuple[str, ...] = ()
    remove_when: str = ""

    def __call__(self, program: Any) -> PassResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class FunctionPass(Pass):
    """A pass made from a function ``fn(program) -> PassResult`` (see :func:`register_pass`)."""

    def __init__(
        self,
        fn: Callable[[Any], PassResult],
        name: str,
        *,
        description: str = "",
        stage: str = "fx_passes",
        runs_after: Iterable[str] = (),
        runs_before: Iterable[str] = (),
        remove_when: str = "",
    ) -> None:
        self.fn = fn
        self.remove_when = remove_when
        self.name = name
        self.description = description or " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
        self.stage = stage
        self.runs_after = tuple(runs_after)
        self.runs_before = tuple(runs_before)

    def __call__(self, program: Any) -> PassResult:
        return self.fn(program)


_REGISTRY: dict[str, Pass] = {}


def register_pass(
    obj: Any = None,
    *,
    name: str | None = None,
    stage: str = "fx_passes",
    runs_after: Iterable[str] = (),
    runs_before: Iterable[str] = (),
    remove_when: str = "",
) -> Any:
    """Register a pass under its name. Use on a :class:`Pass` instance or subclass, or as a
    decorator on a function ``fn(program) -> PassResult`` (``@register_pass`` or
    ``@register_pass(name=..., runs_after=[...])``). Returns the registered object."""

    def register(target: Any) -> Any:
        if isinstance(target, Pass):
            instance = target
        elif isinstance(target, type) and issubclass(target, Pass):
            instance = target()
        else:
            instance = FunctionPass(
                target,
                name or target.__name__,
                stage=stage,
                runs_after=runs_after,
                runs_before=runs_before,
                remove_when=remove_when,
            )
        if not instance.name:
            raise ConfigError(f"pass {target!r} has no name")
        existing = _REGISTRY.get(instance.name)
        if (
            existing is not None
            and _is_builtin(existing)
            and _implementation(existing) is not _implementation(instance)
        ):
            raise ConfigError(
                f"pass name {instance.name!r} is taken by hfexport's own pass; register yours under another name "
                "(a pass list can then use it in place of the built-in)"
            )
        _REGISTRY[instance.name] = instance
        return target if isinstance(target, type) else instance

    return register if obj is None else register(obj)


def _implementation(pass_: Pass) -> Any:
    return getattr(pass_, "fn", type(pass_))


def _is_builtin(pass_: Pass) -> bool:
    return getattr(_implementation(pass_), "__module__", "").startswith("hfexport.")


def defining_file(name: str) -> str | None:
    """The source file of the registered pass ``name`` when it is not hfexport's own (``None`` for
    a built-in or an unknown name): what ``hfexport replay --import`` must load to find it."""

    pass_ = _REGISTRY.get(name)
    if pass_ is None or _is_builtin(pass_):
        return None
    try:
        return inspect.getsourcefile(inspect.unwrap(_implementation(pass_)))
    except TypeError:
        return None


def get_pass(name: str, *, missing_ok: bool = False) -> Pass | None:
    """The registered pass called ``name``; unknown names raise :class:`ConfigError` listing the
    registered ones."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if missing_ok:
        return None
    raise ConfigError(f"unknown pass {name!r}; registered passes: {', '.join(sorted(_REGISTRY))}")


def registered_passes() -> dict[str, Pass]:
    """All registered passes by name (the built-in ones are registered by ``import hfexport``)."""
    return dict(sorted(_REGISTRY.items()))


def split_pass_list(items: str | Iterable[str | Pass]) -> list[str | Pass]:
    """A pass list as a list: a comma-separated string of names is split."""
    if isinstance(items, str):
        return [name.strip() for name in items.split(",") if name.strip()]
    return list(items)


def resolve_passes(items: str | Iterable[str | Pass]) -> list[Pass]:
    """Turn a pass list (names, pass objects, or a comma-separated string) into pass objects."""
    resolved = []
    items = split_pass_list(items)
    for item in items:
        if isinstance(item, str):
            resolved.append(get_pass(item))
        elif isinstance(item, Pass):
            resolved.append(item)
        else:
            raise ConfigError(f"{item!r} is not a pass name or a Pass object")
    return resolved


def check_order(passes: Sequence[Pass]) -> None:
    """Raise :class:`PassOrderError` if ``passes`` breaks a declared ordering constraint.

    The constraints among the passes present form a directed graph (edge a → b: a must run before
    b); a cycle is an error, and so is any edge that points backwards in the list. The list is
    never reordered. A pass listed twice is an error too: its constraints could hold for one
    occurrence only.
    """
    names = [p.name for p in passes]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise PassOrderError(
            f"pass(es) {', '.join(twice)} listed more than once ({', '.join(names)}); list each pass once"
        )
    position = {p.name: i for i, p in enumerate(passes)}
    graph = nx.DiGraph()
    graph.add_nodes_from(position)
    for p in passes:
        graph.add_edges_from((before, p.name) for before in p.runs_after if before in position)
        graph.add_edges_from((p.name, after) for after in p.runs_before if after in position)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        names = " -> ".join([a for a, _ in cycle] + [cycle[0][0]])
        raise PassOrderError(f"pass ordering constraints form a cycle: {names}")
    for before, after in graph.edges:
        if position[before] > position[after]:
            raise PassOrderError(
                f"pass {before!r} must run before pass {after!r}, but the list has it after; "
                f"move {before!r} earlier (list: {', '.join(position)})"
            )


def signature_of(program: Any) -> tuple[list[str], Any] | None:
    """What the caller feeds a program and gets back: the user input names and the output count
    of an ``ExportedProgram``, the input and output names of an ONNX program (its runner binds
    by name); ``None`` for other program types. Weights may change (a quantization pass replaces
    them); the signature may not."""
    exported = getattr(program, "exported_program", None)
    if inspect.ismethod(exported):  # a manager of exported programs (ExecuTorch's edge program)
        program = exported()
    graph = getattr(program, "graph", None)
    if graph is not None and hasattr(program, "graph_signature"):
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        return list(program.graph_signature.user_inputs), len(output.args[0])
    onnx_graph = getattr(getattr(program, "model", None), "graph", None)
    if onnx_graph is not None and hasattr(onnx_graph, "inputs") and hasattr(onnx_graph, "outputs"):
        return [v.name for v in onnx_graph.inputs], [v.name for v in onnx_graph.outputs]
    return None


OWNS_WEIGHTS_KEY = "hfexport.owns_weights"
# tensors no one but hfexport holds, by id: a model hfexport converted to another dtype, or loaded for
# the command line. A program made from them needs no copy of its own: the copy doubled the peak
# memory of an export (a Llama-3.2-1B-shaped bfloat16 checkpoint to ONNX: 13.8 GB, its fp32 weights 4.9)
_PRIVATE_WEIGHTS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def private_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Record that no one but hfexport holds ``model``'s parameters and buffers (a copy it made, a
    model it loaded and does not hand out), so :func:`own_weights` leaves them shared; ``model``."""
    for tensor in [*model.parameters(), *model.buffers()]:
        _PRIVATE_WEIGHTS[id(tensor)] = tensor
    return model


# the parameters the export running in this context may free once its program drops them (see
# disposable_weights), and what keeps them anyway: predicates on the run's capture
_DISPOSABLE: contextvars.ContextVar[tuple[list[torch.Tensor], tuple[Callable[[Any], bool], ...]] | None] = (
    contextvars.ContextVar("hfexport_disposable_weights", default=None)
)


@contextlib.contextmanager
def disposable_weights(model: torch.nn.Module) -> Iterator[None]:
    """Say that nothing reads ``model``'s weights once the export run in this block has captured
    it (the command line says so of the model it loaded), so each pass stage
    frees every private parameter of it (:func:`private_weights`) the program no longer holds:
    the fp32 weights a quantization pass replaced (a Llama-3.2-3B-shaped 8da4w export held 12 GB
    of them to the end). Narrowed by :func:`weights_kept_if`."""
    params = [p for p in model.parameters() if _PRIVATE_WEIGHTS.get(id(p)) is p]
    token = _DISPOSABLE.set((params, ()))
    try:
        yield
    finally:
        _DISPOSABLE.reset(token)


@contextlib.contextmanager
def weights_kept_if(keep: Callable[[Any], bool]) -> Iterator[None]:
    """Within a :func:`disposable_weights` block, a run whose capture ``keep(captured)`` holds for
    frees nothing (its caller exports from the model again); outside one, nothing changes."""
    outer = _DISPOSABLE.get()
    token = _DISPOSABLE.set(None if outer is None else (outer[0], (*outer[1], keep)))
    try:
        yield
    finally:
        _DISPOSABLE.reset(token)


def release_dropped_weights(program: Any, captured: Any) -> int:
    """Free the storage of each disposable parameter (:func:`disposable_weights`) that ``program``
    (an ``ExportedProgram``) no longer holds, sharing no storage with what it holds; the bytes freed."""
    found = _DISPOSABLE.get()
    if found is None or not isinstance(program, torch.export.ExportedProgram):
        return 0
    params, keeps = found
    if any(keep(captured) for keep in keeps):
        return 0
    held = {
        value.untyped_storage().data_ptr()
        for table in (program.state_dict, program.constants)
        for value in table.values()
        if isinstance(value, torch.Tensor)
    }
    freed = 0
    for param in params:
        storage = param.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in held:
            freed += storage.nbytes()
            # the parameter lets go of its storage (one loaded from safetensors is a file mapping,
            # which cannot be resized); a read of it afterwards fails on its empty shape
            param.data = param.data.new_empty(0)
    return freed


def own_weights(program: Any, everything: bool = False) -> Any:
    """Give an ``ExportedProgram`` its own copy of its weights (``state_dict`` and tensor
    constants), once, and return it. torch.export's program holds the model's own parameters, so
    a pass that edits one in place would change the user's model, and editing the model after
    the export would change the program (and the ONNX initializers made from it). Weights
    :func:`private_weights` recorded stay shared, unless ``everything`` (a pass that is not
    hfexport's own may edit them, and the model is the reference a verified export is checked against)."""
    meta = getattr(getattr(program, "graph_module", None), "meta", None)
    owned = meta.get(OWNS_WEIGHTS_KEY) if meta is not None else None
    if meta is None or owned == "all" or (owned and not everything) or not hasattr(program, "state_dict"):
        return program
    for table in (program.state_dict, program.constants):
        for name, value in list(table.items()):
            if not isinstance(value, torch.Tensor) or (not everything and _PRIVATE_WEIGHTS.get(id(value)) is value):
                continue
            copied = value.detach().clone()
            if isinstance(value, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=value.requires_grad)
            table[name] = copied
    meta[OWNS_WEIGHTS_KEY] = "all" if everything else "shared"
    return program


def execute_pass(pass_: Pass, program: Any, before: Sequence[str] = ()) -> PassResult:
    """Run one pass with the checks every run gets, in a pipeline or in ``hfexport replay``: it must
    return a :class:`PassResult` holding a program of the type it was given, with the same
    user inputs and number of outputs. Any failure is a :class:`PassError` naming the pass and the
    passes that ran ``before`` it. Before the first pass that is not hfexport's own, the program
    gets its own copy of the weights (:func:`own_weights`): hfexport's passes replace weights, and
    never edit the model's in place; a user pass might."""
    signature = signature_of(program)
    if not _is_builtin(pass_):
        own_weights(program, everything=True)
    try:
        result = pass_(program)
        if not isinstance(result, PassResult):
            raise TypeError(f"returned {type(result).__name__}, expected a PassResult")
        if not isinstance(result.program, type(program)):
            raise TypeError(
                f"returned a PassResult whose program is a {type(result.program).__name__}, expected "
                f"{type(program).__name__} (a pass rewrites a program; changing its type is a stage's job)"
            )
        after = signature_of(result.program)
        if signature is not None and after is not None and after != signature:
            raise TypeError(
                f"changed the program signature (user inputs {signature[0]} -> {after[0]}, outputs "
                f"{signature[1]} -> {after[1]}); a pass must keep inputs and outputs intact"
            )
    except Exception as error:
        raise PassError.of(pass_.name, before, error) from error
    return result


class PassManager:
    """An ordered, editable list of passes. ``passes`` is a plain list of :class:`Pass` objects;
    :meth:`insert`, :meth:`remove` and :meth:`replace` accept names."""

    def __init__(self, passes: str | Iterable[str | Pass] = ()) -> None:
        self.passes: list[Pass] = resolve_passes(passes)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __str__(self) -> str:
        return ",".join(self.names)

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ConfigError(f"pass {name!r} is not in the list ({self})") from None

    def insert(self, index: int | str, item: str | Pass, *, after: bool = False) -> None:
        """Insert ``item`` at ``index``, or before (``after=True``: after) the pass named ``index``."""
        position = self.index(index) + int(after) if isinstance(index, str) else index
        self.passes.insert(position, resolve_passes([item])[0])

    def remove(self, name: str) -> None:
        del self.passes[self.index(name)]

    def replace(self, name: str, item: str | Pass) -> None:
        self.passes[self.index(name)] = resolve_passes([item])[0]

    def check(self) -> None:
        check_order(self.passes)

    def run(self, program: Any, applied: Sequence[str] = (), log: Callable[[str], None] | None = None) -> Any:
        """Run the passes on ``program`` outside a pipeline (``hfexport replay``), through the same
        :func:`execute_pass` as a pipeline run. ``applied`` names the passes that already ran on
        ``program`` (a dumped pass input), so an error names the same passes before it."""
        self.check()
        done = list(applied)
        for pass_ in self.passes:
            result = execute_pass(pass_, program, done)
            program = result.program
            done.append(pass_.name)
            if log:
                log(f"{pass_.name}: modified={result.modified} {result.counts}")
        return program


def graph_pass(
    name: str | None = None,
    *,
    runs_after: Iterable[str] = (),
    runs_before: Iterable[str] = (),
    remove_when: str = "",
) -> Callable[[Callable[[Any], int]], Pass]:
    """Register ``fn(graph_module) -> int`` as an in-place pass over an ``ExportedProgram``'s graph.

    ``fn`` rewrites ``program.graph_module`` and returns how many matches it rewrote; the pass
    lints and recompiles the graph, names in the signature the outputs the graph now returns
    (:func:`~hfexport.pipeline.graph_edit.synced_output_specs`) and reports ``{"rewritten": n}``.
    """

    def wrap(fn: Callable[[Any], int]) -> Pass:
        def run(program: Any) -> PassResult:
            graph_module = program.graph_module
            rewritten = fn(graph_module)
            if rewritten:
                graph_module.graph.lint()
                graph_module.recompile()
                if hasattr(program, "graph_signature"):
                    synced_output_specs(program)
            return PassResult(program, modified=bool(rewritten), counts={"rewritten": rewritten})

        functools.update_wrapper(run, fn)  # its module and source are fn's (a user pass stays the user's)
        return register_pass(
            run, name=name or fn.__name__, runs_after=runs_after, runs_before=runs_before, remove_when=remove_when
        )

    return wrap
