"""What the instruments need to know about a program of each kind: its text, its op histogram,
how to save it, and how to run it. Each target registers the program types of its stages here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ArtifactKind:
    """How to inspect, save and run one program type."""

    suffix: str  # file suffix at stage boundaries, e.g. ".pt2"
    text: Callable[[Any], str]
    histogram: Callable[[Any], Counter]
    save: Callable[[Any, Path], None] | None  # None: nothing to save at this step (graph text only)
    # run(program, inputs) -> flat list of output tensors, in torch.export's output order; None:
    # this kind of program cannot be run on its own (numerics are checked at the next stage)
    run: Callable[[Any, dict[str, Any]], list[torch.Tensor]] | None
    # a copy a failing pass cannot have half-rewritten (dumped as the pass's reproducer input)
    snapshot: Callable[[Any], Any]
    # dumps save the artifact after every pass too, not only at stage boundaries
    save_each_pass: bool = False
    # False: saved only as a failing pass's input (its reproducer), not at every stage boundary
    save_at_stages: bool = True


_KINDS: dict[type, ArtifactKind] = {}


def register_artifact_kind(program_type: type, kind: ArtifactKind) -> None:
    _KINDS[program_type] = kind


def artifact_kind(program: Any) -> ArtifactKind:
    for cls in type(program).__mro__:
        if cls in _KINDS:
            return _KINDS[cls]
    raise TypeError(f"no artifact kind registered for {type(program).__name__}")


def node_count(histogram: Counter) -> int:
    return sum(histogram.values())


# --- torch.export ExportedProgram ----------------------------------------------------------------


def graph_histogram(graph: torch.fx.Graph) -> Counter:
    """Op histogram of an FX graph: call targets, plus placeholder / output / get_attr counts."""
    return Counter(str(node.target) if node.op == "call_function" else node.op for node in graph.nodes)


def _ep_histogram(program: torch.export.ExportedProgram) -> Counter:
    return graph_histogram(program.graph)


def _ep_save(program: torch.export.ExportedProgram, path: Path) -> None:
    torch.export.save(program, path)


def _ep_run(program: torch.export.ExportedProgram, inputs: dict[str, Any]) -> list[torch.Tensor]:
    from hfexport.pipeline.inputs import copy_inputs

    with torch.no_grad():
        outputs = program.module()(**copy_inputs(inputs))
    return outputs_in_program_order(program.call_spec.out_spec, outputs)


def snapshot_program(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A copy of the program with its own graph and signature; the weights are shared."""
    import copy
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own LeafSpec deprecation on copy
        graph_module = copy.deepcopy(program.graph_module)
        # the copy renames nodes named after builtins (nn.Linear's `input` becomes `input_1`), which
        # the signature still names: keep the original names
        for original, copied in zip(program.graph.nodes, graph_module.graph.nodes, strict=True):
            copied.name = original.name
        graph_module.recompile()
        return program._update(graph_module, copy.deepcopy(program.graph_signature))


def flat_tensors(outputs: Any) -> list[torch.Tensor]:
    """The tensor leaves of a (pytree) output, in flattening order."""
    return [leaf for leaf in torch.utils._pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]


def outputs_in_program_order(out_spec: Any, outputs: Any) -> list[torch.Tensor]:
    """The tensor leaves of what ``program.module()`` returned, in the program's own output order
    (``out_spec`` is the program's ``call_spec.out_spec``; see
    :func:`~hfexport.pipeline.io_names.leaves_in_spec_order` for why flattening is not enough)."""
    from hfexport.pipeline.io_names import leaves_in_spec_order

    if out_spec is None:
        return flat_tensors(outputs)
    return [leaf for _, leaf in leaves_in_spec_order(out_spec, outputs) if isinstance(leaf, torch.Tensor)]


def named_tensors(outputs: Any) -> dict[str, torch.Tensor]:
    """The tensor leaves of a (pytree) output by path (``logits``, ``cache.layers.0.keys``)."""
    from hfexport.pipeline.io_names import path_name

    leaves = torch.utils._pytree.tree_flatten_with_path(outputs)[0]
    return {path_name(path): leaf for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


register_artifact_kind(
    torch.export.ExportedProgram,
    ArtifactKind(
        suffix=".pt2", text=str, histogram=_ep_histogram, save=_ep_save, run=_ep_run, snapshot=snapshot_program
    ),
)
