"""MkDocs hook: the benchmark history page (``benchmarks/history.md``), read at build time from
``benchmarks/results/HISTORY.md``, which stays the data. Its links point into
``benchmarks/results/``, outside the site, so they become paths in code spans."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

PAGE = "benchmarks/history.md"
SOURCE = Path("benchmarks/results/HISTORY.md")


def as_paths(text: str, base: str) -> str:
    """Each relative Markdown link ``[text](path)`` as the path from the repository root in a code
    span (after the text when the text is not that path)."""

    def path(match: re.Match[str]) -> str:
        label, target = match.groups()
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        full = f"`{base}/{target}`"
        return full if label.strip("`") in (f"{base}/{target}", target) else f"{label} ({full})"

    return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)", path, text)


def on_files(files: Files, config: Any) -> Files:
    root = Path(config.config_file_path).parent
    text = (root / SOURCE).read_text()
    files.append(File.generated(config, PAGE, content=as_paths(text, SOURCE.parent.as_posix())))
    return files
