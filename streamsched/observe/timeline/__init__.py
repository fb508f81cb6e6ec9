"""Measured timelines: see :mod:`streamsched.observe.timeline.model`."""

from .model import (
    IdleGap,
    ObservedCall,
    TaskSpan,
    Timeline,
    build_timeline,
    draw_gantt,
    fit_label,
    label_candidates,
    measured_critical_path,
    model_parts,
    record_runs,
    timeline,
)
from .model import _gaps as _gaps  # a private helper tests/test_observe.py checks directly
from .model import device_name as device_name  # observe.profiles imports it from here

__all__ = [
    "Timeline",
    "TaskSpan",
    "IdleGap",
    "ObservedCall",
    "timeline",
    "record_runs",
    "draw_gantt",
    "build_timeline",
    "measured_critical_path",
    "model_parts",
    "fit_label",
    "label_candidates",
]
