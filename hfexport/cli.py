"""The ``hfexport`` command: ``export``, ``passes``, ``replay``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hfexport.errors import HfExportError


def _export(args: argparse.Namespace) -> int:
    from hfexport.auto import AutoExportConfig, AutoHfExporter
    from hfexport.pipeline.artifacts import artifact_kind
    from hfexport.pipeline.instruments import ProgressInstrument
    from hfexport.pipeline.pipeline import stage_table
    from hfexport.presets import load_model, sample_inputs

    settings = json.loads(Path(args.config).read_text()) if args.config else {}
    settings["export_format"] = args.format
    for key in ("dynamic", "verify"):
        if getattr(args, key):
            settings[key] = True
    if args.passes is not None:
        settings["passes"] = args.passes
    if args.dump_dir:
        settings["dump_dir"] = args.dump_dir
    config = AutoExportConfig.from_dict(settings)
    exporter = AutoHfExporter.from_config(config)

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model = load_model(args.model)
    inputs = sample_inputs(model, args.batch, args.seq)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.generation:
        return _export_for_generation(exporter, model, inputs, config, args, out)
    result = exporter.run(model, inputs, config, instruments=(ProgressInstrument(),))

    kind = artifact_kind(result.program)
    path = out / f"model{kind.suffix}"
    kind.save(result.program, path)
    print(stage_table(result.records))
    print(f"\nwrote {path}" + (f"; dumps and report.md in {config.dump_dir}" if config.dump_dir else ""))
    return 0


def _export_for_generation(
    exporter: Any, model: Any, inputs: dict[str, Any], config: Any, args: argparse.Namespace, out: Path
) -> int:
    from transformers import GenerationConfig

    from hfexport.pipeline.artifacts import artifact_kind

    generation_config = GenerationConfig(cache_implementation="static", max_cache_len=args.max_cache_len)
    programs = exporter.export_for_generation(model, inputs, config, generation_config, multi_token_decode=True)
    for name, program in programs.items():
        kind = artifact_kind(program)
        kind.save(program, out / f"{name}{kind.suffix}")
        print(f"wrote {out / (name + kind.suffix)}")
    manifest = {"format": config.export_format, "components": sorted(programs), "max_cache_len": args.max_cache_len}
    (out / "generation.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from hfexport import runtime

    folder = Path(args.export_dir)
    manifest_path = folder / "generation.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{manifest_path} not found; export with `hfexport export MODEL --generation --out DIR`"
        )
    export_format = json.loads(manifest_path.read_text())["format"]
    if export_format == "dynamo":
        decoder = runtime.DynamoDecoder(runtime.load_exported_program(folder / "decode.pt2"), batch_size=1)
    elif export_format == "onnx":
        decoder = runtime.OnnxDecoder(folder / "decode.onnx", batch_size=1)
    else:
        decoder = runtime.ExecutorchDecoder(folder / "decode.pte", batch_size=1)
    prompt = torch.tensor([[int(token) for token in args.prompt_ids.split(",")]])
    tokens = runtime.greedy_decode(decoder, prompt, args.max_new_tokens, decoder.max_cache_len)
    print(",".join(str(t) for t in tokens[0, prompt.shape[1] :].tolist()))
    return 0


def _passes(args: argparse.Namespace) -> int:
    from hfexport.pipeline.pass_manager import registered_passes

    passes = registered_passes()
    width = max(map(len, passes))
    for name, pass_ in passes.items():
        print(f"{name:<{width}}  [{pass_.stage}]  {pass_.description}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    import torch

    from hfexport.pipeline.pass_manager import PassManager
    from hfexport.runtime import load_exported_program

    program = load_exported_program(args.program)
    manager = PassManager(args.passes)
    program = manager.run(program, log=lambda line: print(line, file=sys.stderr))
    if args.out:
        torch.export.save(program, args.out)
        print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hfexport.auto import BACKENDS

    parser = argparse.ArgumentParser(
        prog="hfexport", description="Export transformers models through a staged pipeline."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    export = commands.add_parser("export", help="export a model (a built-in tiny preset or a local folder)")
    export.add_argument("model", help="a preset (tiny-llama, tiny-qwen3, ...) or a folder written by save_pretrained")
    export.add_argument("--format", default="dynamo", choices=sorted(BACKENDS), help="the target (default: dynamo)")
    export.add_argument("--out", required=True, help="output folder for model.<pt2|onnx|pte>")
    export.add_argument("--dynamic", action="store_true", help="mark every input axis dynamic")
    export.add_argument("--passes", help="comma-separated FX pass list replacing the backend default ('' for none)")
    export.add_argument("--dump-dir", help="write per-stage / per-pass dumps and report.md here")
    export.add_argument("--verify", action="store_true", help="check every stage against eager PyTorch")
    export.add_argument("--config", help="a JSON config file (keys of the backend's config); flags override it")
    export.add_argument("--batch", type=int, default=2, help="sample batch size (default 2)")
    export.add_argument("--seq", type=int, default=8, help="sample sequence length (default 8)")
    export.add_argument("--generation", action="store_true", help="export prefill and a static-cache decode graph")
    export.add_argument("--max-cache-len", type=int, default=64, help="static cache length with --generation")
    export.set_defaults(run=_export)

    generate = commands.add_parser("generate", help="greedy decoding with an exported decode graph")
    generate.add_argument("export_dir", help="a folder written by `hfexport export ... --generation`")
    generate.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids")
    generate.add_argument("--max-new-tokens", type=int, default=16)
    generate.set_defaults(run=_generate)

    passes = commands.add_parser("passes", help="list the registered passes")
    passes.set_defaults(run=_passes)

    replay = commands.add_parser("replay", help="run passes on a saved .pt2 (e.g. a failing pass's dumped input)")
    replay.add_argument("program", help="a .pt2 file")
    replay.add_argument("--passes", required=True, help="comma-separated pass names")
    replay.add_argument("--out", help="save the resulting program here")
    replay.set_defaults(run=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.run(args)
    except (HfExportError, FileNotFoundError) as error:
        print(f"hfexport: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
