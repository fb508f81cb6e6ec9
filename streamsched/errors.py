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

import os
import sys

import torch

# Frames in these folders are library frames: a warning points past them, at the line
# of the user's code that called into the library.
_LIBRARY_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` made by the caller of this function
    point at the first frame outside streamsched and PyTorch: the user's line that called
    the wrapped model (through ``nn.Module.__call__`` and any number of library frames),
    not a library line that depends on how the call path is built."""
    # warnings.warn counts the caller as level 1, then only frames outside importlib's
    # bootstrap (an import-time warning passes through those): count the same way.
    level = 0
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            level += 1
            if not filename.startswith(_LIBRARY_DIRS):
                return level
        frame = frame.f_back
    return max(level, 1)


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


class FusedMembersReshaped(StreamSchedError, RuntimeError):
    """A member of a fused group was given a tensor of another shape since planning
    (``lin.weight.data = torch.randn(...)`` of a wider layer): the fused kernels' shapes
    are the plan's. The wrapper catches it before any task runs and plans the model again."""


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


def first_line(reason: object) -> str:
    """The first line of ``reason`` (an exception or its text), or, where it has none,
    the exception's type name: what a one-line summary of a failure shows."""
    return (str(reason).strip().splitlines() or [type(reason).__name__])[0]


def raised_in(exc: BaseException, model: torch.nn.Module) -> str | None:
    """Where in ``model`` ``exc`` was raised, read from its traceback: the path of the
    module whose code ran the innermost frame that one of the model's modules ran
    (``"towers.0.fc"``, ``""`` for the model's own forward), or ``None`` when no module's
    code is on it. For the calls that run the model's own forward (as written, eager
    dispatch), whose errors no plan node names."""
    paths = {id(m): path for path, m in model.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            found = paths[id(owner)]
        tb = tb.tb_next
    return found
