"""What the ``hfexport export`` command sets in its own process before torch loads, when the
package is imported: a library leaves a user's process alone, so nothing is set unless the process
was started as that command (``hfexport export …`` or ``python -m hfexport.cli export …``)."""

from __future__ import annotations

import os
import sys


def started_as_the_export_command(argv: list[str]) -> bool:
    """Whether ``argv`` (the interpreter's own, ``sys.orig_argv``) ran ``hfexport export``: the
    program the interpreter ran (after its own flags) is the ``hfexport`` script or ``-m
    hfexport.cli``, and its first argument is ``export``."""
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        rest = rest[1:]
    if rest[:1] == ["-m"]:
        program, rest = rest[1:2] in (["hfexport.cli"], ["hfexport"]), rest[2:]
    else:
        program, rest = bool(rest) and os.path.basename(rest[0]) == "hfexport", rest[1:]
    return program and rest[:1] == ["export"]


def set_before_torch_loads() -> None:
    """OpenMP's idle threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) unless the
    environment says otherwise. An export is mostly Python (tracing, graph rewriting) between
    short parallel kernels, after each of which GNU OpenMP's worker spun on a core: 2.2 of a
    Llama-3.2-1B-shaped ONNX export's 24 user CPU seconds, on this 2-core machine. libgomp reads
    the variable once, when torch loads it."""
    if "torch" not in sys.modules and started_as_the_export_command(list(getattr(sys, "orig_argv", sys.argv))):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


set_before_torch_loads()
