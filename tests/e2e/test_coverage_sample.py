"""The coverage sweep's fixed sample: a few architectures of every kind, each built as the sweep
builds it (a tiny random model from its config, config-made inputs), exported to every target from
one capture and compared with eager on two shapes by the sweep's own case code
(``benchmarks/coverage.py``; ``make coverage`` runs every type)."""

import importlib.util
import queue
from pathlib import Path

import pytest

# by path: the name "coverage" is also coverage.py's package
_spec = importlib.util.spec_from_file_location(
    "hfexport_coverage_sweep", Path(__file__).resolve().parents[2] / "benchmarks" / "coverage.py"
)
coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coverage)

SAMPLE = {
    "gpt2": "decoder LM",
    "bert": "encoder",
    "t5": "encoder-decoder",
    "convnext": "vision",  # no text embedding table: failed before tracing until the frontend asked defensively
    "hubert": "audio",  # 1-D convolutions over a dynamic batch and length (dynamic_conv1d_as_conv2d)
    "clip": "multimodal",
    "mamba": "SSM / hybrid",
}
# Mamba's sequential scan is a Python loop over the sequence: the program takes the sample's length
# only, and a second length is refused by name (not run to a wrong answer)
FIXED_LENGTH = {"mamba"}


@pytest.mark.parametrize("model_type", list(SAMPLE))
def test_every_target_matches_eager_on_two_shapes(model_type):
    results = queue.Queue()
    coverage.run_case(model_type, list(coverage.TARGETS), [], results)
    rows = {}
    while not results.empty():
        row = results.get_nowait()
        rows[row["target"]] = row
    assert rows["eager"]["status"] == "ok" and rows["eager"]["kind"] == SAMPLE[model_type]
    found = {t: (rows[t]["status"], rows[t].get("cause"), rows[t].get("diff")) for t in coverage.TARGETS}
    for target, (status, cause, _) in found.items():
        if model_type in FIXED_LENGTH and status == "second_shape_error":
            assert "static size" in cause and rows[target]["diff"] <= coverage.TOLERANCE[target], found
        else:
            assert status == "pass", found
