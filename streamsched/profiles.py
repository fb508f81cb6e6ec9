"""``streamsched.profiles``, the short public name of :mod:`streamsched.observe.schedule_profiles`.

Schedule profiles are measured by observing calls, so they live with the observers; this
keeps ``from streamsched.profiles import measure_profile, load_profile`` working.
"""

from __future__ import annotations

from .observe.schedule_profiles import ScheduleProfile, check_profile, load_profile, measure_profile, profile_costs

__all__ = ["ScheduleProfile", "measure_profile", "load_profile", "check_profile", "profile_costs"]
