"""Which new input signatures get a plan, and what the others run.

A plan is made per input *signature* (sizes included), and making one costs a recording
call, fusion, planning, compiling and, under ``executor="auto"``, a trial of several
calls. Real workloads call with sizes that change: sequence lengths that vary per batch,
decoding that grows the input by a token per call, a smaller last batch. Planning every
new size there costs far more than it can win back, so each *call structure* (the
signature without the sizes: argument structure, dtypes, devices, ranks, modes) keeps a
:class:`Structure` that decides, for a size it has no plan for:

- **seen once:** the call runs the model as written (what eager costs, exactly eager's
  result); only a size that comes back is planned (:data:`PLAN_AFTER`). A decoding loop,
  whose input never has the same size twice, runs as written on every call. In inference
  (``eval()``, no gradients) that holds for a structure's first call too
  (:data:`FIRST_CALL_AS_WRITTEN`):
  nothing is traced before one of its sizes comes back (the structure is made with no
  plan; :attr:`Structure.plan` is ``None`` until then).
- **a size bucket being decided:** while the trial of one size of a bucket runs, other
  sizes of that bucket run as written (one trial per bucket, not one per size). A trial
  whose size does not come back (:data:`STALL_CALLS` calls of other sizes of its bucket
  meanwhile: a decoding loop meets each length once per sequence) is stalled: a size
  bucket hands the trial to the next of its sizes that comes back; the structure-wide
  bucket of a plan with nothing to schedule (below) is decided for the model as written,
  since each of its sizes would pay its own plan for at most the forward's Python.
- **a trial whose size comes back rarely:** after :data:`RARE_CALLS` calls of other
  signatures since it began (sizes cycled, each met once per pass), the trial decides as
  soon as every candidate still in it has run two calls, on the fastest of each, and keeps
  the schedule only where it is clearly faster (the wrapper's ``_UNIFORM_SCHEDULE_MARGIN``):
  a bucket is decided within about ``RARE_CALLS`` calls plus two calls of its own size
  per candidate.
- **a size bucket already decided:** the ``auto`` trial decides once per *bucket* (each
  dimension rounded up to a power of two, :func:`size_bucket`): where it found the model
  as written faster, new sizes of that bucket run as written without a plan; where it
  kept the schedule, a new size is planned (when it comes back) with the decided executor
  and no trial where the trial's gain per call repays a recording call of the structure
  within :data:`PAYBACK_CALLS` calls (:meth:`Structure.repays`); where it does not (a
  schedule a few percent faster, a recording call worth hundreds of calls), new sizes of
  the bucket run as written and are settled so.
- **a size that comes back rarely:** a size whose second call came more than
  ``PAYBACK_WINDOW / PAYBACK_CALLS`` calls of the wrapper after its first is expected back
  at that rate: it is planned only where its calls within :data:`PAYBACK_WINDOW` calls,
  each saving what the structure's trials measured (:meth:`Structure.expected_gain`),
  repay a recording call; otherwise it runs as written, judged again when it comes back.
  Where no trial measured anything yet, a call on the CPU bounds it: no plan saves more
  than the whole call (:data:`GRAD_BOUND` times it where autograd records the call). The
  size runs as written once more, timed, and is judged on that when it comes back. The
  settled layouts judge such sizes themselves (:meth:`Structure.rare_again`).
- **nothing to schedule:** where the structure's first plan runs nothing side by side
  and batches nothing (one stream, no fused group), the schedule can differ from the
  model as written only by the cost of running the forward's Python; that does not
  change sign with the sizes, so the trial decides once for the whole structure
  (:data:`ANY_SIZE`) instead of once per bucket, and new sizes take its verdict. In
  inference a traced forward that is a chain (``new_signatures.a_chain``) is decided so
  for the model as written as soon as it is traced, with no recording call or trial.
- **churn:** when sizes already planned once must be planned again (the plan cache is
  smaller than the set of sizes the workload cycles through, :data:`CHURN_REPLANS`), or
  more distinct sizes were planned than twice the cache holds (:data:`CHURN_SIZES`), the
  structure stops planning new sizes: they run as written, the plans in the cache keep
  running, and ``sm.plan`` says so. Raising ``plan_cache_size`` lifts it.

Nothing here holds a reference to a caller's tensor or object: sizes are tuples of ints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

from .._lru import LRU

__all__ = [
    "Structure",
    "Decision",
    "AsWritten",
    "size_bucket",
    "sizes_text",
    "PLAN_AFTER",
    "CHURN_REPLANS",
    "CHURN_SIZES",
    "ANY_SIZE",
    "STALL_CALLS",
    "MAX_HANDOFFS",
    "RARE_CALLS",
    "PAYBACK_CALLS",
    "PAYBACK_WINDOW",
    "GRAD_BOUND",
    "Rarity",
    "rare_text",
    "FIRST_CALL_AS_WRITTEN",
    "CHAIN_AS_WRITTEN",
]

# A size is planned on its second call: one call of a size never seen again (a decoding
# step) runs as written.
PLAN_AFTER = 2
# In inference (the model in ``eval()``, no gradients: ``no_grad``, ``inference_mode``;
# a decoding loop, ``generate``), the first call of a call structure runs as written too
# (the structure is traced and planned when one of its sizes comes back): a decoding loop
# or a one-off ``generate`` pays no trace, recording call nor plan. Otherwise the first
# call is planned at once: a training step comes back at its size, and an optimizer is
# built over the fused parameters its plan stacked after one call (``no_grad`` or not:
# ``sm.fused_parameters()``). False: every first call is planned at once.
FIRST_CALL_AS_WRITTEN = True
# In inference, a call structure whose traced forward is a chain (nothing to run side by
# side or batch: ``new_signatures.a_chain``) is decided for the model as written at every
# size as soon as it is traced, with no recording call, plan or trial. False: such a
# structure is recorded and tried as any other.
CHAIN_AS_WRITTEN = True
# Sizes planned, evicted and planned again before the structure stops planning new ones.
CHURN_REPLANS = 3
# Or distinct sizes planned, in multiples of the plan cache: far more sizes than the cache
# holds come back (a thousand batch sizes), each plan evicting another.
CHURN_SIZES = 2
# The one bucket of a structure whose plans have nothing to schedule: every size.
ANY_SIZE: tuple = ("any size",)
# Calls of other sizes of a bucket while its trial waits for its own size to come back,
# before the trial is stalled (module docstring): a bound on how long a bucket stays
# undecided, each of those calls paying the undecided path.
STALL_CALLS = 32
# Stalls of one size bucket handed to another size before the bucket is decided for the
# model as written: sizes that come back this rarely would each pay a plan anyway.
MAX_HANDOFFS = 2
# Calls of other signatures of the wrapper since a trial began after which its size is
# taken to come back rarely: the trial decides on two calls of each candidate.
RARE_CALLS = 16
# Calls of a new size within which a bucket's schedule must repay the size's recording
# call (its gain per call against the structure's recording calls) for the size to be
# planned: sizes that recur do so for many calls, but hundreds is more than a plan is worth.
PAYBACK_CALLS = 64
# Calls of the wrapper within which a size that comes back rarely must repay its plan: a
# size back every ``k`` calls is planned only where ``PAYBACK_WINDOW / k`` calls of it
# (each saving what the structure's trials measured) repay a recording call. Sizes back
# within ``PAYBACK_WINDOW / PAYBACK_CALLS`` calls are judged by ``PAYBACK_CALLS`` alone.
PAYBACK_WINDOW = 1024
# Where no trial of the structure has measured what a plan saves, a size that comes back
# rarely is judged on its own as-written call (timed once, on the CPU): no plan saves more
# than the whole call, and a call whose output autograd records may save on its backward
# too, bounded by this many times the forward (a backward is about twice a forward's work;
# on a CUDA device the host's time of a call is not its work, and nothing is bounded).
GRAD_BOUND = 3.0


def size_bucket(sizes: tuple) -> tuple:
    """Each dimension of each input rounded up to a power of two (0 and 1 stay)."""
    # (No function call per dimension: every call of a new size, or of a settled size
    # bucket, reads it.)
    return tuple([tuple([1 << (d - 1).bit_length() if d > 1 else d for d in shape]) for shape in sizes])


@dataclass(frozen=True)
class Decision:
    """The ``auto`` trial's verdict for one size bucket."""

    as_written: bool  # the model as written was faster
    executor: str  # the schedule's executor the trial kept
    why: str  # the trial's figures, as the plan states them
    sizes: tuple  # the sizes the trial ran
    # Seconds a call saved on the schedule against the model as written, where the
    # trial timed both (None: not measured): what a new size's plan must win back.
    gain_s: Optional[float] = None


class Structure:
    """What the wrapper knows about one call structure across sizes (module docstring)."""

    __slots__ = (
        "seen",
        "planned",
        "replans",
        "churning",
        "decisions",
        "trying",
        "waits",
        "handoffs",
        "plan",
        "capacity",
        "uniform",
        "nests",
        "record_s",
        "timed",
        "version",
        "_rare_kept",
        "clock",
    )

    def __init__(self, plan_cache_size: int, clock: Callable[[], int] = int):
        self.capacity = plan_cache_size
        # The wrapper's count of calls (``int``: 0, no clock): how long a size took to come back.
        self.clock = clock
        # Sizes called but not planned yet: how often, and the wrapper's call count at the
        # latest (how long they took to come back). Large, as its entries are small: a
        # size must still be here when it comes back (sizes cycled through a loader or a
        # bucketing scheme come back after all the others), else it is new every time.
        self.seen: LRU = LRU(max(1024, 4 * plan_cache_size))
        # Sizes that come back rarely, where no trial measured a gain yet: the seconds of
        # one as-written call (times GRAD_BOUND with autograd recording), what a plan of
        # them could save at most (:meth:`_too_rare`).
        self.timed: LRU = LRU(1024)
        # Moves whenever what a rare size is judged on may change (a recording call's
        # time, a trial's verdict); and per size, what it was judged on at a version
        # (:meth:`rare_again`).
        self.version = 0
        self._rare_kept: dict[tuple, tuple] = {}
        # Sizes planned before, to tell a re-plan (the plan was evicted) from a new size.
        self.planned: LRU = LRU(max(128, 8 * plan_cache_size))
        self.replans = 0
        self.churning = False
        self.decisions: LRU = LRU(64)
        # Buckets whose trial is under way: the sizes it runs at.
        self.trying: dict[tuple, tuple] = {}
        # Per bucket under trial: calls of its other sizes since the trial began.
        self.waits: dict[tuple, int] = {}
        # Per bucket: how often its trial was handed to another size.
        self.handoffs: dict[tuple, int] = {}
        # The structure's most recent plan: what ``sm.plan`` reports for its as-written calls.
        self.plan = None
        # Its first plan had nothing to schedule: one bucket for every size (ANY_SIZE).
        self.uniform = False
        # Decided to run as written with the children of its untraceable modules nested
        # (``new_signatures._nested_chain_reason``): its calls go through the nesting.
        self.nests = False
        # Seconds of the structure's recording calls (record, plan, compile; not the trace,
        # which its sizes share): what a plan of a new size costs, a running mean.
        self.record_s: Optional[float] = None

    def recorded(self, seconds: float) -> None:
        """A recording call of this structure took ``seconds``."""
        self.record_s = seconds if self.record_s is None else 0.5 * (self.record_s + seconds)
        self.version += 1

    def repays(self, decision: Decision) -> bool:
        """Whether a new size of a bucket decided for the schedule is worth its plan: the
        time the trial's schedule saved per call repays a recording call within
        :data:`PAYBACK_CALLS` calls (unknown figures: as before, planned)."""
        if decision.gain_s is None or self.record_s is None:
            return True
        return decision.gain_s > 0 and decision.gain_s * PAYBACK_CALLS >= self.record_s

    def bucket_of(self, sizes: tuple) -> tuple:
        """The bucket whose trial decides for ``sizes``."""
        return ANY_SIZE if self.uniform else size_bucket(sizes)

    def as_written_at_every_size(self) -> bool:
        """Whether every size of the structure was decided for the model as written: it
        has one bucket (nothing side by side or batched), decided so."""
        if not self.uniform:
            return False
        decision = self.decisions.get(ANY_SIZE)
        return decision is not None and decision.as_written

    def planned_in(self, bucket: tuple) -> list:
        """The sizes of ``bucket`` planned so far (their plans, where the cache still holds
        them, run as they were decided)."""
        return [sizes for sizes in self.planned.keys() if self.bucket_of(sizes) == bucket]

    def decision(self, bucket: tuple) -> Optional[Decision]:
        return self.decisions.get(bucket)

    def decide(self, bucket: tuple, decision: Decision) -> None:
        self.decisions.put(bucket, decision)
        self.version += 1
        self.trying.pop(bucket, None)
        self.waits.pop(bucket, None)

    def try_at(self, bucket: tuple, sizes: tuple) -> None:
        """The trial deciding ``bucket`` runs at ``sizes`` (a plan with a trial was made)."""
        self.trying[bucket] = sizes
        self.waits[bucket] = 0

    def _stalled(self, bucket: tuple, trying: tuple) -> Optional[AsWritten]:
        """The trial of ``bucket`` at ``trying`` waited :data:`STALL_CALLS` calls for its size."""
        waited = self.waits.pop(bucket, 0)
        del self.trying[bucket]
        handoffs = self.handoffs.get(bucket, 0)
        if bucket != ANY_SIZE and handoffs < MAX_HANDOFFS:
            # Hand over: the next size of the bucket that comes back is planned and tried
            # (the stalled trial goes on if its size does come back; the first to decide wins).
            self.handoffs[bucket] = handoffs + 1
            return None
        if bucket == ANY_SIZE:
            why = (
                f"its trial at sizes {sizes_text(trying)} was stalled: {waited} calls of other sizes came before "
                "that size came back, and with sizes this varied a schedule that can win only the forward's "
                "Python would pay a plan per size"
            )
        else:
            why = (
                f"its trials were stalled {handoffs + 1} times (the last at sizes {sizes_text(trying)}: {waited} "
                "calls of other sizes came before that size came back): with sizes this varied each would pay a "
                "plan for few calls"
            )
        self.decide(bucket, Decision(True, "serial", why, trying))
        return self.admit_decided(bucket)

    def admit_decided(self, bucket: tuple) -> Optional[AsWritten]:
        decision = self.decisions.get(bucket)
        if decision is None or not decision.as_written:
            return None
        return AsWritten(
            True,
            lambda: (
                f"{_bucket_text(bucket)} was decided for the model as written "
                f"(at sizes {sizes_text(decision.sizes)}: {decision.why})"
            ),
            True,
        )

    def expected_gain(self, bucket: tuple) -> Optional[float]:
        """Seconds a call of ``bucket`` is expected to save on a plan: its trial's figure,
        or for a bucket not decided yet the best of the structure's decided buckets (a
        bucket decided for the model as written saved nothing); None where unknown."""
        decision = self.decisions.get(bucket)
        if decision is not None:
            return 0.0 if decision.as_written else decision.gain_s
        gains = [0.0 if d.as_written else d.gain_s for d in self.decisions.values()]
        if not gains or None in gains:
            return None
        return max(gains)  # type: ignore[type-var]

    def _rarity(self, sizes: tuple, bucket: tuple, timeable: bool) -> Any:
        """What ``sizes``, should they come back rarely, are judged on (:class:`Rarity`):
        each call saving :meth:`expected_gain`, or where no trial measured a gain and the
        call can be timed (``timeable``: on the CPU), at most what the sizes' as-written
        call cost (:meth:`note_as_written`; :data:`TIME_IT` where it is not timed yet). None
        where nothing is known (no recording call yet, or a gain that cannot be bounded):
        planned."""
        record_s = self.record_s
        if record_s is None:
            return None
        gain = self.expected_gain(bucket)
        bound = False
        if gain is None:
            if not timeable:
                return None
            gain = self.timed.get_fresh(sizes)
            if gain is None:
                return TIME_IT
            bound = True
        # Back after more calls than this, the calls within PAYBACK_WINDOW (each saving
        # ``gain``) do not repay a recording call.
        threshold = max(PAYBACK_WINDOW / PAYBACK_CALLS, gain * PAYBACK_WINDOW / record_s)
        return Rarity(threshold, gain, bound, record_s)

    def _rare_verdict(self, sizes: tuple, bucket: Optional[tuple], interval: int, timeable: bool) -> Any:
        """How ``sizes``, back after ``interval`` calls of the wrapper, are judged: their
        :class:`Rarity` where they come back too rarely for their calls within
        :data:`PAYBACK_WINDOW` calls, each saving what :meth:`_rarity` says, to repay a
        recording call of the structure; :data:`TIME_IT` where that is their own
        as-written time, not measured yet; None where they are worth a plan. What they
        are judged on is kept per size until the structure's figures change
        (:attr:`version`): the settled layouts ask on every such call. ``bucket``: the
        sizes' bucket, or None to have it worked out where needed."""
        if interval * PAYBACK_CALLS <= PAYBACK_WINDOW:
            return None  # back often enough for :meth:`repays`'s count of calls
        stamp = (self.version, self.uniform, timeable)
        kept = self._rare_kept.get(sizes)
        if kept is not None and kept[0] == stamp:
            rarity = kept[1]
        else:
            rarity = self._rarity(sizes, self.bucket_of(sizes) if bucket is None else bucket, timeable)
            if rarity is None or rarity is TIME_IT:
                return rarity
            if len(self._rare_kept) >= MAX_RARE_KEPT:
                self._rare_kept.clear()
            self._rare_kept[sizes] = (stamp, rarity)
        return rarity if interval > rarity.threshold else None

    def _too_rare(self, sizes: tuple, bucket: tuple, interval: int, timeable: bool) -> Optional[AsWritten]:
        """Why ``sizes``, back after ``interval`` calls of the wrapper, are not worth a
        plan (None: they are), as :meth:`_rare_verdict` judges them. Where that is on the
        sizes' own as-written time and it is not measured yet, the call runs as written
        and is timed (``AsWritten.timed``), and the sizes are judged on it when they come
        back: a plan that could repay its recording call only by saving more than the
        whole call is not made."""
        verdict = self._rare_verdict(sizes, bucket, interval, timeable)
        if verdict is None:
            return None
        if verdict is TIME_IT:
            return AsWritten(
                False,
                lambda: (
                    f"sizes {sizes_text(sizes)} came back after {interval} calls, and what a plan saves is not "
                    "measured yet: this call runs as written and is timed, to judge the sizes on when they come back"
                ),
                rare=True,
                timed=True,
            )
        return AsWritten(False, lambda: rare_text(sizes, interval, verdict), rare=True)

    def rare_again(self, sizes: tuple) -> Optional[tuple[int, Rarity]]:
        """:meth:`admit` for ``sizes``, seen before and back now, where nothing but their
        rate can decide (their bucket neither decided nor under trial, no churn: the
        settled layouts' own check asks, ``settled_calls``): ``(interval, rarity)`` where
        they come back too rarely to repay a plan (counted as :meth:`admit` counts them:
        they run as written), None where the full path must judge them (a plan, or a call
        to time). The wrapper counts this call after the check: it is call
        ``clock() + 1``."""
        now = self.clock() + 1
        entry = self.seen.get(sizes)
        if entry is None:  # (dropped by another thread's call since the check found it)
            return None
        count, last = entry
        if count + 1 < PLAN_AFTER:
            return None
        verdict = self._rare_verdict(sizes, None, now - last, timeable=True)
        if verdict is None or verdict is TIME_IT:
            return None
        self.seen.put(sizes, (count, now))
        return now - last, verdict

    def note_as_written(self, sizes: tuple, seconds: float) -> None:
        """A call of ``sizes`` that :meth:`admit` asked to time (``AsWritten.timed``) ran
        as written in ``seconds`` (times :data:`GRAD_BOUND` where autograd recorded it)."""
        self.timed.put(sizes, seconds)
        self._rare_kept.pop(sizes, None)

    def admit(self, sizes: tuple, bucket: tuple, timeable: bool = False) -> Optional[AsWritten]:
        """``None`` to plan ``sizes`` now, else why the call runs as written.
        ``timeable``: the call's time as written is its work (on the CPU), so that a size
        coming back rarely may be judged on it (:meth:`_too_rare`)."""
        decided = self.admit_decided(bucket)
        if decided is not None:
            return decided
        trying = self.trying.get(bucket)
        if trying is not None and trying != sizes:
            waited = self.waits.get(bucket, 0) + 1
            self.waits[bucket] = waited
            if waited < STALL_CALLS:
                return AsWritten(
                    False,
                    lambda: (
                        f"{_bucket_text(bucket)} is being decided by the trial at sizes {sizes_text(trying)}: "
                        "until it is, other sizes run as written"
                    ),
                )
            stalled = self._stalled(bucket, trying)
            if stalled is not None:
                return stalled
        if self.churning:
            planned, replans = len(self.planned), self.replans
            return AsWritten(
                True,
                lambda: (
                    f"sizes churn through the plan cache ({planned} sizes planned, {replans} of them again after "
                    "eviction): new sizes of this call structure run as written; raise plan_cache_size to plan them"
                ),
            )
        decision = self.decisions.get(bucket)
        if decision is not None and not self.repays(decision):
            gain_us, record_ms = decision.gain_s * 1e6, self.record_s * 1e3
            return AsWritten(
                True,
                lambda: (
                    f"{_bucket_text(bucket)} was decided for the schedule (at sizes {sizes_text(decision.sizes)}), "
                    f"but its {gain_us:.0f} us a call would take more than {PAYBACK_CALLS} calls to repay a "
                    f"{record_ms:.1f} ms recording call: its new sizes run as written"
                ),
                True,
            )
        now = self.clock()
        count, last = self.seen.get(sizes) or (0, now)
        count += 1
        if count < PLAN_AFTER:
            self.seen.put(sizes, (count, now))
            return AsWritten(
                False,
                lambda: f"sizes {sizes_text(sizes)} are new to this call structure: they are planned if they come back",
                fresh=True,
            )
        rare = self._too_rare(sizes, bucket, now - last, timeable)
        if rare is not None:
            # Judged again when it next comes back, on the calls between then and now.
            self.seen.put(sizes, (count - 1, now))
            return rare
        self.seen.pop(sizes, None)
        self.timed.pop(sizes, None)
        self._rare_kept.pop(sizes, None)
        if sizes in self.planned:
            self.replans += 1
        self.planned.put(sizes, True)
        if self.replans >= CHURN_REPLANS or len(self.planned) > CHURN_SIZES * self.capacity:
            self.churning = True
        return None


class Rarity(NamedTuple):
    """What a size that comes back rarely is judged on (``Structure._rarity``)."""

    # Back after more calls of the wrapper than this, it runs as written.
    threshold: float
    # What each of its calls is taken to save, in seconds.
    per_call_s: float
    # Whether that is a bound (the sizes' as-written time) rather than a trial's figure.
    bound: bool
    # The structure's recording call it would have to repay, in seconds.
    record_s: float


# ``Structure._rarity`` where a size must be timed as written before it is judged.
TIME_IT: Any = object()
# Sizes whose rarity ``Structure.rare_again`` keeps (forgotten all at once when full).
MAX_RARE_KEPT = 1024


def rare_text(sizes: tuple, interval: int, rarity: Rarity) -> str:
    """Why ``sizes``, back after ``interval`` calls, run as written (``sm.plan``)."""
    calls = PAYBACK_WINDOW / interval
    per_call_us, record_ms = rarity.per_call_s * 1e6, rarity.record_s * 1e3
    saving = (
        f"even a plan taking all of their {per_call_us:.0f} us off each of {calls:.0f} calls"
        if rarity.bound
        else f"a plan would save about {per_call_us:.0f} us on each of {calls:.0f} calls"
    )
    return (
        f"sizes {sizes_text(sizes)} came back after {interval} calls: at that rate {saving} in the next "
        f"{PAYBACK_WINDOW}, less than its {record_ms:.1f} ms recording call; they run as written (planned if they "
        "come back more often)"
    )


class AsWritten(NamedTuple):
    """Why a call of a size without a plan runs as written (:meth:`Structure.admit`)."""

    # Whether the answer stands for every later call of these sizes (a bucket decided
    # for the model as written, churn), so the wrapper may remember it per signature;
    # "new size" and "trial under way" change with the next calls.
    settled: bool
    # The reason as text, made only when someone reads the plan: building it on every
    # call would cost more than the as-written call saves.
    why: Callable[[], str]
    # Whether it stands for every size of the call's size bucket that was not planned
    # (the bucket was decided for the model as written, or for a schedule that would not
    # repay a plan per size: :meth:`Structure.planned_in` keep their plans), not only for
    # these sizes (churn: new sizes of every bucket run as written).
    whole_bucket: bool = False
    # Whether the call runs as written because its sizes are new (counted in
    # :attr:`Structure.seen`): any new size of the structure would run so, and the
    # wrapper's settled layouts may count the next ones themselves (settled_calls.py).
    fresh: bool = False
    # Whether the call runs as written because its sizes come back too rarely to repay a
    # plan (:meth:`Structure._too_rare`): the wrapper's settled layouts may judge their
    # next calls themselves (:meth:`Structure.rare_again`), as they count new sizes.
    rare: bool = False
    # Whether the wrapper times this call and hands the seconds to
    # :meth:`Structure.note_as_written` (a size that comes back rarely, judged on them).
    timed: bool = False


def _bucket_text(bucket: tuple) -> str:
    if bucket == ANY_SIZE:
        return "every size of this call structure (its plan has nothing to run side by side or batch)"
    return f"the size bucket {sizes_text(bucket)}"


def sizes_text(sizes: tuple) -> str:
    """``sizes`` as text: ``4x16, 8`` for two inputs."""
    if sizes == ANY_SIZE:
        return "(every size)"
    return ", ".join("x".join(map(str, s)) or "scalar" for s in sizes)
