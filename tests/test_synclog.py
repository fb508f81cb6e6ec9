import pytest
import torch

import streamsched as ss
from streamsched.runtime import SyncLog, check_happens_before
from streamsched.runtime.synclog import SyncEntry

from .helpers import ConvTowers, Towers


def logged_call(executor: str, model=None, x=None):
    model = model if model is not None else Towers(4, 64)
    x = x if x is not None else torch.randn(8, 64)
    sm = ss.StreamScheduledModule(model, executor=executor, sync_log=True, num_streams=4, min_task_cost=0.0, fuse=False)
    sm(x)
    out = sm(x)
    return sm, sm.last_sync_log, out


@pytest.mark.parametrize("executor", ["threads", "streams", "serial"])
def test_valid_runs_are_clean(executor):
    _, log, _ = logged_call(executor)
    assert len(log) > 0 and check_happens_before(log) == []


@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_a_dropped_wait_is_reported_with_its_edge(executor):
    sm, log, _ = logged_call(executor)
    waits = [e for e in log.entries if e.kind == "wait"]
    assert waits
    dropped = waits[0]
    races = check_happens_before(log.without(lambda e: e is dropped))
    assert races and races[0].kind == "unordered-read"
    names = {t.id: t.name for t in sm.plan.tasks}
    assert names[dropped.task] in str(races[0]) or f"task {dropped.task}" in str(races[0])


def test_a_dropped_record_stream_is_an_unsafe_free():
    model = ConvTowers()
    sm, log, _ = logged_call("streams", model, torch.randn(2, 8, 12, 12))
    freed = {e.slots[0] for e in log.entries if e.kind == "free"}
    victims = [e for e in log.entries if e.kind == "record_stream" and e.slots[0] in freed]
    assert victims, "the concatenation on the caller's stream frees values the side streams allocated"
    races = check_happens_before(log.without(lambda e: e is victims[0]))
    assert any(r.kind == "unsafe-free" for r in races)


class TowerOutputs(torch.nn.Module):
    """Independent towers whose outputs are returned as they are (no join node)."""

    def __init__(self):
        super().__init__()
        self.towers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        return tuple(torch.tanh(t(x)) for t in self.towers)


def test_a_missing_join_and_an_early_wait_are_reported():
    _, log, _ = logged_call("streams", TowerOutputs(), torch.randn(8, 64))
    assert check_happens_before(log) == []
    assert any(r.kind == "missing-join" for r in check_happens_before(log.without(lambda e: e.kind == "join")))
    _, log, _ = logged_call("streams")
    entries = list(log.entries)
    i = next(k for k, e in enumerate(entries) if e.kind == "wait")
    producer = entries[i].task
    j = next(k for k, e in enumerate(entries) if e.kind == "record" and e.task == producer)
    moved = SyncLog()
    moved.entries = [entries[i]] + entries[:i] + entries[i + 1 :]
    assert j < i
    assert any(r.kind == "wait-unrecorded" for r in check_happens_before(moved))


def test_outputs_from_side_streams_must_be_recorded_on_the_caller():
    log = SyncLog()
    log.entries = [
        SyncEntry("fork", 1),
        SyncEntry("launch", 1, 0, (), (5,)),
        SyncEntry("record", 1, 0),
        SyncEntry("join", 1),
        SyncEntry("output", 0, -1, (5,)),
    ]
    assert [r.kind for r in check_happens_before(log)] == ["output-not-recorded"]
    log.entries.insert(4, SyncEntry("record_stream", 0, -1, (5,)))
    assert check_happens_before(log) == []


def test_mutated_plan_is_caught_by_chaos_and_the_checker():
    """Remove one wait from a compiled plan: chaos makes the run fail or go wrong, and the
    checker reports the unordered read deterministically."""
    model = Towers(4, 64)
    sm = ss.StreamScheduledModule(
        model, executor="threads", sync_log=True, num_streams=4, min_task_cost=0.0, fuse=False, chaos=7
    )
    x = torch.randn(8, 64)
    with torch.no_grad():
        expected = model(x)
        sm(x)
        program = sm._ss.last.program
        victim = next(t for t in program.tasks if t.waits)
        victim.waits = victim.waits[1:]
        caught = 0
        for _ in range(10):
            try:
                out = sm(x)
                wrong = not torch.allclose(out, expected, atol=1e-5)
            except Exception:  # reading a value that is not there yet
                wrong = True
            races = check_happens_before(sm.last_sync_log)
            caught += bool(races) or wrong
        assert caught == 10


def _hand_log(steps, input_slots=(), expected_writers=None) -> SyncLog:
    log = SyncLog()
    log.input_slots = input_slots
    log.expected_writers = expected_writers or {}
    for method, *args in steps:
        getattr(log, method)(*args)
    return log


_FORKED = [("fork", [1])]
_JOINED = [("join", [1])]
_HANDED_TO_STREAM_1 = [("launch", 0, 1, (), (3,)), ("record", 0, 1), ("wait", 1, 1), ("launch", 1, 2, (3,), ())]

# One hand-written log per finding: the checker reports exactly that finding, worded so.
FINDINGS = {
    "read-before-write": (
        _hand_log([("launch", 0, 1, (5,), ())], input_slots=(0,)),
        (5, 0, 1, "conv on stream 0 reads slot 5 that no task wrote"),
    ),
    "unordered-read": (
        _hand_log(_FORKED + [("launch", 1, 1, (), (3,)), ("launch", 0, 2, (3,), ())] + _JOINED),
        (3, 0, 2, "relu on stream 0 reads slot 3 written by conv on stream 1 without waiting for it"),
    ),
    "write-after-read": (
        _hand_log(_FORKED + _HANDED_TO_STREAM_1 + [("launch", 0, 3, (), (3,))] + _JOINED),
        (3, 0, 3, "task 3 on stream 0 writes slot 3 while a read of it on stream 1 may not have finished"),
    ),
    "unordered-write": (
        _hand_log(_FORKED + [("launch", 1, 1, (), (3,)), ("launch", 0, 2, (), (3,))] + _JOINED),
        (3, 0, 2, "relu on stream 0 writes slot 3 also written by conv on stream 1 without waiting for it"),
    ),
    "wait-unrecorded": (
        _hand_log(_FORKED + [("wait", 1, 7)] + _JOINED),
        (-1, 1, 7, "stream 1 waits on the event of task 7 before it is recorded"),
    ),
    "unsafe-free": (
        _hand_log(_FORKED + _HANDED_TO_STREAM_1 + [("free", 0, 3)] + _JOINED),
        (
            3,
            1,
            1,
            "slot 3 (allocated on stream 0) is released while stream 1 may still read it, "
            "and it was not record_stream'ed on stream 1",
        ),
    ),
    "missing-join": (
        _hand_log(_FORKED + [("launch", 1, 1, (), (4,))]),
        (-1, 1, -1, "the caller's stream does not wait for stream 1 before returning"),
    ),
    "output-not-recorded": (
        _hand_log(_FORKED + [("launch", 1, 1, (), (4,))] + _JOINED + [("output", [4])]),
        (
            4,
            1,
            1,
            "output slot 4 was allocated on stream 1 and handed to the caller without record_stream "
            "on the caller's stream",
        ),
    ),
    "out-of-order": (
        _hand_log(
            [("launch", 0, 1, (), (3,)), ("launch", 0, 9, (), (3,)), ("launch", 0, 2, (3,), ())],
            expected_writers={(2, 3): 1},
        ),
        (
            3,
            0,
            2,
            "relu on stream 0 accesses location 3 after the write of task 9, where eager order has it see "
            "the write of conv",
        ),
    ),
}


@pytest.mark.parametrize("kind", sorted(FINDINGS))
def test_each_finding_of_a_hand_written_log(kind):
    log, (slot, stream, task, detail) = FINDINGS[kind]
    races = check_happens_before(log, {1: "conv", 2: "relu"})
    assert [(r.kind, r.slot, r.stream, r.task, r.detail) for r in races] == [(kind, slot, stream, task, detail)]
    assert str(races[0]) == f"{kind}: {detail}"


@pytest.mark.parametrize(
    "steps",
    [
        _FORKED + [("launch", 1, 1, (), (3,)), ("record", 1, 1), ("wait", 0, 1), ("launch", 0, 2, (3,), ())] + _JOINED,
        _FORKED + _HANDED_TO_STREAM_1 + [("record", 1, 2), ("wait", 0, 2), ("launch", 0, 3, (), (3,))] + _JOINED,
        _FORKED + _HANDED_TO_STREAM_1 + [("record_stream", 1, 3), ("free", 0, 3)] + _JOINED,
        _FORKED + [("launch", 1, 1, (), (4,))] + _JOINED + [("record_stream", 0, 4), ("output", [4])],
    ],
    ids=["read-after-wait", "write-after-wait", "free-after-record-stream", "output-recorded"],
)
def test_the_same_logs_ordered_are_clean(steps):
    assert check_happens_before(_hand_log(steps)) == []


def test_the_null_log_answers_every_logging_method_of_the_log():
    """An executor given no log writes to NULL_LOG unconditionally: every method a
    SyncLog logs with must be there, taking the same arguments and keeping nothing."""
    import inspect

    from streamsched.runtime.synclog import NULL_LOG, NullSyncLog

    logging = [n for n, f in vars(SyncLog).items() if inspect.isfunction(f) and not n.startswith("_")]
    logging = [n for n in logging if n not in ("without", "actions")]
    assert {"fork", "launch", "record", "wait", "record_stream", "free", "join", "output"} <= set(logging)
    for name in logging:
        assert inspect.signature(getattr(NullSyncLog, name)) == inspect.signature(getattr(SyncLog, name)), name
    assert SyncLog.keeps and not NULL_LOG.keeps
    assert not hasattr(NULL_LOG, "__dict__")  # nothing to keep between calls or threads
