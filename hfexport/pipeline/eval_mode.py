"""Eval mode: the user's model runs (eagerly or under torch.export) with every module in eval mode
and gradients off, and each module's training flag is restored afterwards."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger("hfexport")


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run with every module in eval mode and gradients off; restore each module's flag after."""
    flags = [(m, m.training) for m in model.modules()]
    if model.training:
        logger.warning(
            "%s is in training mode; exporting it in eval mode (dropout off). Call model.eval() to silence this.",
            type(model).__name__,
        )
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, flag in flags:
            module.training = flag
