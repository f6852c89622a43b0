"""The README and the documentation site: every README example runs as written, the README stays
short, and the site builds in strict mode (a renamed pass, a broken link or anchor fails it)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 200

# Runs a page's python blocks in order in one namespace (a later block uses the model and the
# inputs of an earlier one), each compiled under its own name so a failure says which block broke.
RUNNER = """
import json, sys
blocks, page = json.load(open(sys.argv[1])), sys.argv[2]
namespace = {"__name__": "__example__"}
for line, source in blocks:
    print(f"--- {page}: block at line {line}", flush=True)
    exec(compile(source, f"{page} (python block at line {line})", "exec"), namespace)
print("--- all blocks ran")
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, source)`` of every fenced python block, ``line`` being the block's first line."""
    return [
        (text.count("\n", 0, match.start(1)) + 1, match.group(1))
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)
    ]


def run_python_blocks(text: str, folder: Path, page: str = "README.md") -> subprocess.CompletedProcess:
    """Run ``text``'s python blocks in a fresh interpreter with ``folder`` as the working directory
    (the examples write their dumps and export folders there), offline."""
    import json

    blocks = folder / "blocks.json"
    blocks.write_text(json.dumps(python_blocks(text)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", RUNNER, str(blocks), page],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move the details to docs/"


def test_readme_python_examples_run_as_written(tmp_path):
    text = README.read_text()
    assert len(python_blocks(text)) >= 2
    result = run_python_blocks(text, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--- all blocks ran" in result.stdout
    assert (tmp_path / "out" / "onnx" / "hfexport.json").is_file()
    assert (tmp_path / "dumps" / "report.md").is_file()


def test_a_broken_example_fails(tmp_path):
    """The check above can fail: a block that raises is reported with its README line."""
    text = "intro\n\n```python\nx = 1\n```\n\nmore\n\n```python\nassert x == 2, 'broken example'\n```\n"
    result = run_python_blocks(text, tmp_path)
    assert result.returncode != 0
    assert "python block at line 10" in result.stderr and "broken example" in result.stderr


DOC_PAGES_WITH_EXAMPLES = sorted(
    str(page.relative_to(ROOT)) for page in (ROOT / "docs").rglob("*.md") if "```python" in page.read_text()
)


@pytest.mark.slow
@pytest.mark.parametrize("page", DOC_PAGES_WITH_EXAMPLES)
def test_docs_python_examples_run_as_written(page, tmp_path):
    result = run_python_blocks((ROOT / page).read_text(), tmp_path, page)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed")
def test_docs_build_in_strict_mode(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    site = tmp_path / "site"
    catalogue = (site / "passes" / "index.html").read_text()
    # the built-in passes, from a fresh process (this one may hold passes other tests registered)
    listed = subprocess.run(
        [sys.executable, "-c", "import hfexport; print(*hfexport.registered_passes())"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert "dead_code_elimination" in listed
    missing = [name for name in listed if f'id="{name}"' not in catalogue]
    assert missing == [], f"passes missing from the catalogue: {missing}"
    assert "DynamoExporter" in (site / "api" / "exporters" / "index.html").read_text()
