"""The measured pieces of a timeline: one task's span, one stream's idle gap, and how a
duration in microseconds is written."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["TaskSpan", "IdleGap", "fmt_us"]


class TaskSpan(BaseModel):
    """One task of the kept run, in microseconds since the call started."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: int
    name: str
    stream: int
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


class IdleGap(BaseModel):
    """Time a stream sat idle between two consecutive tasks of its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stream: int
    after_task: int
    before_task: int
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def fmt_us(value: float) -> str:
    """``value`` microseconds as text: ``"812.4 us"``, ``"20.51 ms"``."""
    if abs(value) >= 1000:
        return f"{value / 1000:.2f} ms"
    return f"{value:.1f} us"
