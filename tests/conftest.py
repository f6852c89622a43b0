import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)


@pytest.fixture
def hfexport_logs(caplog):
    caplog.set_level(logging.WARNING, logger="hfexport")
    return caplog
