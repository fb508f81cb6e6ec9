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


def pytest_collection_modifyitems(config, items):
    """Collect only the checks that can run here: no frozen-BatchNorm check for models
    without BatchNorm, and under the ``threads`` executor only ``suite.THREADS_CHECKS``
    (deselected, not skipped: nothing about this machine could make them run)."""
    from .suite import THREADS_CHECKS
    from .zoo import NO_BATCHNORM

    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        model = params.get("model")
        name = getattr(model, "name", None) or (model[0].name if isinstance(model, tuple) else None)
        options = params.get("lockstep")
        test = item.originalname
        if test == "test_frozen_batchnorm" and name in NO_BATCHNORM:
            drop.append(item)
        elif options == "threads" and test not in THREADS_CHECKS:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    """Per model and options, which paths the calls ran (``streamsched.testing.last_path``):
    a model whose calls never ran the plan is run as written, not scheduled."""
    from .checks import PATHS_SEEN

    if not PATHS_SEEN:
        return
    terminalreporter.section("paths the wrapped calls ran")
    for (model, options), counts in sorted(PATHS_SEEN.items()):
        scheduled = any(p.startswith("plan:") or p == "graph" for p in counts)
        paths = ", ".join(f"{p} {n}" for p, n in sorted(counts.items()))
        terminalreporter.write_line(f"{model} [{options}]: {paths}{'' if scheduled else '  (never scheduled)'}")
