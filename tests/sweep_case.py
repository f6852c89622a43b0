"""The coverage sweep's case code (``benchmarks/coverage.py``), run in the test process: what the
fixed-sample tests of ``tests/e2e/test_coverage_*.py`` share."""

import importlib.util
import queue
from pathlib import Path

# by path: the name "coverage" is also coverage.py's package
_spec = importlib.util.spec_from_file_location(
    "hfexport_coverage_sweep", Path(__file__).resolve().parent.parent / "benchmarks" / "coverage.py"
)
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)


def run_case(
    model_type: str, targets: tuple[str, ...] = coverage.TARGETS, generation: tuple[str, ...] = ()
) -> dict[str, dict]:
    """The sweep's case in this process: ``{target: row}`` (``"eager"`` included); ``generation``:
    the ``generate:<target>`` cases to run too."""
    results = queue.Queue()
    coverage.run_case(model_type, list(targets), [], list(generation), results)
    rows = {}
    while not results.empty():
        row = results.get_nowait()
        rows[row["target"]] = row
    return rows
