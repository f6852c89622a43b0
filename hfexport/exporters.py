"""The exporters: thin facades that capture a model and lower the capture to a target.

Each exporter builds a :class:`~hfexport.Pipeline` from its registered target
(:mod:`hfexport.targets`): capture → FX passes → the target's stages. :func:`run_targets` lowers
one capture to several targets.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.configs import DynamoConfig, _encode_dim
from hfexport.errors import ConfigError, HfExportError, RuntimeInterfaceError
from hfexport.models import TRANSFORMERS
from hfexport.pipeline.capture import Captured
from hfexport.pipeline.dynamic_shapes import AxisBounds
from hfexport.pipeline.instruments import Instrument, TimingInstrument
from hfexport.pipeline.pass_manager import PassManager, resolve_passes, weights_kept_if
from hfexport.pipeline.pipeline import PassStage, Pipeline, PipelineResult
from hfexport.precision import group_by_dtype, in_dtype, resolve_dtype
from hfexport.targets import Target, get_target
from hfexport.versions import warn_on_version_drift

FX_PASSES = "fx_passes"
logger = logging.getLogger("hfexport")


EXPORTERS: dict[str, type[HfExporter]] = {}  # export_format -> the HfExporter subclass naming it


def exporter_for(export_format: str) -> HfExporter:
    """The exporter of the registered target ``export_format``: the subclass naming it
    (:class:`OnnxExporter` for ``"onnx"``), else an :class:`HfExporter` over it."""
    get_target(export_format)  # an unknown name: ConfigError listing the registered ones
    exporter = EXPORTERS.get(export_format)
    return exporter() if exporter is not None else HfExporter(export_format)


class HfExporter:
    """The exporters' facade over a registered :class:`~hfexport.targets.Target`: capture → the
    target's pass stages and lowering stages. A subclass names its target in ``export_format``;
    ``HfExporter("name")`` is the exporter of any registered target."""

    export_format: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "export_format" in cls.__dict__:
            EXPORTERS[cls.export_format] = cls

    def __init__(self, export_format: str | None = None) -> None:
        if export_format is not None:
            self.export_format = export_format
        warn_on_version_drift()

    @property
    def target(self) -> Target:
        return get_target(self.export_format)

    @property
    def config_class(self) -> type[DynamoConfig]:
        return Target.load_class(self.target.config_class)

    def pass_list(self, config: Any) -> list[Any]:
        """The configured pass list, every pass stage's: ``config.passes`` or the target's defaults."""
        return self.target.pass_list(config)

    def _check_config(self, config: Any) -> Any:
        if config is None:
            return self.config_class()
        if not isinstance(config, self.config_class):
            raise ConfigError(
                f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}; "
                "use AutoHfExporter.from_config(config) to pick the exporter matching a config"
            )
        return config

    def build_pipeline(self, config: Any = None, instruments: tuple[Instrument, ...] = ()) -> Pipeline:
        """The pipeline :meth:`export` runs: capture → FX passes → the target's stages, with the
        passes of ``config.passes`` (or the default list) split among the pass stages, and the
        instruments the config asks for. Edit its ``passes`` and call :meth:`Pipeline.run` to run
        a custom pass list (the config it was built with is the one it runs with)."""
        return self._pipeline(self._check_config(config), instruments)

    def _pipeline(self, config: Any, instruments: tuple[Instrument, ...]) -> Pipeline:
        layout = [FX_PASSES, *self.target.stages(config)]
        stage_names = [s for s in layout if isinstance(s, str)]
        by_stage: dict[str, list[Any]] = {name: [] for name in stage_names}
        for pass_ in resolve_passes(self.pass_list(config)):
            if pass_.stage not in by_stage:
                raise ConfigError(
                    f"pass {pass_.name!r} runs in stage {pass_.stage!r}, which the {self.export_format} "
                    f"pipeline does not have (its pass stages: {', '.join(stage_names)})"
                )
            by_stage[pass_.stage].append(pass_)
        stages = [PassStage(s, PassManager(by_stage[s])) if isinstance(s, str) else s for s in layout]
        return Pipeline.for_config(stages, config, instruments, TRANSFORMERS, self.target.bounds, _in_config_dtype)

    def run(
        self,
        model: torch.nn.Module,
        inputs: Any,
        config: Any = None,
        instruments: Sequence[Instrument] = (),
        *,
        shared: Captured | None = None,
    ) -> PipelineResult:
        """Export and return the whole :class:`PipelineResult` (program, per-step records, report).
        ``shared``: lower this capture (see :func:`run_targets`) instead of capturing again. A
        model in another dtype than ``config.dtype`` resolves to is exported as a converted copy."""
        config = self._check_config(config)
        result = self._pipeline(config, tuple(instruments)).run(model, inputs, shared=shared)
        result.target = self.export_format
        return result

    def export(self, model: torch.nn.Module, inputs: Any, config: Any = None) -> Any:
        """Export ``model(**inputs)`` and return the backend's program. The model and the inputs
        are not modified."""
        return self.run(model, inputs, config).program

    def export_for_generation(
        self,
        model: torch.nn.Module,
        inputs: Any,
        config: Any = None,
        generation_config: Any = None,
        multi_token_decode: bool = False,
    ) -> dict[str, Any]:
        """Export each component of ``model``'s generation loop (see
        :func:`~hfexport.decompose_for_generation`): ``{component: program}``.

        ``config`` is one config for every component or ``{component: config}``; with a
        ``dump_dir``, each component dumps into its own subfolder. A failing component raises
        :class:`~hfexport.HfExportError` naming it.
        """
        if isinstance(config, dict):
            config = {name: self._check_config(c) for name, c in config.items()}
        else:
            config = self._check_config(config)
        results = run_for_generation(model, inputs, [config], generation_config, multi_token_decode, exporters=[self])
        return {name: by_target[self.export_format].program for name, by_target in results.items()}


def _in_config_dtype(model: torch.nn.Module, inputs: Any, config: Any) -> tuple[torch.nn.Module, Any]:
    """``(model, inputs)`` in the dtype ``config`` exports in (a converted copy when it differs)."""
    return in_dtype(model, inputs, resolve_dtype(model, config), [config])


CAPTURE_FIELDS = ("dynamic", "dynamic_shapes", "strict", "prefer_deferred_runtime_asserts_over_guards")


def run_targets(
    model: torch.nn.Module,
    inputs: Any,
    configs: Sequence[Any],
    instruments: Sequence[Instrument] = (),
    exporters: Sequence[HfExporter] | None = None,
) -> dict[str, PipelineResult]:
    """Export ``model(**inputs)`` to several targets from **one** capture: ``{export_format: result}``.

    ``configs`` holds one config per target (``[OnnxConfig(dynamic=True), ExecutorchConfig(dynamic=True)]``);
    they must agree on what capture uses (``dynamic``, ``dynamic_shapes``, ``strict``,
    ``prefer_deferred_runtime_asserts_over_guards``). When a target needs bounded dynamic axes
    (ExecuTorch's memory planning), the one capture is made with the bounds and every target gets
    them; each report says so. Every target lowers its own copy of the captured graph.
    ``exporters`` (one per config) replaces the registry's exporter of each target. Targets whose
    configs export the model in different dtypes (``dtype="auto"`` with a bfloat16 model: float32
    for ONNX, bfloat16 for ExecuTorch) get one capture per dtype.
    """
    if not configs:
        raise ConfigError("run_targets needs at least one config")
    formats = [getattr(c, "export_format", None) for c in configs]
    if len(set(formats)) != len(formats):
        raise ConfigError(f"one config per target: {formats} names a target twice")
    if exporters is None:
        exporters = [exporter_for(getattr(c, "export_format", None)) for c in configs]
    if len(exporters) != len(configs):
        raise ConfigError(f"run_targets got {len(exporters)} exporters for {len(configs)} configs")
    groups = group_by_dtype(model, configs)
    if len(groups) > 1:
        logger.info(
            "one capture per dtype: %s", {str(dtype): [formats[i] for i in group] for dtype, group in groups.items()}
        )
        found: dict[str, PipelineResult] = {}
        for group in groups.values():
            picked = [configs[i] for i in group], [exporters[i] for i in group]
            found.update(run_targets(model, inputs, picked[0], instruments, picked[1]))
        return {fmt: found[fmt] for fmt in formats}
    model, inputs = in_dtype(model, inputs, next(iter(groups)), configs)
    if len(configs) == 1:
        return {formats[0]: exporters[0].run(model, inputs, configs[0], instruments)}
    for field in CAPTURE_FIELDS:
        values = {f: _encode_dim(getattr(c, field)) for f, c in zip(formats, configs, strict=True)}
        if len({repr(v) for v in values.values()}) > 1:
            raise ConfigError(
                f"one capture feeds every target, so their configs must agree on {field!r}; got "
                + ", ".join(f"{f}: {v!r}" for f, v in values.items())
            )
    bounds: AxisBounds | None = None
    for exporter, config in zip(exporters, configs, strict=True):
        needed = exporter.target.bounds(model, config)
        bounds = needed.tightest(bounds) if needed is not None else bounds
    capture_only = Pipeline([], configs[0], [TimingInstrument(), *instruments], TRANSFORMERS)
    captured = capture_only.run(model, inputs, bounds=bounds).captured
    captured = dataclasses.replace(captured, shared_by=tuple(formats))
    results = {}
    for fmt, exporter, config in zip(formats, exporters, configs, strict=True):
        results[fmt] = exporter.run(model, inputs, config, instruments, shared=captured)
    return results


def export_targets(model: torch.nn.Module, inputs: Any, configs: Sequence[Any]) -> dict[str, Any]:
    """:func:`run_targets`, returning just the programs: ``{export_format: program}``."""
    return {fmt: result.program for fmt, result in run_targets(model, inputs, configs).items()}


def run_for_generation(
    model: torch.nn.Module,
    inputs: Any,
    configs: Sequence[Any],
    generation_config: Any = None,
    multi_token_decode: bool = False,
    instruments: Sequence[Instrument] = (),
    exporters: Sequence[HfExporter] | None = None,
    on_component: Callable[[str, int, int], None] | None = None,
    components: Sequence[str] | None = None,
    skip_unused_prefill: bool = False,
) -> dict[str, dict[str, PipelineResult]]:
    """Export each component of ``model``'s generation loop to each target of ``configs`` (each a
    config, or ``{component: config}``), one capture per component: ``{component: {export_format:
    result}}``. With a ``dump_dir``, each component dumps into its own subfolder. A failing component
    raises :class:`~hfexport.HfExportError` naming it. ``on_component(name, index, count)`` is
    called as each component starts (the command line prints a progress line). ``components``
    names the ones to export (default: all). ``skip_unused_prefill`` leaves out a decoder-only
    model's ``prefill`` when its ``decode`` takes several tokens (``multi_token_decode=True``,
    and not a recurrent model's one-token step): hfexport's decode loops feed that ``decode`` the
    whole prompt and never run the prefill (the command line's default)."""
    from hfexport.models.generation import decompose_for_generation, holds_cache

    groups = group_by_dtype(model, configs)
    if len(groups) > 1:  # one decomposition per dtype: its components are the converted model's
        merged: dict[str, dict[str, PipelineResult]] = {}
        for group in groups.values():
            part = run_for_generation(
                model,
                inputs,
                [configs[i] for i in group],
                generation_config,
                multi_token_decode,
                instruments,
                [exporters[i] for i in group] if exporters is not None else None,
                on_component,
                components,
                skip_unused_prefill,
            )
            for name, by_target in part.items():
                merged.setdefault(name, {}).update(by_target)
        return merged
    model, inputs = in_dtype(model, inputs, next(iter(groups)), configs)
    if any(_batch_of_one(config) for config in configs):
        inputs = _first_row(inputs)
    found = decompose_for_generation(model, inputs, generation_config, multi_token_decode)
    unknown = sorted(set(components or ()) - set(found))
    if unknown:
        raise ConfigError(
            f"{type(model).__name__} has no generation component {', '.join(unknown)}; its components: "
            f"{', '.join(found)}"
        )
    selected = {name: found[name] for name in found if components is None or name in components}
    loops = _runtime_loops(configs)
    unused = skip_unused_prefill and _takes_several_tokens(found.get("decode", (None, {}))[1])
    # a runtime's own loop feeds its decode graph the prompt too, at once or a token at a time
    if (unused or (loops and components is None)) and set(found) == {"prefill", "decode"}:
        selected.pop("prefill", None)
    if loops and list(selected) != ["decode"]:
        raise RuntimeInterfaceError(
            f"{loops[0]} runs a decoder-only model's decode graph alone; {type(model).__name__}'s generation "
            f"has the components {', '.join(selected)} (a prompt step, an encoder or a recurrent state): export it "
            "in hfexport's own interface (--spec-io) to run it with hfexport generate"
        )
    results = {}
    for index, (name, (module, kwargs)) in enumerate(selected.items()):
        carries_state = any(holds_cache(value) for value in kwargs.values())  # a cache, RWKV's state
        if on_component is not None:
            on_component(name, index, len(selected))
        component_configs = []
        for config in configs:
            if isinstance(config, dict) and name not in config:
                raise ConfigError(
                    f"the per-component config dict has no entry for component {name!r}; "
                    f"give one for each of: {', '.join(selected)}"
                )
            config = copy.deepcopy(config[name] if isinstance(config, dict) else config)
            cache_len = getattr(generation_config, "max_cache_len", None)
            # a component writing a static cache never sees more tokens than it holds (nor does a
            # decode without a cache, which takes the whole sequence); an encoder-decoder's decoder
            # also takes the encoder's states and mask, as long as the input (audio frames, a long
            # text), so it keeps the target's default bound
            bounded = (carries_state or name == "decode") and "encoder_outputs" not in kwargs
            config = get_target(config.export_format).generation_config(
                config, longest=cache_len if bounded else None, carries_state=carries_state
            )
            if config.dump_dir:
                config.dump_dir = str(Path(config.dump_dir) / name)
            component_configs.append(config)
        # the model's weights stay whole for the components after this one, and for a decode
        # exported again from one step
        last = index == len(selected) - 1
        try:
            with weights_kept_if(_query_fixed_above_one if last else lambda captured: True):
                results[name] = run_targets(module, kwargs, component_configs, instruments, exporters)
            if name == "decode" and any(_query_fixed_above_one(r.captured) for r in results[name].values()):
                # the loops feed a decode graph a prompt and then one token; one that takes exactly
                # the merged sample's tokens could run neither (MiniMax's code fixes the length, as
                # does a static export): the decode is exported again from one step
                logger.warning(
                    "%s's decode graph takes exactly the sample's %d new tokens; exporting it for one token per step",
                    type(model).__name__,
                    kwargs["input_ids"].shape[1],
                )
                module, kwargs = decompose_for_generation(model, inputs, generation_config)["decode"]
                results[name] = run_targets(module, kwargs, component_configs, instruments, exporters)
        except HfExportError as error:
            raise type(error)(f"component {name!r}: {error}") from error
        except Exception as error:
            raise HfExportError(f"component {name!r} failed: {type(error).__name__}: {error}") from error
    return results


def _runtime_loops(configs: Sequence[Any]) -> list[str]:
    """The runtime generation loops (see :meth:`~hfexport.targets.Target.runtime_loop`) ``configs`` ask for."""
    found = []
    for config in configs:
        for one in config.values() if isinstance(config, dict) else [config]:
            loop = get_target(one.export_format).runtime_loop(one)
            if loop is not None and loop not in found:
                found.append(loop)
    return found


def _query_fixed_above_one(captured: Any) -> bool:
    """Whether a captured decode graph takes a fixed number of new tokens above one."""
    return captured is not None and any(
        axis.input == "input_ids" and axis.axis == 1 and not axis.dynamic and axis.size > 1
        for axis in captured.input_axes
    )


def _takes_several_tokens(kwargs: dict[str, Any]) -> bool:
    """Whether a decode step (its recorded ``kwargs``) can take the prompt in the prefill's place:
    several tokens at once, over an attention cache (a 4-D mask, one per layer type, or a 2-D one
    over a static cache's slots). A recurrent state (RWKV's) starts from the prefill's output, not
    from zeros."""
    from hfexport.models.frontend import is_static_cache

    ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    # a 2-D mask spans a static cache's slots when the model makes its masks from it (BLOOM)
    over_slots = isinstance(mask, torch.Tensor) and mask.dim() == 2 and is_static_cache(kwargs.get("cache"))
    attention = isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() == 4) or over_slots
    return attention and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > 1


def _batch_of_one(config: Any) -> bool:
    """Whether ``config`` (or one of its per-component configs) exports a generation loop for one
    sequence at a time (its target says: ExecuTorch's, with ``max_batch_size`` left to its default)."""
    if isinstance(config, dict):
        return any(_batch_of_one(c) for c in config.values())
    return get_target(config.export_format).batch_of_one(config)


def _first_row(inputs: Any) -> Any:
    """The sample with its first row only, when every tensor input leads with the batch axis
    (a vision model's flattened patches do not: then the sample is kept, and a batch above the
    bound is refused by name at capture)."""
    if not isinstance(inputs, dict):
        return inputs
    tensors = {name: v for name, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim()}
    batches = {v.shape[0] for v in tensors.values()}
    if len(batches) != 1 or batches == {1}:
        return inputs
    return {**inputs, **{name: v[:1] for name, v in tensors.items()}}


class DynamoExporter(HfExporter):
    """Export to a ``torch.export`` ``ExportedProgram``: ``exported.module()(**inputs)`` runs it."""

    export_format = "dynamo"


class OnnxExporter(HfExporter):
    """Export to a ``torch.onnx.ONNXProgram``: ``.save("model.onnx")``, then run it with ONNX
    Runtime fed with the model's keyword inputs by name."""

    export_format = "onnx"


class ExecutorchExporter(HfExporter):
    """Export to an ExecuTorch ``ExecutorchProgramManager`` (XNNPACK-delegated by default):
    ``.save("model.pte")``, then run it with ``executorch.runtime``."""

    export_format = "executorch"
