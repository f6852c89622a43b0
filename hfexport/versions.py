"""The tested stack, and a one-time warning when the installed one drifts from it.

The pins live in one place, ``pyproject.toml`` (``dependencies`` and the ``onnx`` / ``executorch``
extras). At runtime they are read back from the installed package's metadata, or from the
``pyproject.toml`` next to the package when running from a source tree.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

logger = logging.getLogger("hfexport")
_checked = False

# torchao (imported by executorch and by the quantization passes) logs a warning for each optional
# CUDA kernel library it cannot load on a CPU machine, and registers enums torch's pytree warns about
TORCHAO_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Only errors from these loggers (the root logger when none is named) while the block runs,
    and their handlers restored afterwards."""
    loggers = [logging.getLogger(name) for name in names] or [logging.getLogger()]
    saved = [(logger, list(logger.handlers), logger.level) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, handlers, level in saved:
            logger.handlers[:] = handlers
            logger.setLevel(level)


def tested_requirements() -> list[Requirement]:
    """The pinned requirements of hfexport and its backend extras (excluding tooling extras)."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text())["project"]
        lines = list(project["dependencies"])
        for extra in ("onnx", "executorch"):
            lines += project["optional-dependencies"].get(extra, [])
    else:
        lines = [
            line.split(";")[0]
            for line in importlib.metadata.requires("hfexport") or []
            if "extra ==" not in line or any(f'extra == "{e}"' in line for e in ("onnx", "executorch"))
        ]
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.specifier]


def version_drift() -> list[str]:
    """Descriptions of installed packages whose version is outside the tested pins."""
    drift = []
    for requirement in tested_requirements():
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a backend that is not installed is checked when it is imported
        # torch's local version label (+cpu) does not change its API.
        if Version(Version(installed).base_version) not in requirement.specifier:
            drift.append(f"{requirement.name} {installed} (tested: {requirement.specifier})")
    return drift


def warn_on_version_drift() -> None:
    """Log one warning per process if the installed stack differs from the tested one."""
    global _checked
    if _checked:
        return
    _checked = True
    drift = version_drift()
    if drift:
        logger.warning(
            "hfexport is tested against a pinned stack; these installed versions differ: %s. "
            "Exports may fail or differ; install the pinned versions (pip install 'hfexport[all]').",
            ", ".join(drift),
        )


def require_backend(extra: str, modules: tuple[str, ...]) -> None:
    """Raise an :class:`~hfexport.errors.ConfigError` naming the pip extra when a backend
    package is missing."""
    import importlib.util

    from hfexport.errors import ConfigError

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"the {extra} backend needs {', '.join(missing)}, which is not installed; "
            f"install it with: pip install 'hfexport[{extra}]'"
        )
