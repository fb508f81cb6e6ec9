"""Exceptions raised by streamsched.

Every error the library raises on its own account derives from
:class:`StreamSchedError`, and also from the built-in type a user would expect
(``ValueError`` for a bad option, ``RuntimeError`` for a model that cannot be traced),
so ``except ValueError`` keeps working in code that does not know about streamsched.

Errors that come from the user's model itself (a shape mismatch inside a branch, say)
are *not* wrapped: they propagate with their original type, as in eager PyTorch, with
the module path added to the message.
"""

from __future__ import annotations


class StreamSchedError(Exception):
    """Base class of every error raised by streamsched itself."""


class ConfigError(StreamSchedError, ValueError):
    """A scheduler option is misspelt, of the wrong type, or out of range."""


class TraceError(StreamSchedError, RuntimeError):
    """The model cannot be traced into a graph of submodule calls."""


class PlanError(StreamSchedError, ValueError):
    """A plan is inconsistent (for instance a JSON plan that does not fit the model)."""


class ExtensionError(StreamSchedError, ImportError):
    """The compiled extension ``streamsched._C`` is required but cannot be loaded."""


class ProfileMismatchError(StreamSchedError, ValueError):
    """A stored schedule profile was made for another model, input or device."""


class HooksWarning(UserWarning):
    """The wrapped model itself has hooks, or global module hooks are registered: no
    schedule can fire them where eager does, so the model runs as written (its own
    ``__call__``) while they are there. Register hooks on the ``StreamScheduledModule``
    (they fire around each call) or on submodules (a hooked submodule runs as one call
    of its own, its hooks firing as in eager) to keep the schedule."""


class UntraceableWarning(UserWarning):
    """The model's own ``forward`` cannot be traced; it runs as written (eager dispatch).

    Raised as an error instead with ``strict=True``; silenced like any warning::

        warnings.filterwarnings("ignore", category=streamsched.errors.UntraceableWarning)
    """
