"""The Dynamo target: the ``ExportedProgram`` itself, saved as ``.pt2``; no lowering stages."""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from hfexport.errors import ArtifactError, HfExportError
from hfexport.generation import StaticCacheDecoder
from hfexport.passes import CLEANUP_PASSES
from hfexport.pipeline.artifacts import outputs_in_program_order
from hfexport.pipeline.capture import Captured
from hfexport.pipeline.inputs import copy_inputs
from hfexport.targets import Target
from hfexport.targets.manifest import (
    ComponentSpec,
    Manifest,
    OutputSpec,
    captured_facts,
    program_inputs,
    program_outputs,
)
from hfexport.targets.runner import Runner, flat_inputs
from hfexport.targets.untrusted import refused, weights_only_loads
from hfexport.versions import quiet_loggers


def load_exported_program(path: str | Path, trust: bool = False) -> torch.export.ExportedProgram:
    """``torch.export.load`` after registering what a transformers program's inputs and outputs
    are made of (``ModelOutput`` classes and the cache classes), so it works in a fresh process.

    Nothing in the file is unpickled beyond tensors and plain containers (what hfexport writes):
    ``torch.export.load`` falls back to full unpickling, which runs any code the file holds, when
    that fails, and hfexport refuses instead with :class:`~hfexport.ArtifactError`. Pass
    ``trust=True`` only for a file from a source you trust."""
    from hfexport.models.caches import register_cache_pytrees

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist or is not a file; give the .pt2 written by the export")
    if not zipfile.is_zipfile(path):
        raise ArtifactError(
            f"{path} is not a readable torch.export archive (not a zip file); it may be truncated or from "
            "another program: export again"
        )
    _import_modeling_modules(path)
    register_cache_pytrees()
    # torch.export logs a traceback before it falls back to its legacy format, and its warning about
    # the unpickling fallback has one argument for two %s (torch/_export/serde/serialize.py)
    loggers = quiet_loggers("torch.export", "torch._export.serde.serialize")
    try:
        with weights_only_loads(trust), loggers:
            return torch.export.load(path)
    except pickle.UnpicklingError as error:
        raise refused(path, error) from error
    except (zipfile.BadZipFile, EOFError, RuntimeError, KeyError, ValueError) as error:
        raise ArtifactError(
            f"{path} is not a readable torch.export archive ({type(error).__name__}: {str(error)[:200]}); "
            "it may be truncated or from another program: export again"
        ) from error


_MODELING_MODULE = re.compile(rb"transformers\.models\.[a-z0-9_]+\.modeling_[a-z0-9_]+")


def _import_modeling_modules(path: Path) -> None:
    """Import the transformers modeling modules the archive's input and output specs name: a
    model's own output class (``MambaCausalLMOutput``) is registered as a pytree node when its
    module is imported, and a fresh process had not (the load failed: "Deserializing ... in pytree
    is not registered"). Only installed transformers modules are imported, by a strict pattern."""
    import importlib

    names: set[str] = set()
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if member.endswith(".json"):
                names.update(m.decode() for m in _MODELING_MODULE.findall(archive.read(member)))
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # another transformers version: the load names what is missing


def program_component(program: torch.export.ExportedProgram, captured: Captured | None) -> ComponentSpec:
    """The manifest entry of an ``ExportedProgram``: inputs and outputs named by keyword path
    (``module()`` returns user outputs only; in-place writes land in the caller's inputs)."""
    outputs = [OutputSpec(path, path, kind) for path, kind, _ in program_outputs(program) if kind != "write_back"]
    return ComponentSpec("", program_inputs(program, captured), outputs, **captured_facts(captured))


class DynamoRunner(Runner):
    """Runs a saved ``.pt2`` with ``module()``, inputs checked by name against the manifest."""

    def __init__(self, program: torch.export.ExportedProgram, spec: ComponentSpec) -> None:
        super().__init__(spec)
        self.program = program
        self.module = program.module()
        self.unguarded: torch.nn.Module | None = None  # program.module(check_guards=False), made when needed
        self.out_spec = program.call_spec.out_spec
        self.example_kwargs = program.example_inputs[1] if program.example_inputs else {}

    def run(self, inputs: dict[str, Any]) -> list[torch.Tensor]:
        """The output tensors, in the program's order."""
        self.ordered(inputs)
        from hfexport.models.frontend import normalize_inputs

        return outputs_in_program_order(self.out_spec, self._call(copy_inputs(normalize_inputs(inputs, renames=True))))

    def _call(self, kwargs: dict[str, Any]) -> Any:
        """``module()(**kwargs)``; a shape condition the trace recorded that the inputs fail (a guard
        the manifest's per-axis bounds cannot state: SEW's length arithmetic) is one line, unless
        it is a batch of one that the program's other guards allow (see :meth:`_batch_of_one`)."""
        try:
            with torch.no_grad():
                return self.module(**kwargs)
        except AssertionError as error:
            if not str(error).startswith("Guard failed"):
                raise
            if self._batch_of_one(kwargs):
                if self.unguarded is None:
                    self.unguarded = self.program.module(check_guards=False)
                with torch.no_grad():
                    return self.unguarded(**kwargs)
            condition = str(error).removeprefix("Guard failed:").strip()
            raise HfExportError(
                f"the inputs' shapes fail a condition the program was traced with ({condition}): the model's "
                "code fixed it from the sample; export with a sample of these shapes"
            ) from None

    def _batch_of_one(self, kwargs: dict[str, Any]) -> bool:
        """Whether the inputs are a batch of one that every guard of the program allows at a batch
        of two. torch.export traces a batch axis as "not 0 or 1" (its range starts at 2) and the
        runners take 1 there, as every runtime does; a guard derived from it (Florence-2's window
        count, ``pixel_values.size()[0] * … != 1``) refuses the one row that generation feeds."""
        from hfexport.targets.shape_relations import guards_hold

        shapes = {path: tuple(getattr(value, "shape", ())) for path, value in flat_inputs(kwargs).items()}
        widened = dict(shapes)
        for spec in self.spec.fed:
            shape = shapes.get(spec.path)
            ones = [axis for axis, (low, _) in spec.dynamic.items() if low == 2 and shape and shape[axis] == 1]
            if ones:
                widened[spec.path] = tuple(2 if axis in ones else size for axis, size in enumerate(shape))
        return widened != shapes and guards_hold(self.program, widened)

    def run_named(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The outputs by keyword path (see :meth:`~hfexport.targets.runner.Runner.by_path`), from
        inputs given flat by keyword path (``cache.layers.0.keys``: the program's structure comes
        from its example inputs). The program writes its in-place updates into the given tensors,
        which are returned as the write-backs."""
        import torch.utils._pytree as pytree

        from hfexport.models.caches import register_cache_pytrees
        from hfexport.pipeline.io_names import path_name

        self.ordered(inputs)
        register_cache_pytrees()
        flat = flat_inputs(inputs)
        leaves, spec = pytree.tree_flatten_with_path(self.example_kwargs)
        values = [flat.get(path_name(path), leaf) for path, leaf in leaves]
        outputs = self._call(pytree.tree_unflatten(values, spec))
        found = self.by_path(outputs_in_program_order(self.out_spec, outputs))
        found.update({i.path: flat[i.path] for i in self.spec.inputs if i.written and i.path in flat})
        return found


class DynamoDecoder(StaticCacheDecoder):
    """``step`` for :func:`~hfexport.generation.greedy_decode` over an exported decode
    ``ExportedProgram``: the static cache is a copy of the one in the program's example inputs,
    reset, resized to the batch, and updated in place by each call."""

    def __init__(self, program: torch.export.ExportedProgram, batch_size: int) -> None:
        import torch.utils._pytree as pytree

        from hfexport.generation import DecodeMasks
        from hfexport.models.caches import register_cache_pytrees
        from hfexport.models.frontend import is_static_cache
        from hfexport.models.static_layers import attention_windows

        register_cache_pytrees()
        _, example = program.example_inputs
        mask = example["attention_mask"]
        masks = [m for m in (mask.values() if isinstance(mask, dict) else [mask]) if m is not None]
        two_d = isinstance(mask, torch.Tensor) and mask.dim() == 2
        if any(m.dim() != 4 for m in masks) and not (two_d and is_static_cache(example["cache"])):
            raise HfExportError(
                "the decode program takes a 2-D attention mask, not a static cache's 4-D one: it writes no cache "
                "in place (a model whose own cache class grows, as MiniMax's); export decode with a static cache"
            )
        # a layer type the decode step passes no mask (Inkling's linear attention: None) gets None
        self.no_masks = {key: None for key, value in mask.items() if value is None} if isinstance(mask, dict) else {}
        if isinstance(mask, dict):
            dtypes = {f"attention_mask.{key}": value.dtype for key, value in mask.items() if value is not None}
        else:
            dtypes = {"attention_mask": mask.dtype}
        types = [key for key in mask if key not in self.no_masks] if isinstance(mask, dict) else None
        padding = int(mask.shape[1]) if two_d else None
        self.masks = DecodeMasks(types, attention_windows(example), dtypes, key_padding_length=padding)
        positions = example.get("position_ids")
        self.position_rows = self.rows_of(positions.shape if isinstance(positions, torch.Tensor) else None)
        # a model that counts positions from its cache (TrOCR's learned positions) takes none
        self.takes_positions = "position_ids" in example
        passed = {"input_ids", "attention_mask", "position_ids", "cache"}
        self.constants = {k: v for k, v in example.items() if k not in passed}
        self.cache = pytree.tree_map(
            lambda t: torch.zeros((batch_size, *t.shape[1:]), dtype=t.dtype) if t.dim() >= 2 else torch.zeros_like(t),
            example["cache"],
        )
        leaves = [t.shape for t in pytree.tree_leaves(self.cache)]
        self.max_cache_len = self.cache_length([m.shape for m in masks], leaves)
        self.masks.check_cache_length(self.max_cache_len)
        self.module = program.module()

    def _masks(self, valid: torch.Tensor, query_slots: torch.Tensor) -> Any:
        masks = self.masks.structured(valid, query_slots)
        return {**masks, **self.no_masks} if self.no_masks else masks

    def __call__(
        self, input_ids: torch.Tensor, valid: torch.Tensor, query_slots: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.takes_positions:
            positions = {"position_ids": self.positions(position_ids)}
        else:
            positions = {}
        with torch.no_grad():
            out = self.module(
                input_ids=input_ids,
                attention_mask=self._masks(valid, query_slots),
                cache=self.cache,
                **positions,
                **self.constants,
            )
        return out.logits


class DynamoTarget(Target):
    """``ExportedProgram`` → ``.pt2``; run with ``module()`` or :class:`DynamoRunner`."""

    name = "dynamo"
    suffix = ".pt2"
    config_class = "hfexport.configs:DynamoConfig"
    default_passes = (*CLEANUP_PASSES, "dead_code_elimination")
    runtime = "PyTorch"

    def save(self, program: torch.export.ExportedProgram, path: Path) -> None:
        torch.export.save(program, path)

    def load_program(self, path: Path, trust: bool = False) -> torch.export.ExportedProgram:
        return load_exported_program(path, trust)

    def component(self, program: torch.export.ExportedProgram, captured: Captured | None) -> ComponentSpec:
        return program_component(program, captured)

    def runner(self, path: Path, spec: ComponentSpec, trust: bool = False) -> DynamoRunner:
        return DynamoRunner(load_exported_program(path, trust), spec)

    def decoder(self, folder: Path, manifest: Manifest, batch_size: int, trust: bool = False) -> DynamoDecoder:
        return DynamoDecoder(load_exported_program(folder / manifest.component("decode").file, trust), batch_size)
