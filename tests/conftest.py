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
