"""Whether nesting pays, measured on the whole call of the outermost wrapper.

A nested child's own ``auto`` trial (``planning.choice.Trial``) compares its schedule
with its forward as written, both inside its wrapper. What nesting costs besides is not
in it: the child's wrapper call (binding, keys, the nested forward), and the wrappers of
its parents down to it, which are called through only while a child below them is
nested (a decoder layer's wrapper, for the MLP inside it). On a tiny decoder (GPT-2, 8
layers of width 32, a decoding loop) each nested MLP's trial measured its plan 15-20 us
faster than its forward, and each cost the decoding step about 100 us: 1.12-1.25x
eager per token, more the more MLPs kept their plans.

So the outermost wrapper whose forward runs as written with its children nested
(``Runner.forward_nesting``: a call passing an object, an untraceable forward) times its
own calls both ways once its children went quiet or settled: *nested*, as it runs them,
and *plain*, the forward as written with nothing nested (what eager runs). The two
alternate on calls of one signature less its sizes (a decoding loop's steps: the cache
object grows, and the attention mask by a token a call; grad mode is part of it);
a nested call in which a child planned or ran a trial call is left out (it paid for
something else). The forwards are timed, not a training call's backward: where nested
plans would win only there, the children run as written, as eager does. Nesting is
kept where its fastest call beats the plain one's by :data:`MARGIN`; otherwise every
child stops being nested until the retry (``nesting._RETRY_EVERY`` calls of the parent,
twice as many after each such verdict in a row, up to ``nesting._MAX_SPACING`` times),
which nests them again, their plans kept, and this trial measures anew. The verdict,
measured on one signature, holds for every call of the model until then, as a child's
quiet flag does.

Only a wrapper that may settle to run as written has the trial (``executor="auto"``,
no ``sync_log``, ``chaos``, CUDA graph or direct gradient hand-off: those ask for the
schedule itself, or gain in a backward that forward timings do not see).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["NestingTrial"]

# Calls of the parent before timing begins: a nested child that only runs as written is
# handed back within nesting._QUIET_CALLS calls, and children's trials decide meanwhile.
SETTLE_CALLS = 16
# Calls of each way timed before deciding, and at most (a close call gets more).
ROUNDS = 5
MAX_ROUNDS = 12
# Nesting is kept only where its fastest call is this much faster than the plain one's:
# within it the two are alike, and the plain forward is what eager runs.
MARGIN = 0.01
# A difference this large decides after ROUNDS calls of each.
CLOSE = 0.04
# Calls of other signatures in a row after which the trial times the current one instead.
REKEY_CALLS = 32
# Nested calls left out (a child planned in them) before they count as they come.
MAX_SKIPPED = 16

NESTED, PLAIN = "nested", "plain"


class NestingTrial:
    """The outermost wrapper's measurement of nesting against the forward as written.

    ``way(key)`` says how the call with signature ``key`` runs (``None``: nested, not
    timed); the caller times it and hands the seconds to ``add``; ``verdict`` is
    ``None`` until decided, then :data:`NESTED` or :data:`PLAIN`, with ``reason``.
    ``restart()`` begins again (the children were nested anew).

    >>> trial = NestingTrial()
    >>> trial.calls = SETTLE_CALLS
    >>> ways = []
    >>> for _ in range(2 * ROUNDS):
    ...     way = trial.way("k")
    ...     ways.append(way)
    ...     trial.add(way, 2.0 if way == NESTED else 1.0)
    >>> trial.verdict, ways[:2]
    ('plain', ['plain', 'nested'])
    """

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.calls = 0
        self.key: Any = None
        self.samples: dict[str, list[float]] = {NESTED: [], PLAIN: []}
        self.turn = 0
        self.others = 0
        self.skipped = 0
        self.verdict: Optional[str] = None
        self.reason = ""

    def way(self, key: Any) -> Optional[str]:
        """How the call with signature ``key`` runs while the trial goes on: timed
        plain or nested, or (``None``) nested and not timed."""
        if self.verdict is not None:
            return None
        self.calls += 1
        if self.calls <= SETTLE_CALLS:
            return None
        if key != self.key:
            if self.key is not None and self.others < REKEY_CALLS:
                self.others += 1
                return None
            self.key = key  # the first signature timed, or one that stopped coming
            self.samples = {NESTED: [], PLAIN: []}
            self.turn = 0
        self.others = 0
        self.turn += 1
        return PLAIN if self.turn % 2 else NESTED

    def skip(self) -> bool:
        """Leave out the nested call just timed (a child planned in it); ``False`` once
        enough were left out (children that plan on every call: their cost counts)."""
        if self.skipped >= MAX_SKIPPED:
            return False
        self.skipped += 1
        self.turn -= 1  # nested runs again next
        return True

    def add(self, way: str, seconds: float) -> None:
        self.samples[way].append(seconds)
        nested, plain = self.samples[NESTED], self.samples[PLAIN]
        counts = min(len(nested), len(plain))
        if counts < ROUNDS:
            return
        best_nested, best_plain = min(nested), min(plain)
        close = best_plain > 0 and abs(best_nested / best_plain - 1.0) < CLOSE
        if close and counts < MAX_ROUNDS:
            return
        keep = best_nested < (1.0 - MARGIN) * best_plain
        self.verdict = NESTED if keep else PLAIN
        figures = (
            f"nested {best_nested * 1e6:.1f} us, as written {best_plain * 1e6:.1f} us "
            f"(fastest of {len(nested)} and {len(plain)} calls)"
        )
        if keep:
            self.reason = f"nested children's plans kept: the call measured {figures}"
        else:
            self.reason = (
                f"nested children's plans measured no faster than the forward as written ({figures}): "
                "the children run as written until they are tried again"
            )
