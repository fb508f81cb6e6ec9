"""Choosing how a plan runs: one place for the estimate, the timed trial and its decision.

Three questions, answered here and nowhere else:

- **From the estimates** (:func:`choose_executor`), when a plan is made: ``serial``,
  ``threads`` (CPU lanes) or ``streams``, from the assignment's estimated parallel and
  serial times and the device (or the executor the configuration asks for).
- **By timing the first calls** (:class:`Trial`, ``executor="auto"``): the plan's
  executor, ``serial`` and the model's own forward, each the fastest of several calls;
  the decision and its figures go into the plan (``plan.trial``).
- **For eager dispatch on CPU** (:class:`LaneHistory`): whether a call's
  ``@streamsched.branch`` calls run inline or on CPU lanes, from recent timings of both.

The runtime measures (it runs the calls); the rules that turn measurements into a
choice live here, so that they read as one policy.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Optional, Protocol, Sequence

import torch

from ..config import SchedulerConfig
from ..errors import ConfigError
from .assign import Assignment
from .plan import ExecutorTrial, Plan, _count, _us

__all__ = ["choose_executor", "Trial", "LaneHistory"]

# Host cost of handing work to another CPU lane and of one cross-lane wait (measured
# on a 2-core machine: queue hand-off plus threading.Event round trips).
_THREAD_LANE_US = 40.0
_THREAD_WAIT_US = 10.0
# Eager dispatch under executor="auto" on CPU (LaneHistory): a call's branches must save
# about this much (microseconds, estimated from their inline times) before lanes are
# tried; calls of one call structure timed in each way before it decides, and how often
# (in calls) it re-times the way it does not use.
_MIN_SAVING_US = 1000.0
_MEASURED_CALLS = 3
_RETIME_EVERY = 64


def choose_executor(config: SchedulerConfig, device: torch.device, a: Assignment) -> tuple[str, str]:
    """``(executor, reason)`` for a plan, from the configuration, the device and the
    assignment's estimates: ``serial`` where no branch pays for a stream or lane of its
    own, ``streams`` on CUDA, ``threads`` on CPU only where the estimated saving clears
    the hand-off costs by a wide margin (``executor="auto"``). Raises ``ConfigError`` for
    ``executor="threads"`` on CUDA tensors."""
    requested = config.executor
    if requested == "threads" and device.type == "cuda":
        raise ConfigError(
            f"executor='threads' runs CPU tensors, but this call's tensors are on {device}; "
            "use executor='streams' (or 'auto') for CUDA"
        )
    if requested == "serial":
        return "serial", "requested (executor='serial')"
    if requested == "streams":
        if device.type != "cuda":
            return "streams", (
                "requested (executor='streams'); the tensors are on the CPU, so streams are "
                "simulated: tasks run in issue order and every synchronisation is still decided and logged"
            )
        return "streams", "requested (executor='streams')"
    if requested == "threads":
        return "threads", "requested (executor='threads')"
    # auto
    if a.num_streams <= 1:
        return "serial", "no independent branches worth a stream of their own"
    if device.type == "cuda":
        if a.est_parallel_us < 0.95 * a.est_serial_us:
            return "streams", (
                f"independent branches: estimated {_us(a.est_parallel_us)} on {a.num_streams} streams "
                f"vs {_us(a.est_serial_us)} on one"
            )
        return "serial", (
            f"streams would not pay: estimated {_us(a.est_parallel_us)} on {a.num_streams} streams "
            f"vs {_us(a.est_serial_us)} on one"
        )
    overhead = _THREAD_LANE_US * (a.num_streams - 1) + _THREAD_WAIT_US * sum(len(w) for w in a.waits)
    threaded = a.est_parallel_us + overhead
    if threaded < 0.7 * a.est_serial_us and a.est_serial_us - threaded > 1000.0:
        return "threads", (
            f"independent CPU branches: estimated {_us(threaded)} on {a.num_streams} threads "
            f"vs {_us(a.est_serial_us)} serial"
        )
    return "serial", (
        f"threads would not pay on CPU: estimated {_us(threaded)} on {a.num_streams} threads "
        f"(with hand-off costs) vs {_us(a.est_serial_us)} serial"
    )


class Trial:
    """Times the ways of running one signature on its first calls (``executor="auto"``)
    and keeps the fastest.

    The candidates: the plan's executor, ``serial`` (when the plan chose another one) and
    ``eager`` (``as_written=True``), the model's own forward run as written (unless ``sync_log``, ``chaos``, CUDA
    graphs or ``grad_handoff="direct"`` ask for the schedule itself). The estimate decides whether
    streams or lanes should pay and the schedule whether tracing pays at all; this checks
    both on the real machine. Calls take the candidates in turn and each keeps its fastest
    time (the best of ``rounds``: robust to bursts of machine noise and to a cold first
    call); a candidate more than ``_DROP`` times slower than the leader is dropped after
    its second call (not its first: one call slowed by something else, another process on
    a shared machine, must not cost a way that is right for every later call of this
    signature), so that a trial costs little even where one way is ten times slower. Where the
    schedule and the model's forward come out within ``close`` of each other, they take
    more calls, up to ``max_rounds`` each (those calls cost nothing: both ways run at
    about the same speed). The schedule stays unless the model's own forward is more than
    ``margin`` faster.

    In training (a trial call whose output carries gradients) a call's time is its
    forward and its backward: the wrapper hangs a backward timer on the call
    (``backward_timing``) and hands it over with :meth:`add_pending`; the sample counts
    once the caller ran the backward, read at the next trial call (:meth:`collect`); each
    candidate's first one is left out (a first backward pays for warming up). Where the
    first call's backward has not run by the next call (inference with grad enabled),
    the trial times forwards only, its forward times so far included. Once backward did
    come, a sample whose backward has not run after ``_PENDING_CALLS`` more calls is
    given up; after ``_MAX_GIVEN_UP`` of them in a row the trial starts over timing
    forwards only.
    """

    # A candidate whose fastest of two or more calls is slower than the leader by this
    # factor is dropped.
    _DROP = 2.0
    # Calls whose time is not the candidate's own (a nested child's wrapper planning or in
    # its own trial inside it) are left out, this many at most per trial: about as many
    # as a child's trial takes.
    _MAX_SKIPPED = 32
    # Trial calls a backward sample waits for its backward, and samples given up in a row
    # before the trial times forwards only.
    _PENDING_CALLS = 3
    _MAX_GIVEN_UP = 3
    # Calls of each candidate a trial whose size comes back rarely decides on: two, so
    # that one call slowed by something else (another process, a collection) decides nothing.
    _RARE_ROUNDS = 2

    def __init__(
        self,
        executor: str,
        as_written: bool = False,
        rounds: int = 5,
        margin: float = 0.02,
        max_rounds: int = 15,
        close: float = 0.04,
    ):
        self.executor = executor
        self.candidates = [executor] + (["serial"] if executor != "serial" else []) + (["eager"] if as_written else [])
        self.live = list(self.candidates)
        self.rounds = rounds
        self.margin = margin
        self.max_rounds = max(rounds, max_rounds)
        self.close = close
        self.samples: dict[str, list[float]] = {c: [] for c in self.candidates}
        self.turn = 0
        self.skipped = 0
        # How much faster than the model's own forward the schedule must be to be kept
        # (0: any faster). A plan with nothing to run side by side or batch can win only
        # the forward's Python, and keeping it means planning each new size again.
        self.schedule_margin = 0.0
        # Seconds a call the schedule must save against the model's own forward to be kept
        # (0: any). A nested child's schedule costs its parent's every call the nesting
        # (nesting.py), which a few microseconds won on the child do not repay.
        self.min_gain_s = 0.0
        # Whether calls are timed with their backward: None until the first call shows
        # whether its output carries gradients.
        self.backward: bool | None = None
        # [candidate, forward seconds, backward sample, trial calls since]
        self.pending: list[list[Any]] = []
        # The end hooks on the model's parameters its samples share (backward_timing.
        # ParameterEnds), kept from the first training call until the trial stops timing
        # backwards; taken off too when a trial is dropped before then (the finalizer).
        self.ends: Any = None
        self._ends_off: Optional[weakref.finalize] = None
        self.given_up = 0
        self.backpropagated = 0
        self.warmed: set[str] = set()
        # The wrapper's call count when the trial began, and the trial's own calls: the
        # calls of other signatures in between tell a size that comes back rarely.
        self.began: int | None = None
        self.own_calls = 0
        # Set once its size came back rarely (``RARE_CALLS`` calls of other signatures
        # since the trial began): it decides as soon as every candidate still in it has
        # ``_RARE_ROUNDS`` calls, on the fastest of each, instead of waiting for ``rounds``.
        self.rare = False

    def add_pending(self, name: str, forward_s: float, sample: Any) -> None:
        """A training call's forward time; its backward's time comes in ``sample.seconds``."""
        self.pending.append([name, forward_s, sample, 0])

    def collect(self) -> None:
        """Count the training calls whose backward ran; give up those that waited too long."""
        waiting, dropped = [], []
        for item in self.pending:
            name, forward_s, sample, waited = item
            backward_s = sample.seconds
            if backward_s is not None:
                sample.remove()
                self.backpropagated += 1
                self.given_up = 0
                if name not in self.warmed:
                    # A candidate's first backward pays for warming up (the engine's
                    # first pass over new autograd nodes, a fused group's first gather):
                    # several times a warm one.
                    self.warmed.add(name)
                elif name in self.live:
                    self.add(name, forward_s + backward_s)
            elif not self.backpropagated or waited >= self._PENDING_CALLS:
                sample.remove()
                dropped.append(item)
            else:
                item[3] = waited + 1
                waiting.append(item)
        self.pending = waiting
        if dropped and not self.backpropagated:
            # No call's output was backpropagated before the next call (inference with
            # grad enabled): time forwards only; the forward times taken so far count.
            self.backward = False
            for name, forward_s, _sample, _waited in dropped + waiting:
                if name in self.live:
                    self.add(name, forward_s)
            self._drop_pending()
            return
        self.missed(len(dropped))

    def missed(self, calls: int = 1) -> None:
        """``calls`` training calls gave no backward time (given up, or an output with no
        gradient); after ``_MAX_GIVEN_UP`` in a row the trial times forwards only, from
        scratch, so that no candidate is judged on a mix of both."""
        self.given_up += calls
        if self.given_up >= self._MAX_GIVEN_UP and self.backward:
            self._drop_pending()
            self.backward = False
            self.live = list(self.candidates)
            self.samples = {c: [] for c in self.candidates}

    def keep_ends(self, ends: Any) -> None:
        """``ends`` (with a ``remove()``) are the parameter hooks of the trial's samples
        from now on; those kept before are taken off."""
        self.release_ends()
        self.ends = ends
        self._ends_off = weakref.finalize(self, ends.remove)

    def release_ends(self) -> None:
        off, self._ends_off, self.ends = self._ends_off, None, None
        if off is not None:
            off()

    def _drop_pending(self) -> None:
        """Take the backward timers still out off their tensors: no longer wanted."""
        for item in self.pending:
            item[2].remove()
        self.pending = []
        self.release_ends()

    def next(self) -> str:
        name = self.live[self.turn % len(self.live)]
        self.turn += 1
        return name

    def skip(self, name: str) -> bool:
        """Leave out the call just made with ``name`` (it paid for something else: a
        nested plan's first call); ``False`` once the trial has left out enough."""
        if self.skipped >= self._MAX_SKIPPED:
            return False
        self.skipped += 1
        self.turn -= 1  # the same candidate runs again
        return True

    def add(self, name: str, seconds: float) -> None:
        self.samples[name].append(seconds)
        if len(self.live) < 2 or any(not self.samples[c] for c in self.live):
            return
        leader = min(min(self.samples[c]) for c in self.live)
        for c in list(self.live):
            # One call decides nothing: a spike of another process (10x is common on a
            # shared machine) would drop a way for good, the schedule's first call
            # included (its 1.5x lost for every later call of the signature).
            if len(self.samples[c]) >= 2 and min(self.samples[c]) > self._DROP * leader:
                self.live.remove(c)

    def done(self) -> bool:
        if len(self.live) == 1:
            return True
        counts = [len(self.samples[c]) for c in self.live]
        if self.rare and min(counts) >= self._RARE_ROUNDS:
            return True
        if min(counts) < self.rounds:
            return False
        scheduled = [min(self.samples[c]) for c in self.live if c != "eager"]
        if "eager" in self.live and scheduled and min(scheduled) > 0 and min(counts) < self.max_rounds:
            # A close call: more calls make the fastest of each more certain (a clock
            # too coarse to see the schedule's calls at all cannot tell more).
            return abs(min(self.samples["eager"]) / min(scheduled) - 1.0) >= self.close
        return True

    def decide(self, plan: Plan) -> tuple[Plan, bool]:
        """The plan with the decision and its figures, and whether to run the model as written."""
        self._drop_pending()
        best = {c: round(min(v) * 1e6, 1) for c, v in self.samples.items() if v}
        executor = self.executor
        scheduled = [c for c in (executor, "serial") if c in self.live and c in self.samples]
        if not scheduled:  # every way of running the schedule was dropped: far behind eager
            keep = min((c for c in (executor, "serial") if c in best), key=lambda c: best[c])
        elif len(scheduled) == 2:
            # The plan's executor must be faster than serial to stay (as before).
            keep = executor if best[executor] < best["serial"] else "serial"
        else:
            keep = scheduled[0]
        # The schedule saves less a call than it must (as fast as the forward or slower
        # included: the margin below lets a schedule up to 2% slower stay).
        short = (
            self.min_gain_s > 0
            and "eager" in best
            and keep in best
            and best["eager"] - best[keep] < self.min_gain_s * 1e6
        )
        eager = "eager" in self.live and (
            not scheduled
            or best["eager"] < (1.0 - self.margin) * best[keep]
            or (self.schedule_margin > 0 and best[keep] > (1.0 - self.schedule_margin) * best["eager"])
            or short
        )
        chosen = "eager" if eager else keep
        trial = ExecutorTrial(
            best_us=best,
            calls={c: len(v) for c, v in self.samples.items() if v},
            rounds=self.rounds,
            max_rounds=self.max_rounds,
            margin=self.margin,
            chosen=chosen,
            schedule_executor=keep,
        )
        figures = ", ".join(f"{c} {_us(best[c])}" for c in self.candidates if c in best)
        if self.backward:
            figures = f"forward and backward: {figures}"
        counts = {len(v) for v in self.samples.values() if v}
        if self.rare and min(counts, default=0) < self.rounds:
            calls = ", ".join(f"{c} {len(v)}" for c, v in self.samples.items() if v)
            measured = (
                f"measured {figures} (fastest call of each; calls: {calls}; its size came back rarely, so it "
                f"decided on {self._RARE_ROUNDS} calls of each)"
            )
        elif len(counts) == 1:
            n = counts.pop()
            measured = f"measured {figures} ({'fastest of ' + str(n) + ' calls' if n > 1 else '1 call'} each)"
        else:
            calls = ", ".join(f"{c} {len(v)}" for c, v in self.samples.items() if v)
            measured = f"measured {figures} (fastest call of each; calls: {calls})"
        update: dict[str, Any] = {"trial": trial}
        if eager:
            if short and best["eager"] >= (1.0 - self.margin) * best[keep]:
                why = (
                    f"the schedule ({keep}) saved {_us(max(best['eager'] - best[keep], 0.0))} a call, less than the "
                    f"{_us(self.min_gain_s * 1e6)} nesting this module costs its parent's calls: {measured}"
                )
            else:
                why = f"the model's own forward measured faster than the schedule ({keep}): {measured}"
            update.update(
                executor="eager",
                reason=f"{why}; calls with this signature run the model as written",
                notes=[
                    *plan.notes,
                    f"running the model's own forward (no trace): {_us(best['eager'])} vs {_us(best[keep])} "
                    f"for the schedule on {keep}; observers, sync_log and chaos still run the schedule",
                ],
            )
        elif keep != executor:
            update.update(
                executor=keep,
                reason=f"{executor} estimated to pay but {measured}: running serially",
                notes=[*plan.notes, "tasks run in issue order on the caller's stream"],
            )
        else:
            update["reason"] = f"{plan.reason}; {measured}"
        return plan.model_copy(update=update), eager


class _Timed(Protocol):
    """One branch call of a timed call: its time inline, in microseconds."""

    cost_us: float


class LaneHistory:
    """Recent timings of one call structure under eager dispatch, for ``executor="auto"``
    on CPU: whether its ``@streamsched.branch`` calls run inline or on CPU lanes.

    Whether CPU lanes pay cannot be told in advance: PyTorch may already spread each
    kernel over every core, and a hand-off costs tens of microseconds. So "auto" measures
    (the runtime times each call and hands the time to :meth:`record`; :meth:`decide` is
    the rule): the first calls run their branches inline and time them (uncontended); if
    running them side by side could save a millisecond, the next calls try lanes; from
    then on the mode whose fastest recent call was faster is used (lanes must win by
    10%). The first calls of each path through a forward pay for warm-up, so now and then
    one call re-times the mode not in use: a decision taken on cold timings does not stick.
    """

    def __init__(self) -> None:
        self.wall_us: dict[str, collections.deque] = {m: collections.deque(maxlen=4) for m in ("inline", "lanes")}
        self.branch_us: collections.deque = collections.deque(maxlen=4)  # (count, total) of inline calls
        self.settled_calls = 0

    def record(self, mode: str, wall_us: float, launches: Sequence[_Timed]) -> None:
        """One call that ran its branches ``mode`` ("inline" or "lanes") took ``wall_us``;
        ``launches`` are its branch calls."""
        if not launches:
            return  # nothing ran aside: the mode made no difference
        self.wall_us[mode].append(wall_us)
        if mode == "inline":
            self.branch_us.append((len(launches), sum(launch.cost_us for launch in launches)))

    def decide(self, lanes: int) -> tuple[str, str]:
        """``("inline" | "lanes", why)`` for the next call, which may use ``lanes`` lanes."""
        inline, launched = self.wall_us["inline"], self.wall_us["lanes"]
        if len(inline) < _MEASURED_CALLS:
            return "inline", "the first calls with this call structure run their branches inline, timed"
        # The cheapest recent call: early calls pay for warm-up, and any call for noise.
        count, total_us = min(self.branch_us, key=lambda b: b[1])
        parallel_us = total_us / max(1, min(lanes, count)) + _THREAD_LANE_US * count
        if total_us - parallel_us <= _MIN_SAVING_US:
            return "inline", (
                f"CPU lanes would not pay: {_count(count, 'branch')} take {_us(total_us)} in all "
                f"(estimated {_us(parallel_us)} on {_count(lanes, 'lane')}, with hand-offs)"
            )
        if len(launched) < _MEASURED_CALLS:
            return "lanes", (
                f"trying {_count(lanes, 'CPU lane')}: {_count(count, 'branch')} take {_us(total_us)} in all inline "
                f"(estimated {_us(parallel_us)} side by side)"
            )
        best_inline, best_lanes = min(inline), min(launched)
        timings = f"{best_lanes / 1e3:.2f} ms per call on {_count(lanes, 'lane')} vs {best_inline / 1e3:.2f} ms inline"
        mode, why = ("lanes", "faster") if best_lanes < 0.9 * best_inline else ("inline", "no faster")
        self.settled_calls += 1
        if self.settled_calls % _RETIME_EVERY == 0:
            other = "inline" if mode == "lanes" else "lanes"
            return other, f"re-timing {other} (one call in {_RETIME_EVERY}): so far {timings}"
        return mode, f"CPU lanes measured {why}: {timings}"
