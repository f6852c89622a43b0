"""Reading a program file without running code from it: ``torch.load`` (under ``torch.export.load``
and ExecuTorch's edge-program reader) falls back to full unpickling, which runs any code a file
holds, when loading tensors only fails. Inside :func:`weights_only_loads` it cannot fall back, and
:func:`refused` turns the error into one line naming what the file holds."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from hfexport.errors import ArtifactError

# torch.export.load tries weights_only and falls back to full unpickling on failure
# (pytorch/pytorch#153410; its weights_only parameter, pytorch/pytorch#191149, is not in 2.13):
# forcing weights-only loads through this variable, which torch.load reads at every call
# (torch/serialization.py), turns the fallback into an UnpicklingError. The lock keeps two loads
# in two threads from restoring each other's value
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_LOCK = threading.Lock()


@contextlib.contextmanager
def weights_only_loads(trust: bool) -> Iterator[None]:
    """Every ``torch.load`` inside loads tensors and plain containers only (``trust``: no limit);
    one such block at a time per process, since the switch is an environment variable."""
    if trust:
        yield
        return
    with _LOCK:
        previous = os.environ.get(_FORCE_WEIGHTS_ONLY)
        os.environ[_FORCE_WEIGHTS_ONLY] = "1"
        try:
            yield
        finally:
            if previous is None:
                del os.environ[_FORCE_WEIGHTS_ONLY]
            else:
                os.environ[_FORCE_WEIGHTS_ONLY] = previous


def refused(path: Path, error: pickle.UnpicklingError) -> ArtifactError:
    """The error for a file whose loading needed more than tensors."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    what = f" ({found.group(1)})" if found else ""
    return ArtifactError(
        f"{path} holds pickled Python objects{what} beyond tensors and the types hfexport writes, and "
        "loading them could run code from the file; hfexport refused. If you trust the file's source, "
        "load it with trust=True (command line: --trust-artifact)"
    )
