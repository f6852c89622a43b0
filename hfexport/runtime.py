"""Load and run exported artifacts on their runtimes."""

from __future__ import annotations

from pathlib import Path

import torch


def load_exported_program(path: str | Path) -> torch.export.ExportedProgram:
    """``torch.export.load`` after registering what a transformers program's inputs and outputs
    are made of (``ModelOutput`` classes and the cache classes), so it works in a fresh process."""
    import transformers.modeling_outputs  # noqa: F401  (registers the ModelOutput pytree nodes)

    from hfexport.pipeline.pytree import register_cache_pytrees

    register_cache_pytrees()
    return torch.export.load(path)
