"""Loading what a user names as MODEL: a built-in preset, a packaged real checkpoint, a folder
written by ``save_pretrained``, or a ``.gguf`` file. hfexport never downloads: a Hub id that is
not a local folder is refused with one line saying how to get it."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from hfexport.errors import ConfigError

logger = logging.getLogger("hfexport")

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def model_folder(name_or_path: str) -> Path | None:
    """The checkpoint folder :func:`load_model` reads ``name_or_path`` from (``None`` for a preset);
    a ``.gguf`` file is converted once into a folder (:func:`hfexport.checkpoints.gguf_folder`)."""
    from hfexport.checkpoints import CHECKPOINTS, checkpoint_folder, gguf_folder
    from hfexport.presets import PRESETS

    if name_or_path in PRESETS:
        return None
    if name_or_path in CHECKPOINTS:
        return checkpoint_folder(name_or_path)
    if name_or_path.endswith(".gguf") and Path(name_or_path).is_file():
        return gguf_folder(name_or_path)
    folder = Path(name_or_path)
    if (folder / "config.json").is_file():
        return folder
    if not folder.exists() and _HUB_ID.match(name_or_path):
        raise ConfigError(
            f"{name_or_path!r} is not a local folder, and hfexport does not download from the Hub; on a machine "
            f"with network run `hf download {name_or_path} --local-dir DIR`, then pass DIR"
        )
    raise ConfigError(
        f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}), a packaged checkpoint "
        f"({', '.join(CHECKPOINTS)}), a .gguf file nor a folder holding a saved transformers model "
        "(config.json + weights, as written by save_pretrained)"
    )


def load_model(name_or_path: str, task: str | None = None, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model ``name_or_path`` names (see :func:`model_folder`), in eval mode, for ``task``
    (default: inferred from the checkpoint's ``architectures``, :mod:`hfexport.models.tasks`).

    Weights keep the checkpoint's dtype. Attention runs on SDPA where the model supports it, else
    on the model's own implementation (Mamba, ConvNeXt, ... have no SDPA path). A folder holding
    its own model code (``auto_map``) loads only with ``trust_remote_code``."""
    from hfexport.models.tasks import model_class
    from hfexport.presets import PRESETS

    if name_or_path in PRESETS:
        if task is not None:
            raise ConfigError(f"--task applies to checkpoint folders; the preset {name_or_path!r} is built as it is")
        return PRESETS[name_or_path].build()
    folder = model_folder(name_or_path)
    remote_code = bool(json.loads((folder / "config.json").read_text()).get("auto_map"))
    if remote_code and not trust_remote_code:
        raise ConfigError(
            f"{folder} holds its own model code (auto_map in config.json), which runs when loaded; pass "
            "--trust-remote-code (trust_remote_code=True) if you trust its source"
        )
    import transformers
    from transformers.utils import logging as transformers_logging

    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    loader = model_class(config, task, remote_code=remote_code)
    options: dict[str, Any] = {"trust_remote_code": True} if remote_code else {}
    if _supports_sdpa(loader, config):
        options["attn_implementation"] = "sdpa"
    # the command line prints one line per step: transformers' "Loading weights" bar would land
    # between them (its own switch, restored after)
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        model, info = loader.from_pretrained(folder, output_loading_info=True, **options)
    finally:
        if shown:
            transformers_logging.enable_progress_bar()
    _check_every_weight_loaded(model, info, folder, config)
    return model.eval()


def _check_every_weight_loaded(model: torch.nn.Module, info: dict[str, Any], folder: Path, config: Any) -> None:
    """Refuse a model whose weights did not all come from the checkpoint: transformers initialises
    the missing ones at random (and only logs it), and the export would carry them silently."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(key for key, *_ in info.get("mismatched_keys") or ())
    if not missing and not mismatched:
        return
    names = missing or mismatched
    shown = ", ".join(names[:3]) + (f", … ({len(names)} in all)" if len(names) > 3 else "")
    what = "are not in the checkpoint" if missing else "have another shape in the checkpoint"
    saved = getattr(config, "architectures", None) or ["(not recorded)"]
    raise ConfigError(
        f"{folder}: weights of {type(model).__name__} {what} ({shown}) and would be random in the export; "
        f"the checkpoint was saved from {', '.join(saved)}: pick the task it was saved for with --task, "
        "or check that the folder's weights belong to its config.json"
    )


def _supports_sdpa(loader: Any, config: Any) -> bool:
    """Whether the class ``loader`` names (an auto class resolved through ``config``) has an SDPA path."""
    if loader.__name__.startswith("AutoModel"):
        mapping = getattr(loader, "_model_mapping", None)
        try:
            loader = mapping[type(config)] if mapping is not None else None
        except KeyError:
            return False
        if loader is None:
            return False
    return bool(getattr(loader, "_supports_sdpa", False))
