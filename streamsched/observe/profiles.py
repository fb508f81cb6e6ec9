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
"""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path
from typing import Any, Literal, Union

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
    task_us: dict[str, float]
    """Per task name, the median of its measured duration (microseconds) over the runs."""
    plan: Plan
    """The plan the measurements were taken with."""

    def save(self, path: Union[str, Path]) -> Path:
        """Write the profile as JSON (creating the folder); return the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.model_dump_json(indent=2))
        return out


def measure_profile(sm: Observable, *inputs: Any, runs: int = 5) -> ScheduleProfile:
    """Measure each task of ``sm(*inputs)`` over ``runs`` observed calls (after warming up).

    A task's cost is its duration (end - start, CUDA events on the GPU, the host clock on
    the CPU); the profile keeps the median per task name. Call it in the grad mode the
    profile is for (``torch.no_grad()`` for inference).
    """
    observed = record_runs(sm, *inputs, runs=runs, warmup=2)
    durations: dict[str, list[float]] = {}
    for call in observed:
        for span in call.spans:
            durations.setdefault(span.name, []).append(span.duration_us)
    plan = observed[-1].schedule.plan
    return ScheduleProfile(
        model=plan.model,
        signature=plan.signature,
        device=plan.device,
        device_name=device_name(plan.device),
        torch_version=torch.__version__,
        streamsched_version=__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        executor=plan.schedule_executor,
        runs=len(observed),
        task_us={name: round(statistics.median(values), 3) for name, values in durations.items()},
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
