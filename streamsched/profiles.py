"""``streamsched.profiles``, the documented name of :mod:`streamsched.observe.profiles`.

Schedule profiles are measured by observing calls, so they live with the observers; this
keeps ``from streamsched.profiles import measure_profile, load_profile`` working.
"""

from __future__ import annotations

from .observe.profiles import ScheduleProfile, check_profile, load_profile, measure_profile, profile_costs

__all__ = ["ScheduleProfile", "measure_profile", "load_profile", "check_profile", "profile_costs"]
