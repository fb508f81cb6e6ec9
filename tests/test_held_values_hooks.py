"""A plain Python value (an int, a float, a flag, a dict entry, a list's length) held by
the model or an object it holds, written during a call by code the trace does not run (a
forward hook, a pre-hook, a ``@streamsched.branch`` function, a module run as one opaque
call) and read by the forward after that code ran. The trace read the value the previous
call left and baked it in: every traced call multiplied by, or branched on, the old value
until the re-trace churn ran the model as written.

Such a trace's first call runs as written while the assignments it makes are logged; a
write to a value the trace read refuses it (eager dispatch, ``sm.plan`` names the value),
whether or not the value written differs from the one held (the next call may write
another). A hook that writes only what the forward never reads keeps the plan. A write
that begins on a later call refuses the trace from then on, with a ``HeldStateWarning``
where that call ran the plan on a value that changed. The forward's own writes (``self.step
+= 1``, a buffer counter) are refused while tracing; they are checked here too."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path, last_path

from .helpers import assert_close

D = 8
EXECUTORS = ["serial", "threads", "auto", "streams"]
EXACT = ("as-written", "eager-dispatch")
REFUSED: set[int] = set()  # wrappers whose plan named a refused write on some call


class Holder:
    """A plain object the model holds."""

    def __init__(self):
        self.n = 4
        self.table = {"n": 4}


class Opaque(nn.Module):
    """A module whose forward the trace cannot see into (listed in ``leaf_modules``): it
    writes its parent's flag."""

    def __init__(self, parent_holder: Holder):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.holder = parent_holder

    def forward(self, x):
        self.holder.n = int(x.shape[0]) + 1
        return self.lin(x)


class Written(nn.Module):
    """``b(relu(a(x))) * v`` (or a branch on ``v``), where ``v`` is written during the call,
    before the forward reads it, by ``writer``."""

    def __init__(self, writer: str):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.holder = Holder()
        self.scale = 1.0
        self.flag = False
        self.buf: list[int] = []
        self.step = 0
        self.writer = writer
        self.opaque = Opaque(self.holder)
        if writer in ("object_attribute", "dict_entry", "list_append", "module_float"):
            self.a.register_forward_hook(self.after_a)
        elif writer == "flag_pre_hook":
            self.b.register_forward_pre_hook(self.before_b)

    def after_a(self, module, args, out):
        if self.writer == "object_attribute":
            self.holder.n = int(args[0].shape[0])  # (the same value while the size is)
        elif self.writer == "dict_entry":
            self.holder.table["n"] = round(float(out.detach().sum()), 2)
        elif self.writer == "list_append":
            self.buf.append(1)
        elif self.writer == "module_float":
            self.scale = round(float(out.detach().abs().sum()) % 3, 3)

    def before_b(self, module, args):
        self.flag = bool(args[0].detach().sum() > 0)

    @ss.branch
    def count(self, h):
        self.step += 1
        return h + 1

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.writer == "branch_counter":
            h = self.count(h)
            return self.b(h) * self.step
        if self.writer == "opaque_module":
            h = self.opaque(h)
            return self.b(h) * self.holder.n
        y = self.b(h)
        if self.writer == "object_attribute":
            return y * self.holder.n
        if self.writer == "dict_entry":
            return y * self.holder.table["n"]
        if self.writer == "list_append":
            return y * len(self.buf)
        if self.writer == "module_float":
            return y * self.scale
        if self.flag:  # flag_pre_hook
            return y * 3
        return y - 1


WRITERS = [
    "object_attribute",
    "dict_entry",
    "list_append",
    "module_float",
    "flag_pre_hook",
    "branch_counter",
    "opaque_module",
]


def _wrap(model: nn.Module, executor: str) -> ss.StreamScheduledModule:
    leaf = (Opaque,)
    if executor == "streams":
        return ss.StreamScheduledModule(model.to("cuda"), executor="streams", leaf_modules=leaf)
    return ss.StreamScheduledModule(model, executor=executor, leaf_modules=leaf)


def _device(executor: str) -> str:
    return "cuda" if executor == "streams" else "cpu"


def _calls(sm, model, ref, sizes, paths, what, device="cpu", grad=False):
    """Each call against eager on a fresh input of ``sizes[i]`` rows; the path must be one
    of ``paths``. Returns the paths."""
    seen = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, D, device=device)
        with torch.set_grad_enabled(grad):
            expected = ref(x)
            actual = sm(x)
        seen.append(last_path(sm))
        if "wrote during a call" in str(sm.plan):
            REFUSED.add(id(sm))
        assert_path(sm, *paths)
        assert_close(actual, expected, what=f"{what}, call {i} ({seen})")
    return seen


@pytest.mark.parametrize("executor", [pytest.param(e, marks=pytest.mark.cuda) for e in EXECUTORS])
@pytest.mark.parametrize("writer", WRITERS)
def test_plain_value_written_during_the_call_is_read_when_eager_reads_it(writer, executor):
    torch.manual_seed(0)
    model = Written(writer)
    ref = copy.deepcopy(model).to(_device(executor))  # (its hooks bound to the copy)
    sm = _wrap(model, executor)
    # The first size equals the value held before (object_attribute writes 4 over 4): the
    # write is seen all the same; then sizes and values vary.
    sizes = [4, 4, 4, 5, 5, 3, 4, 6, 6, 4]
    paths = []
    for grad in (False, True):
        model.train(grad)
        ref.train(grad)
        paths += _calls(sm, model, ref, sizes, EXACT, f"{writer}/{executor}", _device(executor), grad)
    # Refused by name, unless every call ran as written (auto: a chain in inference runs as
    # written at every size, and the writes are then re-traces, a churn).
    assert id(sm) in REFUSED or set(paths) == {"as-written"}, (paths, str(sm.plan))


@pytest.mark.parametrize("executor", [pytest.param(e, marks=pytest.mark.cuda) for e in EXECUTORS])
def test_hooks_writing_what_the_forward_does_not_read_keep_the_plan(executor):
    """A counter the forward never reads and a logger's list: the trace reads
    ``self.scale``, which nothing writes. Watched on the first call, planned after."""

    class Logged(Written):
        def __init__(self):
            super().__init__("none")
            self.calls = 0
            self.log: list[float] = []
            self.a.register_forward_hook(self.note)
            self.b.register_forward_pre_hook(self.tick)

        def note(self, module, args, out):
            self.log.append(float(out.detach().sum()))
            self.holder.seen = len(self.log)  # (an attribute no traced code reads)

        def tick(self, module, args):
            self.calls += 1

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) * self.scale

    torch.manual_seed(0)
    model = Logged()
    ref = copy.deepcopy(model).to(_device(executor))
    sm = _wrap(model, executor)
    planned = ("as-written", "recorded", "plan") if executor == "auto" else ("recorded", "plan")
    seen = _calls(sm, model, ref, [4], ("as-written",), "first call", _device(executor))
    seen += _calls(sm, model, ref, [4, 4, 4, 5, 5, 4], planned, f"read-only hooks/{executor}", _device(executor))
    if executor != "auto":
        assert seen[1] == "recorded" and seen[2].startswith("plan"), seen
    assert model.calls == 7 and len(model.log) == 7
    assert "wrote during a call" not in str(sm.plan)


@pytest.mark.parametrize("executor", [pytest.param(e, marks=pytest.mark.cuda) for e in EXECUTORS])
def test_a_write_beginning_after_planning_is_seen_and_said(executor):
    """A hook that writes nothing on the watched call and a new value from the fourth call
    on: that call ran the plan on the old value, which a HeldStateWarning says; from the
    next call the forward runs in eager dispatch, exact."""

    class Late(Written):
        def __init__(self):
            super().__init__("none")
            self.seen = 0
            self.a.register_forward_hook(self.late)

        def late(self, module, args, out):
            self.seen += 1
            if self.seen >= 4:
                self.scale = float(self.seen)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) * self.scale

    torch.manual_seed(0)
    model = Late()
    ref = copy.deepcopy(model).to(_device(executor))
    sm = _wrap(model, executor)
    device = _device(executor)
    planned = ("as-written", "recorded", "plan") if executor == "auto" else ("recorded", "plan")
    _calls(sm, model, ref, [4], ("as-written",), "watched call", device)
    _calls(sm, model, ref, [4, 4], planned, "planned", device)
    x = torch.randn(4, D, device=device)
    with torch.no_grad():
        expected = ref(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            actual = sm(x)
    said = [w for w in caught if issubclass(w.category, ss.HeldStateWarning)]
    if last_path(sm) in EXACT:
        assert_close(actual, expected, what="the first writing call, run as written")
    else:
        # Never silent: the result read the old value, and the warning says so.
        assert said and "may be stale" in str(said[0].message), [str(w.message) for w in caught]
    _calls(sm, model, ref, [4, 5, 4, 6], EXACT, f"after the write/{executor}", device)
    assert "wrote during a call" in str(sm.plan)


@pytest.mark.parametrize("executor", ["serial", "threads", "auto"])
def test_the_forward_writing_its_own_state_and_reading_it_later_in_the_call(executor):
    """``self.step += 1`` then ``x * self.step``; a registered buffer counted in place and
    read; a running mean updated in place in training: the forward's own writes, refused
    while tracing (the module runs as written), equal to eager over calls and modes."""

    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)
            self.b = nn.Linear(D, D)
            self.step = 0
            self.register_buffer("count", torch.zeros(()))
            self.register_buffer("running", torch.zeros(D))

        def forward(self, x):
            self.step += 1
            self.count += 1
            h = torch.relu(self.a(x))
            if self.training:
                with torch.no_grad():
                    self.running.mul_(0.9).add_(h.mean(0), alpha=0.1)
            return self.b(h) * self.step + self.count * self.running

    torch.manual_seed(0)
    model = Counts()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for grad in (False, True, False):
        model.train(grad)
        ref.train(grad)
        _calls(sm, model, ref, [4, 4, 5, 4], ("as-written", "eager-dispatch"), f"own writes/{executor}", grad=grad)
    assert model.step == ref.step == 12
    assert_close(model.running, ref.running, what="running mean")
    assert_close(model.count, ref.count, what="counter")


@pytest.mark.parametrize("executor", [pytest.param(e, marks=pytest.mark.cuda) for e in EXECUTORS])
def test_code_that_assigns_nothing_is_not_watched(executor):
    """A hook that only reads its output and a branch that computes on tensors assign
    nothing (their bytecode stores no attribute or item, calls no in-place method): the
    trace that reads ``self.scale`` beside them is planned on its first call."""

    class Reading(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(D, D)
            self.b = nn.Linear(D, D)
            self.scale = 1.5
            self.a.register_forward_hook(self.look)

        def look(self, module, args, out):
            total = float(out.detach().sum())
            return None if total == total else out  # (reads only)

        @ss.branch
        def double(self, h):
            return h * 2 + h.mean()

        def forward(self, x):
            return self.b(self.double(torch.relu(self.a(x)))) * self.scale

    from streamsched.frontend.held_reads import may_write

    assert not may_write(Reading.look) and not may_write(Reading.double)
    assert may_write(Written.after_a) and may_write(Written.before_b) and may_write(Opaque.forward)
    torch.manual_seed(0)
    model = Reading()
    ref = copy.deepcopy(model).to(_device(executor))
    sm = _wrap(model, executor)
    planned = ("as-written", "recorded", "plan") if executor == "auto" else ("recorded", "plan")
    seen = _calls(sm, model, ref, [4, 4, 4, 5, 4], planned, f"assigns nothing/{executor}", _device(executor))
    if executor != "auto":
        assert seen[0] == "recorded" and seen[1].startswith("plan"), seen
    assert "wrote during a call" not in str(sm.plan)
