"""MkDocs hook: the pass catalogue (``passes.md``), generated from the pass registry at build time.

Every registered pass gets an entry: its name, its stage, the targets whose default pass list names
it, its ordering constraints and its docstring (what it rewrites, and when to leave it out). A
renamed or removed pass therefore changes the page, and a link to its old anchor fails the strict
build.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

PAGE = "passes.md"
log = logging.getLogger("mkdocs.hooks.passes")


def target_names() -> list[str]:
    """The registered targets, in registry order."""
    from hfexport.targets import TARGETS

    return list(TARGETS)


def default_pass_names(target_name: str) -> list[str]:
    """The names in ``target_name``'s default pass list, all its pass stages in pipeline order
    (the target keeps it beside its passes: ``hfexport/targets/<target>/passes/``)."""
    from hfexport import get_target

    return list(get_target(target_name).default_passes)


def docstring(pass_: Any) -> str:
    """What the pass says about itself: a function pass's function's docstring, else the instance's
    or its class's, else its one-line description."""
    fn = getattr(pass_, "fn", None)
    doc = inspect.getdoc(fn) if fn is not None else inspect.getdoc(pass_)
    return doc or pass_.description or "(no description)"


def defined_in(pass_: Any) -> str | None:
    """The module that defines the pass, when it is not the pipeline's generic machinery."""
    owner = getattr(pass_, "fn", None) or type(pass_)
    module = getattr(owner, "__module__", "") or ""
    return None if module.startswith("hfexport.pipeline") else module


def markdown(text: str) -> str:
    """reStructuredText-isms of the docstrings as Markdown."""
    role = r":(?:class|func|meth|mod|data|attr|obj):`~?([^`]+)`"
    text = re.sub(role, lambda match: f"`{match.group(1).split('.')[-1]}`", text)
    text = text.replace("``", "`")
    return "\n".join(line.strip() for line in text.splitlines())


def catalogue() -> str:
    import hfexport  # noqa: F401  (registers the built-in passes)
    from hfexport.pipeline.pass_manager import registered_passes

    defaults = {name: default_pass_names(name) for name in target_names()}  # imports each target's passes
    passes = registered_passes()
    lines = [
        "# Pass catalogue",
        "",
        "Generated from the pass registry when the documentation is built (`hfexport passes` prints the",
        "same list). A pass list names passes by these names: a config's `passes`, `--passes` on the",
        "command line, `pipeline.passes`, the dump folders and `hfexport replay`. How to edit a list is in",
        "the [Python guide](guide/python.md#pass-lists).",
        "",
        "## Default pass lists",
        "",
        "Each target's default list, in the order the passes run. Quantization passes are appended by a",
        "config's `quantize`; `OnnxConfig(optimize=False)` leaves the ONNX optimizations out.",
        "",
    ]
    for target, names in defaults.items():
        lines += [f"### {target} {{#{target}}}", ""]
        for index, name in enumerate(names, 1):
            stage = passes[name].stage if name in passes else "?"
            lines.append(f"{index}. [`{name}`](#{name}) (`{stage}`)")
        lines.append("")
    lines += ["## Passes", ""]
    for name, pass_ in passes.items():
        listed = [target for target, names in defaults.items() if name in names]
        on = ", ".join(f"[{target}](#{target})" for target in listed) or "no target (add it to a list)"
        facts = [f"- **Stage:** `{pass_.stage}`", f"- **Default on:** {on}"]
        if pass_.runs_after:
            facts.append("- **Runs after:** " + ", ".join(f"`{n}`" for n in pass_.runs_after))
        if pass_.runs_before:
            facts.append("- **Runs before:** " + ", ".join(f"`{n}`" for n in pass_.runs_before))
        if pass_.remove_when:
            facts.append(f"- **Leave it out:** {pass_.remove_when}")
        if module := defined_in(pass_):
            facts.append(f"- **Defined in:** `{module}`")
        lines += [f"### `{name}` {{#{name}}}", "", *facts, "", markdown(docstring(pass_)), ""]
    return "\n".join(lines)


def on_files(files: Files, config: Any) -> Files:
    # the checkout being documented, ahead of any installed copy of hfexport
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    with warnings.catch_warnings():  # the backends' own deprecation warnings on import: not the docs'
        warnings.simplefilter("ignore", DeprecationWarning)
        content = catalogue()
    import hfexport

    log.info("pass catalogue: %d passes, from %s", content.count("\n### `"), Path(hfexport.__file__).parent)
    files.append(File.generated(config, PAGE, content=content))
    return files
