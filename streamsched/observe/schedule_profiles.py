"""Schedule profiles: measured task costs and the plan they were measured with, as JSON.

The planner estimates each task's cost from FLOPs and bytes; a profile replaces the
estimates with what the tasks took on a real device. A profile belongs to one model, one
input signature and one device: :func:`check_profile` refuses any other, naming what
differs, because costs measured for another shape or GPU would mislead the planner.

Example::

    >>> prof = measure_profile(sm, x, runs=5)                      # doctest: +SKIP
    >>> prof.save("profiles/inception-1x3x299x299-h100.json")      # doctest: +SKIP
    >>> prof = load_profile("profiles/inception-1x3x299x299-h100.json")   # doctest: +SKIP
    >>> check_profile(prof, "Inception3", sm.plan.signature, sm.plan.device)  # doctest: +SKIP
    >>> profile_costs(prof)["fc"]                                  # doctest: +SKIP
    41.7

From the command line: ``python -m streamsched profile MODULE:FACTORY --input-shape ... --out PATH.json``.

Measurements on a shared machine wander (another process takes the cores for a while, a
GPU clocks down): one round of calls can come out hundreds of times slower than the next.
So a profile is taken in several *rounds* of calls; a task's figure in a round is its
median over the round's calls, and the profile keeps the fastest round's figure (other
work only ever adds time) together with the *spread* of the rounds, (slowest - fastest) /
fastest, per task and for the total. :meth:`ScheduleProfile.spread` and
:meth:`ScheduleProfile.unsteady_tasks` say whether the figures can be trusted; the CLI
warns about unsteady tasks and refuses to write a profile whose total spread exceeds
``--max-spread``.
"""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from .._version import __version__
from ..envinfo import device_name
from ..errors import ConfigError, ProfileMismatchError
from ..planning.plan import Plan
from .observable import Observable
from .timeline import record_runs

__all__ = ["ScheduleProfile", "measure_profile", "load_profile", "check_profile", "profile_costs"]

PROFILE_FORMAT = "streamsched-profile/1"


class ScheduleProfile(BaseModel):
    """Measured per-task costs of one model, input signature and device, with the plan used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["streamsched-profile/1"] = PROFILE_FORMAT
    model: str
    """The wrapped model's class name."""
    signature: str
    """The input signature, as in ``Plan.signature`` (``"float32[1, 3, 299, 299]"``)."""
    device: str
    """The plan's device (``"cuda:0"``, ``"cpu"``)."""
    device_name: str
    """What the device is (``"NVIDIA H100 80GB HBM3"``): costs do not carry across GPUs."""
    torch_version: str
    streamsched_version: str
    date: str
    """When it was measured (ISO 8601, UTC)."""
    executor: str
    runs: int = Field(ge=1)
    """Observed calls per round."""
    rounds: int = Field(default=1, ge=1)
    """Rounds of ``runs`` calls each (profiles from before rounds existed have one)."""
    task_us: dict[str, float]
    """Per task name, its duration in microseconds: the median over a round's calls, of
    the fastest round."""
    task_spread: dict[str, float] = {}
    """Per task name, how far its round medians spread: (slowest - fastest) / fastest
    (0.0 with one round)."""
    round_total_us: list[float] = []
    """Per round measured, the sum of its task medians (microseconds)."""
    kept_rounds: list[int] = []
    """The rounds (indices into ``round_total_us``) the figures come from; empty: all.
    Measured until steady, a profile sets aside the rounds another process slowed."""
    plan: Plan
    """The plan the measurements were taken with."""

    def spread(self) -> float:
        """How far the rounds' total task times spread: (slowest - fastest) / fastest;
        0.0 with fewer than two rounds."""
        return _spread(self.kept_totals())

    def kept_totals(self) -> list[float]:
        """The total task time of each round the figures come from."""
        if not self.kept_rounds:
            return list(self.round_total_us)
        return [self.round_total_us[i] for i in self.kept_rounds]

    def unsteady_tasks(self, limit: float, min_share: float = 0.01) -> list[tuple[str, float]]:
        """Tasks whose spread exceeds ``limit`` and whose figure is at least ``min_share``
        of the total task time (a task of a few microseconds wanders by itself and weighs
        nothing in the plan), widest first."""
        total = sum(self.task_us.values()) or 1.0
        wide = [
            (name, spread)
            for name, spread in self.task_spread.items()
            if spread > limit and self.task_us.get(name, 0.0) >= min_share * total
        ]
        return sorted(wide, key=lambda item: -item[1])

    def save(self, path: Union[str, Path]) -> Path:
        """Write the profile as JSON (creating the folder); return the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.model_dump_json(indent=2))
        return out


def _spread(values: list[float]) -> float:
    if len(values) < 2 or min(values) <= 0:
        return 0.0
    return (max(values) - min(values)) / min(values)


def _fastest(totals: list[float], count: int) -> list[int]:
    """The indices of the ``count`` smallest totals, in measurement order."""
    return sorted(sorted(range(len(totals)), key=lambda i: totals[i])[:count])


def measure_profile(
    sm: Observable,
    *inputs: Any,
    runs: int = 5,
    rounds: int = 3,
    steady: Optional[float] = None,
    max_rounds: Optional[int] = None,
) -> ScheduleProfile:
    """Measure each task of ``sm(*inputs)`` in ``rounds`` rounds of ``runs`` observed calls
    (after warming up).

    A task's cost is its duration (end - start, CUDA events on the GPU, the host clock on
    the CPU). Per round, the median per task name; the profile keeps each task's fastest
    round median and the spread of its round medians (see :class:`ScheduleProfile`). Call
    it in the grad mode the profile is for (``torch.no_grad()`` for inference).

    With ``steady`` (a spread, 0.5 = the slowest round 50% over the fastest), rounds go on,
    up to ``max_rounds`` (default ``3 * rounds``), until the fastest ``rounds`` of them
    spread no more than that: a round another process slowed is set aside (it stays in
    ``round_total_us``; ``kept_rounds`` names the rounds the figures come from).
    """
    for name, value in (("rounds", rounds), ("max_rounds", rounds if max_rounds is None else max_rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    limit = max(rounds, 3 * rounds if max_rounds is None else max_rounds) if steady is not None else rounds
    medians: dict[str, list[float]] = {}
    totals: list[float] = []
    schedule: Any = None
    for r in range(limit):
        if r >= rounds and steady is not None and _spread([totals[i] for i in _fastest(totals, rounds)]) <= steady:
            break
        observed = record_runs(sm, *inputs, runs=runs, warmup=2 if r == 0 else 1)
        durations: dict[str, list[float]] = {}
        for call in observed:
            for span in call.spans:
                durations.setdefault(span.name, []).append(span.duration_us)
        round_medians = {name: statistics.median(values) for name, values in durations.items()}
        if schedule is not None and observed[-1].schedule is not schedule:
            raise RuntimeError(
                f"{schedule.plan.model}: the plan changed between rounds (the module was re-planned); "
                "profile it with the same inputs and do not modify it while measuring"
            )
        schedule = observed[-1].schedule
        for name, value in round_medians.items():
            medians.setdefault(name, []).append(value)
        totals.append(round(sum(round_medians.values()), 3))
    kept = _fastest(totals, rounds)
    plan = schedule.plan
    # One plan throughout: every task has a median in every round.
    kept_medians = {name: [values[i] for i in kept] for name, values in medians.items()}
    return ScheduleProfile(
        model=plan.model,
        signature=plan.signature,
        device=plan.device,
        device_name=device_name(plan.device),
        torch_version=torch.__version__,
        streamsched_version=__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        executor=plan.schedule_executor,
        runs=runs,
        rounds=len(totals),
        task_us={name: round(min(values), 3) for name, values in kept_medians.items()},
        task_spread={name: round(_spread(values), 4) for name, values in kept_medians.items()},
        round_total_us=totals,
        kept_rounds=kept if len(kept) < len(totals) else [],
        plan=plan,
    )


def load_profile(path: Union[str, Path]) -> ScheduleProfile:
    """Read a profile written by :meth:`ScheduleProfile.save`.

    Raises ``FileNotFoundError`` for a missing file and :class:`~streamsched.errors.ConfigError`
    (a ``ValueError``) naming the file for one that is not a streamsched profile.
    """
    source = Path(path)
    text = source.read_text()
    try:
        return ScheduleProfile.model_validate_json(text)
    except ValueError as exc:
        raise ConfigError(f"{source} is not a streamsched schedule profile ({PROFILE_FORMAT}): {exc}") from None


def _same_device(a: str, b: str) -> bool:
    # "cuda" and "cuda:0" name the same device when 0 is the current one; compare parsed.
    try:
        da, db = torch.device(a), torch.device(b)
    except RuntimeError:
        return a == b
    if da.type != db.type:
        return False
    if da.type == "cuda" and (da.index is None or db.index is None):
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return (current if da.index is None else da.index) == (current if db.index is None else db.index)
    return da.index == db.index


def check_profile(profile: ScheduleProfile, model_name: str, signature: str, device: str) -> None:
    """Raise :class:`~streamsched.errors.ProfileMismatchError` unless ``profile`` was measured
    for this model, input signature and device; the message names each field that differs
    and both values."""
    differences = []
    if profile.model != model_name:
        differences.append(f"model: the profile is for {profile.model!r}, this module wraps {model_name!r}")
    if profile.signature != signature:
        differences.append(
            f"input signature: the profile was measured with {profile.signature!r}, this call has {signature!r}"
        )
    if not _same_device(profile.device, device):
        differences.append(f"device: the profile was measured on {profile.device!r}, this call runs on {device!r}")
    if differences:
        raise ProfileMismatchError(
            "the schedule profile does not fit: "
            + "; ".join(differences)
            + ". Measure a new one with `python -m streamsched profile` or drop the profile option."
        )


def profile_costs(profile: ScheduleProfile) -> dict[str, float]:
    """Task name -> measured microseconds, for the planner."""
    return dict(profile.task_us)
