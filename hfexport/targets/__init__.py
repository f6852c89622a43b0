"""Targets: what hfexport lowers a capture to, one folder each (``dynamo/``, ``onnx/``,
``executorch/``), each holding its stages, its side of the export folder's manifest, its runner and
its generation decoder.

The registry maps a target name (a config's ``export_format``) to its :class:`Target` class,
imported on first use so a target's packages load only when it is asked for. It drives the auto
classes, the command line (``export --format``, ``generate``) and the benchmarks: registering a
target makes it usable everywhere.
"""

from __future__ import annotations

import importlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.errors import ArtifactError, ConfigError, HfExportError
from hfexport.pipeline.capture import Captured
from hfexport.pipeline.dynamic_shapes import AxisBounds
from hfexport.targets.manifest import MANIFEST, ComponentSpec, Manifest


class Target:
    """A target: subclass it, set the class attributes, and register it with :func:`register_target`.

    ``config_class`` is a ``"module:Class"`` path (or the class): a :class:`~hfexport.DynamoConfig`
    subclass whose ``export_format`` is ``name``. ``default_passes`` names the passes of every pass
    stage, in order (each pass's ``stage`` says which one it runs in); a target keeps them in its
    own ``passes`` package, beside the passes only it uses.
    """

    name: ClassVar[str]
    suffix: ClassVar[str]  # the artifact's file suffix, e.g. ".onnx"
    # the suffix of the programs its passes take, when not the artifact's (read by load_program)
    program_suffix: ClassVar[str | None] = None
    config_class: ClassVar[Any]
    default_passes: ClassVar[tuple[str, ...]] = ()
    # the floating-point dtypes the target's runtime runs a program in (a config's dtype="auto"
    # converts a model of another dtype to float32; an explicit other dtype is refused), and that
    # runtime's name for those messages
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    runtime: ClassVar[str] = "the target's runtime"

    def keeps_stored(self, config: Any, module: torch.nn.Module) -> bool:
        """Whether a model converted for an export with ``config`` may keep ``module``'s own
        weights as stored, narrower than it computes in (:class:`~hfexport.computed_weights.ComputedIn`):
        the target's lowering converts them as it writes the program. No by default."""
        return False

    def why_auto_converts(self, config: Any, dtype: str) -> str | None:
        """Why ``dtype="auto"`` exports a ``dtype`` model with ``config`` in float32 instead (the
        start of the warning that says so); ``None``: it keeps the model's dtype."""
        return None if dtype in self.dtypes else f"{self.runtime} runs no {dtype}"

    def pass_list(self, config: Any) -> list[Any]:
        """The passes an export with ``config`` runs: ``config.passes``, or :attr:`default_passes`."""
        return list(self.default_passes) if config.passes is None else list(config.passes)

    def generation_config(self, config: Any, *, longest: int | None, carries_state: bool) -> Any:
        """The config one component of a generation export runs with (``config``, a copy the
        caller owns, changed in place or not). ``longest``: the most tokens the component ever
        sees at once (a static cache's length; ``None``: no such bound), ``carries_state``: whether
        it carries a cache or a recurrent state from step to step."""
        return config

    def runtime_loop(self, config: Any) -> str | None:
        """The runtime generation loop a generation export with ``config`` is made for (its name:
        "ONNX Runtime GenAI"), which runs the ``decode`` component alone; ``None``: hfexport's
        own loops, which run every component (the default)."""
        return None

    def batch_of_one(self, config: Any) -> bool:
        """Whether a generation export with ``config`` takes one sequence at a time (its sample
        is then cut to its first row before the generation loop is decomposed)."""
        return False

    def stages(self, config: Any) -> list[Any]:
        """The stages after the FX passes: :class:`~hfexport.pipeline.pipeline.Stage` objects, and
        the names of pass stages (which receive the passes whose ``stage`` is that name)."""
        return []

    def bounds(self, model: torch.nn.Module, config: Any) -> AxisBounds | None:
        """Upper bounds this target needs on unbounded dynamic axes (``None``: it needs none)."""
        return None

    def save(self, program: Any, path: Path) -> None:
        """Write the artifact of ``program`` to ``path``."""
        raise NotImplementedError

    def runtime_files(self, manifest: Manifest) -> dict[str, str]:
        """``{file name: text}`` written beside the programs for the runtime's own loaders (ONNX
        Runtime GenAI's ``genai_config.json``); none by default."""
        return {}

    def load_program(self, path: Path, trust: bool = False) -> Any:
        """Read back a program that :meth:`save` wrote (or a failing pass's dumped ``input<suffix>``)
        as the passes of this target's pass stages take it, for ``hfexport replay``. A target whose
        artifact no pass takes (an ExecuTorch ``.pte``) does not override it. ``trust``: as for
        :meth:`runner`."""
        raise HfExportError(f"target {self.name!r} cannot read its {self.suffix} back as a program for passes")

    def component(self, program: Any, captured: Captured | None) -> ComponentSpec:
        """The manifest entry of ``program`` (its ``file`` is filled in by :func:`save_export`)."""
        raise NotImplementedError

    def runner(self, path: Path, spec: ComponentSpec, trust: bool = False) -> Any:
        """A runner of the saved artifact: ``run(inputs) -> outputs`` with inputs matched by name.
        ``trust`` allows reading an artifact that runs code when loaded (pickled Python objects:
        only a ``.pt2`` can hold them); every target refuses those by default."""
        raise HfExportError(f"target {self.name!r} has no runner")

    def decoder(self, folder: Path, manifest: Manifest, batch_size: int, trust: bool = False) -> Any:
        """A step function for :func:`hfexport.generation.greedy_decode` over the folder's ``decode``
        (``trust``: as for :meth:`runner`)."""
        raise HfExportError(f"target {self.name!r} has no generation decoder")

    @staticmethod
    def load_class(path: Any) -> Any:
        if not isinstance(path, str):
            return path
        module, _, name = path.partition(":")
        return getattr(importlib.import_module(module), name)


TARGETS: dict[str, Any] = {
    "dynamo": "hfexport.targets.dynamo:DynamoTarget",
    "onnx": "hfexport.targets.onnx:OnnxTarget",
    "executorch": "hfexport.targets.executorch:ExecutorchTarget",
}
_INSTANCES: dict[str, Target] = {}


def register_target(name: str, target: type[Target] | str) -> None:
    """Register a target class (or its ``"module:Class"`` path) under ``name``."""
    TARGETS[name] = target
    _INSTANCES.pop(name, None)


def target_names() -> list[str]:
    return list(TARGETS)


def artifact_suffixes() -> tuple[str, ...]:
    """The file endings of every registered target's programs (with ``.data``: ONNX external
    data), for targets whose backend is installed."""
    suffixes: list[str] = []
    for name in TARGETS:
        try:
            suffix = get_target(name).suffix
        except (ImportError, HfExportError):
            continue
        suffixes += [suffix, f"{suffix}.data"]
    return tuple(suffixes)


def target_reading(path: str | Path) -> Target:
    """The registered target that reads ``path`` back as a program for passes
    (:meth:`Target.load_program`), picked by the longest :attr:`Target.program_suffix` its name ends
    with; :class:`~hfexport.ArtifactError` when none reads it."""
    readers = {}
    for name in TARGETS:
        try:
            target = get_target(name)
        except (ImportError, HfExportError):
            continue
        if type(target).load_program is not Target.load_program:
            readers.setdefault(target.program_suffix or target.suffix, target)
    for suffix in sorted(readers, key=len, reverse=True):
        if Path(path).name.endswith(suffix):
            return readers[suffix]
    kinds = ", ".join(list(readers)[:-1]) + f" or {list(readers)[-1]}" if len(readers) > 1 else "".join(readers)
    raise ArtifactError(
        f"{path}: a program for passes is a {kinds} file (a failing pass's dumped "
        f"input{'/input'.join(readers)}), not {Path(path).suffix or 'a file without a suffix'}"
    )


def get_target(name: Any) -> Target:
    """The registered target called ``name``; an unknown name raises :class:`ConfigError`."""
    if name not in TARGETS:
        raise ConfigError(f"unknown export_format {name!r}; valid formats: {', '.join(TARGETS)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = Target.load_class(TARGETS[name])()
    return _INSTANCES[name]


def save_export(
    folder: str | Path,
    results: dict[str, Any],
    *,
    generation: dict[str, Any] | None = None,
    model_folder: str | Path | None = None,
) -> Manifest:
    """Write an export folder: each component's artifact (``<component><suffix>``; ``model<suffix>``
    for a decode graph in a runtime's interface) and the manifest
    ``hfexport.json``. ``results`` is ``{component: PipelineResult}``, all of one target. With
    ``model_folder`` (the checkpoint the model was loaded from), its config, generation config and
    tokenizer / processor files are copied along, so the export folder needs nothing else.

    Everything is written to a staging folder first and moved in afterwards, the manifest last; an
    earlier export's manifest is removed before and its artifacts that this one does not replace
    after, so the folder never holds a manifest describing files it does not have. Other files in
    ``folder`` (a dump folder, say) are left alone."""
    targets = {result.target for result in results.values()}
    if len(targets) != 1:
        raise HfExportError(f"an export folder holds one target's programs, got {sorted(targets)}")
    target = get_target(targets.pop())
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise HfExportError(f"--out {folder} is a file; give a folder to write the export into")
    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hfexport-", dir=folder))
    try:
        components = {}
        for name, result in results.items():
            spec = target.component(result.program, result.captured)
            # a decode graph in a runtime's own interface has the runtime's file name (its exporters'
            # model.onnx, model.pte): the one program of a folder the runtime runs as it is
            spec.file = f"{'model' if spec.interface and name == 'decode' else name}{target.suffix}"
            target.save(result.program, staging / spec.file)
            components[name] = spec
        model = next(iter(results.values())).model_name
        manifest = Manifest(target.name, components, model=model, generation=generation, versions=_versions())
        manifest.write(staging)
        for file, text in target.runtime_files(manifest).items():
            (staging / file).write_text(text)
        for file in model_files(model_folder):
            shutil.copy2(file, staging / file.name)
        stale = set()
        if (folder / MANIFEST).is_file():
            stale = {spec.file for spec in Manifest.read(folder).components.values()}
            (folder / MANIFEST).unlink()
        for file in sorted(p.name for p in staging.iterdir() if p.name != MANIFEST):
            (staging / file).replace(folder / file)
        for file in stale - {spec.file for spec in components.values()}:
            (folder / file).unlink(missing_ok=True)
        (staging / MANIFEST).replace(folder / MANIFEST)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


# what generating text from an export needs besides the programs
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)


def model_files(folder: str | Path | None) -> list[Path]:
    """The config, generation config and tokenizer / processor files of a checkpoint folder."""
    if folder is None:
        return []
    return [Path(folder) / name for name in MODEL_FILES if (Path(folder) / name).is_file()]


def _versions() -> dict[str, str]:
    import importlib.metadata

    found = {}
    for package in ("hfexport", "torch", "transformers", "onnx", "onnxscript", "onnxruntime", "executorch"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


class ExportFolder:
    """A folder written by hfexport: its :class:`Manifest`, and runners and decoders over its
    programs, built by the target that wrote it. ``trust=True`` allows programs that run code
    from the file when loaded (see :func:`~hfexport.load_exported_program`)."""

    def __init__(self, folder: str | Path, trust: bool = False) -> None:
        self.folder = Path(folder)
        self.trust = trust
        self.manifest = Manifest.read(self.folder)
        self.target = get_target(self.manifest.target)

    def runner(self, component: str = "model") -> Any:
        """A runner of one component (``model`` for a single-graph export)."""
        spec = self.manifest.component(component)
        return self.target.runner(self.folder / spec.file, spec, self.trust)

    def decoder(self, batch_size: int = 1) -> Any:
        """The step function of the folder's static-cache ``decode`` for :func:`~hfexport.generation.greedy_decode`."""
        if "encoder" in self.manifest.components:
            raise HfExportError(
                f"{self.folder} holds an encoder-decoder export (encoder, prefill, decode), which the decoder-only "
                "step cannot run; generate with hfexport.load(DIR) (command line: hfexport generate DIR)"
            )
        decode = self.manifest.component("decode")
        ids = next((i for i in decode.inputs if i.path == "input_ids"), None)
        # the targets' decoders run an attention cache (4-D keys and values under cache.*, a
        # hybrid's convolution states beside them) with its mask; a step without one carries a
        # recurrent state only (Mamba's, 4-D for Mamba-2; RWKV's state.*), fed back by path
        # (or a runtime's interface, whose program derives its masks: decode.interface)
        masked = bool(decode.interface) or any(i.path.startswith("attention_mask") for i in decode.inputs)
        attention = masked and any(i.path.startswith("cache.") and len(i.shape) == 4 for i in decode.inputs)
        fed = ("input_ids", "position_ids", "attention_mask")
        states = [i.path for i in decode.inputs if len(i.shape) >= 2 and not i.path.startswith(fed)]
        from hfexport.generation import PromptInChunks, RecurrentDecoder, WholeSequenceDecoder

        if not states and not any(i.written or i.state for i in decode.inputs):
            # no cache at all (GPT-1): the program runs the whole sequence at each step
            lengths = [(self.manifest.generation or {}).get("max_cache_len")]
            lengths.append(ids.dynamic[1][1] if ids is not None and 1 in ids.dynamic else None)
            longest = min((n for n in lengths if n is not None), default=1 << 16)
            return WholeSequenceDecoder(self.runner("decode"), longest)
        if states and not attention:
            if "prefill" not in self.manifest.components:
                raise HfExportError(
                    f"the decode graph in {self.folder} carries a recurrent state ({states[0]}, …) and the folder has "
                    "no prefill program to start it from (the model's initial state is its own); run the folder's "
                    "decode program yourself"
                )
            return RecurrentDecoder(self.runner("prefill"), self.runner("decode"), batch_size)
        if ids is not None and 1 not in ids.dynamic and ids.shape[1] == 1:
            # one token per step (a recurrent state cannot take several at once): the prompt too
            return PromptInChunks(self.target.decoder(self.folder, self.manifest, batch_size, self.trust))
        most = ids.dynamic[1][1] if ids is not None and 1 in ids.dynamic else None
        if most is not None:
            # a bounded query (the cache length; Inkling's convolution states take fewer tokens than
            # the kernel at once): a longer prompt goes in pieces
            return PromptInChunks(self.target.decoder(self.folder, self.manifest, batch_size, self.trust), most)
        if ids is not None and 1 not in ids.dynamic:
            raise HfExportError(
                f"the decode graph in {self.folder} takes exactly {ids.shape[1]} query tokens (exported with static "
                "shapes), so it cannot take a prompt and then one token; export it again without --static "
                "(`hfexport export MODEL --generation`, whose shapes are dynamic by default)"
            )
        return self.target.decoder(self.folder, self.manifest, batch_size, self.trust)
