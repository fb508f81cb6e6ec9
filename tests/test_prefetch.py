"""Prefetcher: batches handed out equal the loader's, in its structure, on the device, at
the same iterations; on CUDA the copy of batch k+1 is issued before batch k is handed out."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import streamsched as ss
from streamsched.prefetch import Prefetcher, one_ahead

from .helpers import assert_close

Pair = namedtuple("Pair", ["image", "label"])


def nested_batches(n: int) -> list:
    """Batches that nest tensors of several dtypes in every container pytree knows."""
    return [
        {
            "pair": Pair(torch.randn(2, 3, 4, 4), torch.randint(0, 10, (2,))),
            "list": [torch.randn(5, dtype=torch.float64), (torch.arange(3, dtype=torch.int32), "tag")],
            "mask": torch.rand(2) > 0.5,
            "step": k,
            "note": None,
        }
        for k in range(n)
    ]


def same_structure_and_values(actual, expected, device: torch.device) -> None:
    """Same containers (namedtuples included), same non-tensor values, same tensors on ``device``."""
    assert type(actual) is type(expected), f"{type(actual).__name__} vs {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.device == device and actual.dtype == expected.dtype
        if device.type != "meta":
            assert torch.equal(actual.cpu(), expected.cpu())
        else:
            assert actual.shape == expected.shape
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            same_structure_and_values(actual[key], expected[key], device)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            same_structure_and_values(a, e, device)
    else:
        assert actual == expected


class FailingLoader:
    """Yields ``good`` batches, then raises; iterable more than once, with a len()."""

    def __init__(self, good: int, length: int = 10):
        self.good = good
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for k in range(self.length):
            if k == self.good:
                raise KeyError(f"bad record {k}")
            yield torch.full((2,), float(k))


def drain(iterable) -> tuple[list, BaseException | None]:
    """Batches an iteration produced before it ended, and the exception that ended it."""
    got = []
    try:
        for batch in iterable:
            got.append(batch)
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return got, exc
    return got, None


# --- CPU: a pass-through -------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_batches_keep_structure_values_and_dtypes_and_land_on_the_device(device):
    batches = nested_batches(4)
    prefetcher = Prefetcher(batches, device)
    out = list(prefetcher)
    assert len(out) == len(batches) == len(prefetcher)
    for got, expected in zip(out, batches):
        same_structure_and_values(got, expected, torch.device(device))


def test_cpu_batches_are_handed_out_without_copies():
    batches = [(torch.randn(3, 4), torch.arange(3)) for _ in range(3)]
    for got, expected in zip(Prefetcher(batches, "cpu"), batches):
        assert got[0] is expected[0] and got[1] is expected[1]


def test_a_bare_tensor_loader_and_a_generator_loader():
    tensors = [torch.randn(4, 2) for _ in range(5)]
    assert_close(list(Prefetcher(tensors, "cpu")), tensors, atol=0, rtol=0, what="bare tensors")
    generated = list(Prefetcher((t * 2 for t in tensors), "cpu"))
    assert_close(generated, [t * 2 for t in tensors], atol=0, rtol=0, what="generator")


def test_loader_exception_is_raised_at_the_same_iteration_as_without_prefetching():
    eager_batches, eager_exc = drain(FailingLoader(good=3))
    got, exc = drain(Prefetcher(FailingLoader(good=3), "cpu"))
    assert isinstance(eager_exc, KeyError) and type(exc) is type(eager_exc)
    assert str(exc) == str(eager_exc)
    assert len(got) == len(eager_batches) == 3
    assert_close(got, eager_batches, atol=0, rtol=0, what="batches before the failure")


def test_iterating_twice_repeats_the_loader_and_a_one_shot_loader_stays_exhausted():
    batches = [torch.randn(2) for _ in range(3)]
    prefetcher = Prefetcher(batches, "cpu")
    # Each pass is compared with the batches themselves, not the prefetcher with itself.
    assert_close(list(prefetcher), batches, atol=0, rtol=0, what="first pass")
    assert_close(list(prefetcher), batches, atol=0, rtol=0, what="second pass")
    one_shot = Prefetcher(iter(batches), "cpu")
    assert_close(list(one_shot), batches, atol=0, rtol=0, what="one-shot pass")
    assert list(one_shot) == []  # as iterating the exhausted iterator itself gives


def test_empty_loader_ends_at_once():
    assert list(Prefetcher([], "cpu")) == []


def test_len_follows_the_loader_and_is_a_clear_error_without_one():
    assert len(Prefetcher(FailingLoader(good=99, length=7), "cpu")) == 7
    with pytest.raises(TypeError, match="generator.*has no len"):
        len(Prefetcher((t for t in [torch.ones(1)]), "cpu"))


@pytest.mark.parametrize(
    "device, message",
    [
        ("cdua", "'cdua' is not a device"),
        ("cuda:x", "is not a device"),
        (-1, "index must be >= 0"),
        (1.5, "must be a str, int or torch.device, got float"),
        (True, "got bool"),
    ],
)
def test_bad_device_is_a_clear_config_error(device, message):
    with pytest.raises(ss.ConfigError, match=message) as info:
        Prefetcher([torch.ones(1)], device)
    assert isinstance(info.value, ValueError) and "Prefetcher" in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0], ids=["type", "type-and-index", "index"])
def test_cuda_device_without_cuda_says_so(device):
    with pytest.raises(ss.ConfigError, match="CUDA is not available"):
        Prefetcher([torch.ones(1)], device)


def test_bad_options_and_loader_are_clear_errors():
    with pytest.raises(ss.ConfigError, match="non_blocking must be True or False"):
        Prefetcher([], "cpu", non_blocking=1)
    with pytest.raises(ss.ConfigError, match="pin_memory must be True or False"):
        Prefetcher([], "cpu", pin_memory="yes")
    with pytest.raises(TypeError, match="loader must be iterable, got int"):
        Prefetcher(5, "cpu")


# --- the one-step-ahead protocol, driven without a GPU ---------------------------------


class RecordingCopier:
    """Stands in for CudaCopier: 'copies' by cloning and logs issue / hand_out in order."""

    def __init__(self):
        self.log: list[tuple[str, int]] = []

    def issue(self, batch):
        self.log.append(("issue", int(batch[0])))
        return ("in flight", batch.clone())

    def hand_out(self, pending):
        _, batch = pending
        self.log.append(("hand_out", int(batch[0])))
        return batch


def test_one_ahead_issues_the_next_copy_before_handing_out_the_current_batch():
    batches = [torch.full((2,), float(k)) for k in range(4)]
    copier = RecordingCopier()
    consumed = []
    for batch in one_ahead(batches, copier):
        consumed.append(batch)
        # At the moment batch k is in the caller's hands, batch k+1 (only) is in flight.
        k = int(batch[0])
        issued = [i for op, i in copier.log if op == "issue"]
        assert issued == list(range(min(k + 2, len(batches))))
    assert copier.log == [
        ("issue", 0),
        ("issue", 1),
        ("hand_out", 0),
        ("issue", 2),
        ("hand_out", 1),
        ("issue", 3),
        ("hand_out", 2),
        ("hand_out", 3),
    ]
    assert_close(consumed, batches, atol=0, rtol=0, what="batches")


def test_one_ahead_defers_a_loader_exception_to_its_own_iteration():
    copier = RecordingCopier()
    got, exc = drain(one_ahead(FailingLoader(good=2), copier))
    assert isinstance(exc, KeyError) and "bad record 2" in str(exc)
    assert [int(b[0]) for b in got] == [0, 1]
    # Batch 1 was handed out although fetching batch 2 had already failed.
    assert copier.log == [("issue", 0), ("issue", 1), ("hand_out", 0), ("hand_out", 1)]


def test_one_ahead_with_a_loader_failing_at_once():
    got, exc = drain(one_ahead(FailingLoader(good=0), RecordingCopier()))
    assert got == [] and isinstance(exc, KeyError)


# --- CUDA --------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_batches_equal_the_loaders_on_the_device_with_structure_kept():
    batches = nested_batches(5)
    device = torch.device("cuda", torch.cuda.current_device())
    out = list(Prefetcher(batches, "cuda"))
    torch.cuda.synchronize()
    assert len(out) == 5
    for got, expected in zip(out, batches):
        same_structure_and_values(got, expected, device)


@pytest.mark.cuda
@pytest.mark.parametrize("pin_memory", [True, False])
@pytest.mark.parametrize("non_blocking", [True, False])
def test_cuda_consumer_on_a_side_stream_reads_complete_batches(pin_memory, non_blocking):
    batches = [torch.randn(256, 1024) for _ in range(6)]
    consumer = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(consumer):
        for batch in Prefetcher(batches, "cuda", pin_memory=pin_memory, non_blocking=non_blocking):
            assert torch.cuda.current_stream() == consumer
            sums.append(batch.double().sum())
    torch.cuda.synchronize()
    expected = [b.double().sum() for b in batches]
    assert_close([s.cpu() for s in sums], expected, atol=1e-6, rtol=1e-9, what="sums on the consumer stream")


@pytest.mark.cuda
def test_cuda_batch_memory_is_not_reused_while_the_consumer_still_reads_it():
    # The consumer stalls (a spin kernel) before reading each batch, and the host drops the
    # batch at once. Without record_stream the allocator would hand that memory to the
    # copy of a later batch, and the stalled read would see the later batch's values.
    batches = [torch.full((1 << 20,), float(k)) for k in range(8)]
    sums = []
    for batch in Prefetcher(batches, "cuda"):
        torch.cuda._sleep(20_000_000)
        sums.append(batch.sum())
        del batch
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [float(k) * (1 << 20) for k in range(8)]


@pytest.mark.cuda
def test_cuda_loader_exception_propagates_at_its_iteration_and_streams_are_restored():
    caller = torch.cuda.current_stream()
    got, exc = drain(Prefetcher(FailingLoader(good=3), "cuda"))
    assert isinstance(exc, KeyError) and len(got) == 3
    assert torch.cuda.current_stream() == caller
    torch.cuda.synchronize()
    assert [float(b[0]) for b in got] == [0.0, 1.0, 2.0]


@pytest.mark.cuda
def test_cuda_prefetch_to_the_second_device_while_the_first_is_current():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    dev1 = torch.device("cuda", 1)
    batches = [torch.full((1 << 12,), float(k)) for k in range(6)]
    sums = []
    for batch in Prefetcher(batches, dev1):
        assert batch.device == dev1 and torch.cuda.current_device() == 0
        sums.append(batch.sum())  # on device 1's current stream, which waited for the copy
        del batch
    torch.cuda.synchronize(dev1)
    assert [float(s) for s in sums] == [float(k) * (1 << 12) for k in range(6)]


@pytest.mark.cuda
def test_cuda_tensors_already_on_the_device_pass_through():
    on_device = [torch.randn(4, device="cuda") for _ in range(3)]
    for got, expected in zip(Prefetcher(on_device, "cuda"), on_device):
        assert got is expected
