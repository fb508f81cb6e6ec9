"""Temporary alias: fusion moved to :mod:`streamsched.passes.fusion`.

Only ``streamsched/module.py`` still imports ``FusionContext`` from here; delete this
file once it imports ``from .passes.fusion import FusionContext``.
"""

from __future__ import annotations

from .passes.fusion import FusionContext

__all__ = ["FusionContext"]
