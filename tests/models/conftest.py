"""The real-model suite runs in the second environment (``make test-models``), which has
timm and transformers; elsewhere its modules skip themselves at import. Nothing is
downloaded: every model is built from a configuration with random weights."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on a 2-core machine shared with other work, two OpenMP
    threads made calls up to ten times slower and the timings erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
