"""The ``hfexport`` command: ``export``, ``generate``, ``passes``, ``replay``, driven by the target registry."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from hfexport.errors import ConfigError, HfExportError, RuntimeInterfaceError
from hfexport.models.tasks import TASKS
from hfexport.targets import target_names
from hfexport.versions import TORCHAO_LOGGERS, quiet_loggers

# the config field that gives a target's decoder-only generation export its runtime's own interface
RUNTIME_IO = {"onnx": "genai", "executorch": "llm_runner"}


def _without_runtime_io(configs: list[Any]) -> list[Any]:
    """``configs`` asking for hfexport's own generation interface, not a runtime's."""
    import dataclasses

    return [
        dataclasses.replace(config, **{field: False for field in RUNTIME_IO.values() if getattr(config, field, False)})
        for config in configs
    ]


def _configs(args: argparse.Namespace, formats: list[str]) -> list[Any]:
    """One config per target: the ``--config`` JSON (flat, or one section per target name), then the flags."""
    from hfexport.auto import AutoExportConfig

    try:
        settings = json.loads(Path(args.config).read_text()) if args.config else {}
    except (OSError, json.JSONDecodeError) as error:
        raise HfExportError(f"--config {args.config}: cannot read a JSON object ({error})") from error
    if not isinstance(settings, dict):
        raise HfExportError(f"--config {args.config}: expected a JSON object of config keys")
    sectioned = bool(settings) and set(settings) <= set(target_names())
    configs = []
    for export_format in formats:
        values = dict(settings.get(export_format, {}) if sectioned else settings)
        values["export_format"] = export_format
        if args.verify:
            values["verify"] = True
        if args.static:
            values["dynamic"] = False
        elif "dynamic_shapes" not in values and ("dynamic" not in values or args.dynamic or args.generation):
            # dynamic by default; the decode graph must take any query length (a prompt, then one token)
            values["dynamic"] = True
        runtime_io = RUNTIME_IO.get(export_format)
        # the runtime's own generation loop runs the decode alone (components asked for besides: hfexport's loop)
        decode_only = args.components is None or [c.strip() for c in args.components.split(",")] == ["decode"]
        if args.generation and not args.spec_io and runtime_io and decode_only and runtime_io not in values:
            values[runtime_io] = True
            args.defaulted_runtime_io = True  # a model it cannot express falls back to hfexport's own interface
        if args.passes is not None:
            values["passes"] = args.passes
        if args.dtype is not None:
            values["dtype"] = args.dtype
        if args.quantize:
            from hfexport.targets import Target, get_target

            config_class = Target.load_class(get_target(export_format).config_class)
            if "quantize" not in config_class.field_names():
                raise ConfigError(
                    f"--quantize does not apply to --format {export_format} (it keeps the model's weights as they "
                    "are); quantize with --format onnx or executorch"
                )
            values["quantize"] = args.quantize
        if args.dump_dir:
            values["dump_dir"] = args.dump_dir if len(formats) == 1 else str(Path(args.dump_dir) / export_format)
        configs.append(AutoExportConfig.from_dict(values))
    return configs


def clear_out(out: Path, folders: list[Path], overwrite: bool) -> None:
    """Make ``out`` ready for an export before any work starts: refuse a file, and a folder that
    holds anything unless ``overwrite``; with ``overwrite``, remove the earlier export in each of
    ``folders`` (its manifest, the files it lists, and any program file) first, so a failed or
    interrupted export leaves no program that looks valid. The new export is staged and moved in
    only when complete (:func:`~hfexport.save_export`)."""
    from hfexport.targets import artifact_suffixes
    from hfexport.targets.manifest import MANIFEST, Manifest

    if out.exists() and not out.is_dir():
        raise HfExportError(f"--out {out} is a file; give a folder to write the export into")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise HfExportError(
            f"--out {out} is not empty (it holds {shown}); pass --overwrite to replace the export in it, "
            "or give a new folder"
        )
    suffixes = artifact_suffixes()
    for folder in folders:
        if not folder.is_dir():
            continue
        listed = set()
        if (folder / MANIFEST).is_file():
            try:
                listed = {spec.file for spec in Manifest.read(folder).components.values()}
            except (HfExportError, ValueError, KeyError):
                listed = set()  # a broken manifest: its program files still go by suffix
            (folder / MANIFEST).unlink()
        for path in folder.iterdir():
            if path.is_file() and (path.name in listed or path.name.endswith(suffixes)):
                path.unlink()


class Interrupts:
    """Ctrl-C during a command. Code deep in a backend can catch the ``KeyboardInterrupt`` and go
    on (seen in an ExecuTorch delegate stage), so the signal is also recorded, and
    :meth:`check` raises it again before anything is written."""

    received = False

    @classmethod
    @contextlib.contextmanager
    def recorded(cls) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        cls.received = False

        def handler(number: int, frame: Any) -> None:
            cls.received = True
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    @classmethod
    def check(cls) -> None:
        if cls.received:
            raise KeyboardInterrupt


def _export(args: argparse.Namespace) -> int:
    from hfexport.exporters import run_for_generation, run_targets
    from hfexport.models.generation import runtime_facts
    from hfexport.models.loading import load_model, model_folder
    from hfexport.models.processor_inputs import sample_inputs_for
    from hfexport.models.tasks import infer_task
    from hfexport.pipeline.instruments import ProgressInstrument
    from hfexport.pipeline.pass_manager import disposable_weights, private_weights
    from hfexport.pipeline.pipeline import stage_table
    from hfexport.precision import group_by_dtype, in_dtype
    from hfexport.targets import save_export

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    unknown = [f for f in formats if f not in target_names()]
    if unknown or not formats:
        raise HfExportError(
            f"unknown --format {','.join(unknown) or repr(args.format)}; valid: {', '.join(target_names())}"
        )
    configs = _configs(args, formats)
    out = Path(args.out)
    folders = {f: out if len(formats) == 1 else out / f for f in formats}
    clear_out(out, list(folders.values()), args.overwrite)
    if args.static and args.generation:
        raise ConfigError("--generation exports a decode graph that takes any prompt length; drop --static")

    def load() -> Any:
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        model = load_model(args.model, args.task, args.trust_remote_code)
        dtypes = group_by_dtype(model, configs)
        if len(dtypes) == 1:
            # every target exports one dtype: convert now, in place (the loaded weights go as
            # the converted ones are made)
            model, _ = in_dtype(model, {}, next(iter(dtypes)), configs, in_place=True)
        return private_weights(model)  # the command line's own: its programs need no copy of the weights

    model = load()
    source = model_folder(args.model)
    if getattr(model.config, "is_encoder_decoder", False):
        # the runtimes' own loops run a decoder-only model: an encoder-decoder keeps the spec's interface
        configs = _without_runtime_io(configs)
    task = args.task or infer_task(model.config)
    batch = args.batch
    if batch is None:
        # an ExecuTorch generation program takes one row, and a multimodal sample (flattened image
        # patches) cannot be cut to one afterwards
        from hfexport.configs import ExecutorchConfig

        batch = 1 if args.generation and any(isinstance(c, ExecutorchConfig) for c in configs) else 2
    inputs = sample_inputs_for(model, source, task, batch, args.seq, generation=args.generation)
    print(f"task {task}; sample inputs: {_shapes(inputs)}", file=sys.stderr, flush=True)
    if not any(getattr(config, "dynamic", False) or config.dynamic_shapes for config in configs):
        print(f"static shapes: the program takes exactly {_shapes(inputs)}", file=sys.stderr, flush=True)
    progress = (ProgressInstrument(),)
    if args.generation:
        from transformers import GenerationConfig

        generation_config = GenerationConfig(cache_implementation="static", max_cache_len=args.max_cache_len)

        def announce(name: str, index: int, count: int) -> None:
            print(f"component {index + 1}/{count}: {name}", file=sys.stderr, flush=True)

        components = [c.strip() for c in args.components.split(",") if c.strip()] if args.components else None
        # a decoder-only decode takes the prompt too; an encoder-decoder's decoder prompt goes
        # through its prefill, then one token per step (a decode traced on two merged tokens kept
        # runtime checks that a slice of them is at least two long: BERT2BERT's positions)
        several_tokens = not getattr(model.config, "is_encoder_decoder", False)

        def export_components(model: Any) -> dict[str, Any]:
            with disposable_weights(model):  # the quantized layers' fp32 weights go as they are replaced
                return run_for_generation(
                    model,
                    inputs,
                    configs,
                    generation_config,
                    several_tokens,
                    progress,
                    on_component=announce,
                    components=components,
                    skip_unused_prefill=components is None,
                )

        try:
            by_component = export_components(model)
        except RuntimeInterfaceError as error:
            if not getattr(args, "defaulted_runtime_io", False):
                raise
            # the runtimes' own interfaces are the default where a model fits them; this one does not
            why = str(error).split("; export it in hfexport's own interface")[0]
            print(
                f"hfexport: {why}: exporting hfexport's own interface instead (hfexport generate runs it)",
                file=sys.stderr,
                flush=True,
            )
            configs[:] = _without_runtime_io(configs)
            if any(not p.untyped_storage().nbytes() for p in model.parameters()):
                model = load()  # the refused export had freed weights it dropped
            by_component = export_components(model)
        for export_format, folder in folders.items():
            results = {name: by_target[export_format] for name, by_target in by_component.items()}
            # a recurrent decode (Mamba) takes one token per step even when several were asked for
            decode = results.get("decode")
            query = decode.captured.sample_shapes.get("input_ids", [0, 1])[1] if decode else 1
            generation = {
                "max_cache_len": args.max_cache_len,
                "multi_token_decode": query > 1,
                "model": runtime_facts(model),
            }
            Interrupts.check()
            manifest = save_export(folder, results, generation=generation, model_folder=source)
            for spec in manifest.components.values():
                print(f"wrote {folder / spec.file}")
        _print_peak_rss()
        return 0
    with disposable_weights(model):
        results = run_targets(model, inputs, configs, progress)
    for config in configs:
        folder, result = folders[config.export_format], results[config.export_format]
        Interrupts.check()
        manifest = save_export(folder, {"model": result}, model_folder=source)
        print(stage_table(result.records))
        dumps = f"; dumps and report.md in {config.dump_dir}" if config.dump_dir else ""
        print(f"\nwrote {folder / manifest.components['model'].file}{dumps}")
    _print_peak_rss()
    return 0


def _print_peak_rss() -> None:
    from hfexport.pipeline.instruments import process_peak_rss_mb

    # the whole export's, loading included (the per-stage figures are each stage's own)
    print(f"peak RSS {process_peak_rss_mb():.0f} MiB", file=sys.stderr, flush=True)


def _shapes(inputs: dict[str, Any]) -> str:
    return ", ".join(
        f"{name} {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        for name, value in inputs.items()
        if hasattr(value, "shape")
    )


def _generate(args: argparse.Namespace) -> int:
    from hfexport.generation import Sampling
    from hfexport.text_generator import load

    if args.chat and args.prompt_ids is not None:
        raise ConfigError("--chat applies a chat template to --prompt text; token ids are taken as given")
    if args.temperature == 0 and (args.top_k, args.top_p, args.seed) != (None, None, None):
        raise ConfigError("--top-k, --top-p and --seed shape sampling: give a --temperature above 0 as well")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    generator = load(args.export_dir, trust=args.trust_artifact)
    if args.audio is not None:
        if not Path(args.audio).is_file():
            raise HfExportError(f"--audio {args.audio}: no such file")
        result = generator.generate(
            None, args.max_new_tokens, chat=args.chat, stream=lambda text: None, audio=args.audio, sampling=sampling
        )
        # a speech model's answer as token ids (model.generate's), then its text when the folder has a tokenizer
        print(",".join(map(str, result.tokens)))
        if result.text:
            print(result.text)
    elif args.prompt_ids is not None:
        try:
            prompt: Any = [int(token) for token in args.prompt_ids.split(",")]
        except ValueError as error:
            raise HfExportError(f"--prompt-ids takes comma-separated integers, got {args.prompt_ids!r}") from error
        result = generator.generate(prompt, args.max_new_tokens, sampling=sampling)
        print(",".join(map(str, result.tokens)))
    else:
        for index, text in enumerate(args.prompt):
            if len(args.prompt) > 1:
                print(f"{'' if index == 0 else chr(10)}[{index + 1}/{len(args.prompt)}] {text}", flush=True)
            stream = lambda piece: print(piece, end="", flush=True)  # noqa: E731
            result = generator.generate(text, args.max_new_tokens, chat=args.chat, stream=stream, sampling=sampling)
            print()
            if not args.chat and not result.text.strip() and getattr(generator.tokenizer, "chat_template", None):
                # an instruct model given bare text often ends its reply at once
                print("hfexport: the reply is empty; the tokenizer has a chat template: try --chat", file=sys.stderr)
            if index < len(args.prompt) - 1:
                _print_figures(result)
    _print_figures(result)
    return 0


def _print_figures(result: Any) -> None:
    print(result.figures(), file=sys.stderr)
    if result.stop == "cache full":
        print(
            f"stopped: the prompt and the answer filled the export's cache "
            f"({result.prompt_tokens + len(result.tokens)} tokens); export again with a larger --max-cache-len "
            "for a longer answer",
            file=sys.stderr,
        )


def _passes(args: argparse.Namespace) -> int:
    from hfexport.pipeline.pass_manager import registered_passes

    if args.format is None:
        passes = registered_passes()
        width = max(map(len, passes))
        for name, pass_ in passes.items():
            print(f"{name:<{width}}  [{pass_.stage}]  {pass_.description}")
        return 0
    from hfexport.auto import AutoHfExporter
    from hfexport.pipeline.pipeline import PassStage
    from hfexport.targets import Target, get_target

    config = Target.load_class(get_target(args.format).config_class)()
    pipeline = AutoHfExporter.from_config(config).build_pipeline(config)
    print(f"{args.format}: {' → '.join(stage.name for stage in pipeline.stages)}  (default config)")
    for stage in pipeline.stages:
        if not isinstance(stage, PassStage):
            print(f"{stage.name}")
            continue
        print(f"{stage.name}:")
        width = max((len(name) for name in stage.manager.names), default=0)
        for index, pass_ in enumerate(stage.manager.passes):
            print(f"  {index:2d}. {pass_.name:<{width}}  {pass_.description}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from hfexport.pipeline.artifacts import artifact_kind
    from hfexport.pipeline.pass_manager import PassManager
    from hfexport.targets import target_reading

    source = Path(args.program)
    target = target_reading(source)  # .pt2: an ExportedProgram; .onnx: an ONNX program; .edge.pt2: an edge program
    suffix = target.program_suffix or target.suffix
    out = Path(args.out) if args.out else None
    if out is not None and not out.name.endswith(suffix):
        raise ConfigError(f"--out {out}: the program read from {source.name} is saved as a {suffix} file")
    program = target.load_program(source, trust=args.trust_artifact)
    manager = PassManager(args.passes)
    applied = [name for name in (args.applied or "").split(",") if name]
    program = manager.run(program, applied, log=lambda line: print(line, file=sys.stderr))
    if out is not None:
        artifact_kind(program).save(program, out)
        print(f"wrote {out}")
    return 0


TRUST_HELP = (
    "load a .pt2 even if it holds pickled Python objects, which run code when loaded; only for a file "
    "from a source you trust (hfexport's own exports never need it)"
)


IMPORT_HELP = (
    "a Python module (dotted name) or .py file to import first, for the passes it registers with "
    "hfexport.register_pass (repeatable; its top level runs)"
)


def import_modules(specs: list[str]) -> None:
    """Import each of ``specs`` (a dotted module name or a ``.py`` path), so the passes they
    register can be named in ``--passes``."""
    import importlib
    import importlib.util

    for spec in specs:
        try:
            if spec.endswith(".py"):
                path = Path(spec)
                if not path.is_file():
                    raise ConfigError(f"--import {spec}: no such file")
                found = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(found)
                sys.modules[path.stem] = module
                found.loader.exec_module(module)
            else:
                importlib.import_module(spec)
        except ConfigError:
            raise
        except Exception as error:
            raise ConfigError(f"--import {spec} failed: {type(error).__name__}: {error}") from error


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, as every other hfexport error (``--help``
    shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"hfexport: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hfexport", description="Export transformers models through a staged pipeline.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="export a model (a built-in tiny preset or a local folder)")
    export.add_argument(
        "model",
        help="a preset (tiny-llama, tiny-qwen3, ...), a packaged checkpoint (smollm2-135m-instruct, "
        "all-minilm-l6-v2), a folder written by save_pretrained, or a .gguf file",
    )
    export.add_argument(
        "--task",
        choices=list(TASKS),
        metavar="TASK",
        help="what the model is exported for, which picks its class and sample inputs (default: inferred from "
        f"the checkpoint's architectures); one of {', '.join(TASKS)}",
    )
    export.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load a checkpoint that holds its own model code (auto_map), which runs when loaded",
    )
    export.add_argument(
        "--format",
        default="dynamo",
        help=f"the target, or several comma-separated from one capture ({', '.join(target_names())}; default dynamo)",
    )
    export.add_argument(
        "--out", required=True, help="output folder (the artifact and hfexport.json; one sub-folder per target)"
    )
    shapes = export.add_mutually_exclusive_group()
    shapes.add_argument("--dynamic", action="store_true", help="mark every input axis dynamic (the default)")
    shapes.add_argument(
        "--static", action="store_true", help="fix every input axis to the sample's shape (printed by the export)"
    )
    export.add_argument("--passes", help="comma-separated FX pass list replacing the backend default ('' for none)")
    export.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE", help=IMPORT_HELP)
    export.add_argument("--dump-dir", help="write per-stage / per-pass dumps and report.md here")
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the export already in --out (it is removed before the new one starts; without this "
        "flag a non-empty --out is refused)",
    )
    export.add_argument("--verify", action="store_true", help="check every stage against eager PyTorch")
    export.add_argument(
        "--quantize",
        help="weight quantization, onnx and executorch: int4 (4-bit weight groups; executorch also calls it "
        "8da4w) or int8 (int8 weights; 8da8w), activations quantized to int8 at run time; see the README",
    )
    export.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="the program's floating-point dtype; auto (default): the checkpoint's where the target runs it, "
        "else float32 (a bfloat16 checkpoint: ONNX Runtime's CPU provider and ExecuTorch's XNNPACK have no "
        "bfloat16 kernels)",
    )
    export.add_argument("--config", help="a JSON config file (keys of the backend's config); flags override it")
    export.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="sample batch size (default 2; 1 for a --generation export to executorch, whose programs take one row)",
    )
    export.add_argument("--seq", type=positive_int, default=8, help="sample sequence length (default 8)")
    export.add_argument(
        "--generation",
        action="store_true",
        help="export the generation components `hfexport generate` needs: a static-cache decode graph that "
        "takes the prompt too, and a prefill only where decode takes one token (implies --dynamic)",
    )
    export.add_argument(
        "--max-cache-len",
        type=positive_int,
        default=256,
        help="static cache length with --generation: the prompt and the answer together (a batch-1 ExecuTorch "
        "step reads only the filled slots; a program of several rows reads the whole cache each step)",
    )
    export.add_argument(
        "--spec-io",
        action="store_true",
        help="with --generation, give a decoder-only model's decode graph hfexport's own interface (the loop feeds "
        "its masks and token counters) instead of the runtime's (onnx: ONNX Runtime GenAI's, with a "
        "genai_config.json; executorch: the LLM runner's forward(tokens, input_pos)); hfexport generate runs either",
    )
    export.add_argument(
        "--components",
        help="with --generation, the comma-separated components to export (default: all but a decoder-only "
        "model's prefill when its decode takes the prompt; e.g. prefill,decode)",
    )
    export.set_defaults(run=_export)

    generate = commands.add_parser(
        "generate", help="greedy text generation with an export folder (streams the text, then one line of figures)"
    )
    generate.add_argument("export_dir", help="a folder written by `hfexport export ... --generation`")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        action="append",
        help="the prompt text (tokenised with the export's tokenizer); give it again for several prompts, answered "
        "one after another",
    )
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    prompt.add_argument(
        "--audio",
        help="a PCM WAV file for a speech model (Whisper), through the export's feature extractor; prints the "
        "token ids, then the text when the export has a tokenizer",
    )
    generate.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to --prompt")
    generate.add_argument(
        "--max-new-tokens",
        type=positive_int,
        help="stop after this many new tokens (default: at an end-of-sequence token or when the static cache is full)",
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample each token from the logits divided by this (default 0: greedy, the argmax)",
    )
    generate.add_argument("--top-k", type=positive_int, help="with --temperature, sample among the k likeliest tokens")
    generate.add_argument(
        "--top-p", type=float, help="with --temperature, sample among the likeliest tokens whose probability reaches p"
    )
    generate.add_argument("--seed", type=int, help="with --temperature, the random seed (repeatable answers)")
    generate.add_argument("--trust-artifact", action="store_true", help=TRUST_HELP)
    generate.set_defaults(run=_generate)

    passes = commands.add_parser("passes", help="list the registered passes, or a target's stages and default passes")
    passes.add_argument(
        "--format",
        help="list this target's stages in order, each pass stage with its default passes (a config's passes)",
    )
    passes.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE", help=IMPORT_HELP)
    passes.set_defaults(run=_passes)

    replay = commands.add_parser(
        "replay", help="run passes on a saved .pt2 or .onnx (e.g. a failing pass's dumped input)"
    )
    replay.add_argument(
        "program",
        help="a .pt2 (an ExportedProgram, for FX passes) or an .onnx (an ONNX program, for ONNX-level passes); an "
        ".onnx file is protobuf data, which runs no code when read",
    )
    replay.add_argument("--passes", required=True, help="comma-separated pass names")
    replay.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE", help=IMPORT_HELP)
    replay.add_argument("--out", help="save the resulting program here (the suffix of the program read)")
    replay.add_argument("--applied", help="comma-separated passes that already ran on the program (for error messages)")
    replay.add_argument("--trust-artifact", action="store_true", help=TRUST_HELP)
    replay.set_defaults(run=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    # torch's CPU allocator backs tensors of 2 MB and more with transparent huge pages (the command
    # line's own process: a library leaves a user's process alone). An export allocates its
    # weights' size many times over (each eager check of a model stored in bfloat16 converts
    # every weight again): converting 1.3 GB of bfloat16 to float32 three times took 4.0 s of
    # CPU with 4 KB pages and 1.0 s with huge pages, on this machine.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # Python's cyclic garbage collector runs a young-generation pass every 700 allocations net,
    # and torch.export, FX and onnx_ir allocate millions of objects that live for the whole export
    # (graphs, nodes, metadata), which each pass and the full ones re-scan: a Llama-3.2-1B-shaped
    # ONNX export spent 2.05 CPU seconds in 2,029 collections, 0.37 in 12 with a pass every
    # 100,000, at the same peak RSS. Cycles are still collected, less often; an in-process caller
    # gets its own thresholds back.
    thresholds = gc.get_threshold()
    gc.set_threshold(100_000)
    try:
        return _main(argv)
    finally:
        gc.set_threshold(*thresholds)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        with quiet_loggers(*TORCHAO_LOGGERS), Interrupts.recorded():  # torchao: imported by transformers
            import_modules(getattr(args, "imports", []))
            return args.run(args)
    except (HfExportError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as error:
        if args.debug:
            raise
        # one line: torch's text that some messages carry (a capture failure's suggestions) is in
        # the --debug output
        lines = str(error).strip().splitlines() or [""]
        more = " (rerun with --debug for the full message)" if len(lines) > 1 else ""
        print(f"hfexport: error: {lines[0]}{more}", file=sys.stderr)
        for note in getattr(error, "__notes__", ()):
            print(f"hfexport: {note}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # an export is staged and moved into --out only when complete: nothing partial is left
        print("hfexport: interrupted; nothing from this run was written", file=sys.stderr)
        return 130
    except Exception as error:  # anything hfexport did not anticipate: still one line, unless --debug
        if args.debug:
            raise
        first = str(error).strip().splitlines()[0][:500] if str(error).strip() else ""
        print(
            f"hfexport: error: {type(error).__name__}: {first} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
