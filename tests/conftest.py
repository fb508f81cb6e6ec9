import os
import random

import pytest
import torch

# Hypothesis: deterministic, and no deadline (the machines are shared and noisy).
try:
    from hypothesis import settings

    settings.register_profile("ci", deadline=None, derandomize=True, max_examples=25)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass

# A real GPU runs the `cuda`-marked tests on itself; without one they run on the emulated
# device (streamsched.emulated_cuda), except those also marked `gpu` (timings, peak memory,
# the native CUDA backend, several processes): only real hardware can show those.
REAL_GPU = torch.cuda.is_available()


def _test_shapes_gpu_model():
    from streamsched.ir.cost import DeviceModel

    # Throughputs far below a GPU's: kernels of test shapes weigh, relative to a launch,
    # what large ones do on a real GPU.
    return DeviceModel("cuda", flops_per_us=2.0e4, bytes_per_us=4.0e3, launch_us=1.0)


TEST_SHAPES_GPU_MODEL = _test_shapes_gpu_model()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs real CUDA hardware (timings, peak memory, native CUDA backend); skipped when emulated"
    )
    config.addinivalue_line(
        "markers",
        "emulated_async: on the emulated device, run in its asynchronous mode (kernels queued per stream, "
        "run at synchronisation points in a random order the waits allow)",
    )


def pytest_runtest_logreport(report):
    """With ``STREAMSCHED_FAILURES_AT_ONCE=1`` (the GPU check's stages), a failure's
    traceback is printed when it happens, not at the end of the run: a stage cut by its
    time budget still shows why each test failed (the first GPU runs lost them so)."""
    if not report.failed or os.environ.get("STREAMSCHED_FAILURES_AT_ONCE") != "1":
        return
    import sys

    # What the test wrote to stderr too: the stream sanitizer prints its race report there
    # (both accesses' stacks) and raises an error that names only their count.
    err = f"captured stderr:\n{report.capstderr}" if report.capstderr else ""
    sys.__stderr__.write(f"\n--- {report.nodeid} failed ({report.when}) ---\n{report.longreprtext}\n{err}---\n")
    sys.__stderr__.flush()


def pytest_collection_modifyitems(config, items):
    if REAL_GPU:
        return
    skip = pytest.mark.skip(reason="needs a real CUDA GPU (the emulated device cannot show this)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cuda_device(request, monkeypatch):
    """`cuda`-marked tests without a GPU: run inside an emulated two-device CUDA; fail the
    test if the emulator found a race, an unsafe reuse or a leaked graph pool that the test
    did not take (``emulated_cuda.take_reports()``).

    On the real GPU too, `cuda`-marked tests (not `gpu`-marked ones) plan with a cost model
    in which their small shapes cost what large ones would on a GPU: with GPU throughputs
    a test-sized branch costs less than its launch, and every plan would collapse onto one
    stream, leaving the multi-stream paths untested."""
    if request.node.get_closest_marker("cuda") is None:
        yield None
        return
    if request.node.get_closest_marker("gpu") is None:
        import streamsched.ir.cost

        monkeypatch.setattr(streamsched.ir.cost, "GPU_MODEL", TEST_SHAPES_GPU_MODEL)
    if REAL_GPU:
        yield None
        return
    import streamsched.runtime.dispatch.stream_backends as eager_streams
    from streamsched.emulated_cuda import EmulatedCuda

    # Streams do not outlive the emulated device: eager dispatch's process-wide pools start empty.
    monkeypatch.setattr(eager_streams, "_CUDA_STREAMS", {})
    # The asynchronous mode for tests marked so, or for all with STREAMSCHED_EMULATED_ASYNC=1.
    asynchronous = (
        request.node.get_closest_marker("emulated_async") is not None
        or os.environ.get("STREAMSCHED_EMULATED_ASYNC") == "1"
    )
    with EmulatedCuda(devices=2, seed=0, asynchronous=asynchronous) as cuda:
        yield cuda
        import gc

        gc.collect()
        torch.cuda.synchronize()
        cuda.check()


@pytest.fixture
def one_intra_op_thread():
    """One intra-op thread for tests whose decisions rest on timings (the ``auto`` trial):
    two OpenMP threads on a shared 2-core machine made tiny calls take tens of
    milliseconds at random, longer than the delays the tests plant."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def plan_first_calls(monkeypatch):
    """The first call of a call structure is traced and planned at once, with or without
    gradients (``planning.signatures.FIRST_CALL_AS_WRITTEN = False``; by default a first
    call without gradients runs as written): for tests that compare the recorded call and
    the plan's calls with eager from the first call on, which is what they check, not the
    first-call policy (``tests/test_first_calls.py`` checks that)."""
    from streamsched.planning import signatures

    monkeypatch.setattr(signatures, "FIRST_CALL_AS_WRITTEN", False)


@pytest.fixture
def vmap_any_size(monkeypatch):
    """vmap kernels for groups of any size and member outputs of any size
    (``builders.VMAP_MIN_MEMBERS``, ``VMAP_MAX_CPU_ELEMENTS``): for tests of what a vmap
    kernel computes, on groups small enough to check quickly, where it would not pay."""
    from streamsched.passes.fusion import builders

    monkeypatch.setattr(builders, "VMAP_MIN_MEMBERS", 2)
    monkeypatch.setattr(builders, "VMAP_MAX_CPU_ELEMENTS", float("inf"))


@pytest.fixture
def emulated_cuda(_cuda_device):
    """The emulated device of a `cuda`-marked test (skips where a real GPU runs the test)."""
    if _cuda_device is None:
        pytest.skip("checks the emulated CUDA device; this machine has a real GPU")
    return _cuda_device


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    random.seed(0)
    yield


@pytest.fixture
def full_calls(monkeypatch) -> list:
    """Appends one entry per call that took the full path (``Runner.call``): a call the
    settled or hot-plan shortcuts took appends nothing."""
    from streamsched.runner import Runner

    calls: list = []
    full = Runner.call

    def counted(self, *args, **kwargs):
        calls.append(1)
        return full(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "call", counted)
    return calls
