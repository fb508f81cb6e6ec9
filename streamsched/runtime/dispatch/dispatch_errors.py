"""The error eager dispatch raises when a branch cannot run beside the code after its call."""

from __future__ import annotations

from ...errors import StreamSchedError


class EagerDispatchError(StreamSchedError, RuntimeError):
    """A branch did something that cannot run beside the code after its call."""
