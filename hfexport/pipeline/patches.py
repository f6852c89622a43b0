"""Registry of reversible patches: the only place hfexport replaces an attribute of another package.

A patch replaces one attribute (a torch or transformers function, a module-level table) for the
duration of one *scope* to work around an upstream bug that cannot be fixed on the graph
afterwards, or to observe a run:

- ``"capture"``: around ``torch.export`` (:func:`hfexport.pipeline.capture.capture`);
- ``"generate"``: around the ``model.generate`` run of the generation decomposition;
- ``"to_onnx"``: around ``torch.onnx.export`` in the ONNX lowering
  (:func:`hfexport.targets.onnx.lowering.to_onnx`);
- ``"to_edge"``: around ExecuTorch's edge conversion (:func:`hfexport.targets.executorch.lowering.to_edge`);
- ``"delegate"``: around ExecuTorch's delegation (:func:`hfexport.targets.executorch.lowering.delegate`);
- ``"to_executorch"``: around ExecuTorch's emission and serialization
  (:func:`hfexport.targets.executorch.lowering.to_executorch`).

Each patch carries its reason and the upstream issue. :func:`patches_applied` restores every
target on every path, errors included. A workaround that can be done on the graph is a pass, not
a patch. The registry knows no model: the patches themselves are registered by
:mod:`hfexport.models.patches` (those of the lowerings' scopes by the lowerings).

Patches are process-global, and so is the state ``torch.export`` keeps while it traces (its
dispatch-mode stack: two captures in two threads fail with "Trying to pop empty mode stack"). So
exports in one process run one at a time: :data:`EXPORT_LOCK` (reentrant) is held by every
pipeline run and every :func:`patches_applied` block, and an export started in another thread
waits for it.
"""

from __future__ import annotations

import builtins
import contextlib
import fnmatch
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hfexport.errors import ConfigError

_MISSING = object()
SCOPES = ("capture", "generate", "to_onnx", "onnx_passes", "to_edge", "delegate", "to_executorch")
EXPORT_LOCK = threading.RLock()


@dataclass(frozen=True)
class Patch:
    """Replace ``target`` by ``make(original)`` while its ``scope`` is active.

    ``target`` is ``"package.module:Owner.attribute"``. A module part with a ``*``
    (``"transformers.models.*.modeling_*:helper"``) names every module already imported that
    matches it and has the attribute: a modeling file that was never imported defines no model
    being exported, so nothing is imported to patch it. A module's attribute may be a builtin the
    module calls (``"package.module:bytes"``): a global of that name shadows it for the scope.
    """

    name: str
    target: str
    make: Callable[[Any], Any]
    reason: str
    upstream: str
    scope: str = "capture"

    def owners(self) -> list[tuple[Any, str]]:
        """Every ``(owner, attribute)`` this patch replaces (imports a plain module target)."""
        module_pattern, _, path = self.target.partition(":")
        *parents, attribute = path.split(".")
        if "*" in module_pattern:
            modules = [m for n, m in list(sys.modules.items()) if m is not None and fnmatch.fnmatch(n, module_pattern)]
        else:
            modules = [importlib.import_module(module_pattern)]
        found = []
        for owner in modules:
            for parent in parents:
                owner = getattr(owner, parent, None)
            if owner is not None and (hasattr(owner, attribute) or _shadows_a_builtin(owner, attribute)):
                found.append((owner, attribute))
        return found


def _shadows_a_builtin(owner: Any, attribute: str) -> bool:
    return isinstance(owner, types.ModuleType) and hasattr(builtins, attribute)


PATCHES: dict[str, Patch] = {}


def register_patch(target: str, *, name: str, reason: str, upstream: str, scope: str = "capture") -> Callable:
    """Decorator registering ``make(original) -> replacement`` as a patch of ``scope``."""
    if scope not in SCOPES:
        raise ConfigError(f"unknown patch scope {scope!r}; valid scopes: {', '.join(SCOPES)}")

    def register(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
        PATCHES[name] = Patch(name=name, target=target, make=make, reason=reason, upstream=upstream, scope=scope)
        return make

    return register


@contextlib.contextmanager
def patches_applied(names: list[str] | None = None, *, scope: str | None = "capture") -> Iterator[list[Patch]]:
    """Apply the named patches (by default every registered patch of ``scope``); restore them on exit."""
    if names is not None:
        unknown = sorted(set(names) - set(PATCHES))
        if unknown:
            raise ConfigError(f"unknown patch(es) {unknown}; registered patches: {', '.join(sorted(PATCHES))}")
        selected = [PATCHES[n] for n in names]
    else:
        selected = [p for p in PATCHES.values() if scope is None or p.scope == scope]
    applied: list[tuple[Any, str, Any]] = []
    with EXPORT_LOCK:
        try:
            for patch in selected:
                for owner, attribute in patch.owners():
                    # Read the owner's own __dict__ so a class attribute inherited from a base class is
                    # deleted (not shadowed) on restore, and descriptors come back unchanged.
                    original = vars(owner).get(attribute, _MISSING) if hasattr(owner, "__dict__") else _MISSING
                    current = getattr(owner, attribute) if hasattr(owner, attribute) else getattr(builtins, attribute)
                    setattr(owner, attribute, patch.make(current))
                    applied.append((owner, attribute, original))
            yield selected
        finally:
            for owner, attribute, original in reversed(applied):
                if original is _MISSING:
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, original)
