import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# under `make test` two pytest-xdist workers share the two cores: one thread each
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture
def calls_counted(monkeypatch):
    """``calls_counted(owner, name)``: the calls of ``owner.name`` from then on, an entry each
    (the function still runs)."""

    def counted_calls(owner, name: str) -> list:
        calls = []
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
        return calls

    return counted_calls


@pytest.fixture
def hfexport_logs(caplog):
    caplog.set_level(logging.WARNING, logger="hfexport")
    return caplog


@pytest.fixture(scope="session")
def checkpoint(request):
    """``checkpoint(name)``: the local folder of a packaged real checkpoint, converted once and kept
    in pytest's cache folder across runs."""
    from hfexport.checkpoints import checkpoint_folder

    cache = request.config.cache.mkdir("hfexport-checkpoints")
    return lambda name: checkpoint_folder(name, cache)
