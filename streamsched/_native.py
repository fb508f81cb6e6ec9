"""Loading the optional native runtime ``streamsched._C``, failing well.

If the extension is missing or cannot be loaded, streamsched keeps working on its
pure-Python runtime (same decisions, same SyncLog, more host time per task) and says so
once. ``STREAMSCHED_REQUIRE_EXT=1`` turns that fallback into an
:class:`~streamsched.errors.ExtensionError` (CI sets it, so a broken build cannot pass
silently); ``STREAMSCHED_DISABLE_EXT=1`` forces the Python runtime (to compare the two).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from types import ModuleType
from typing import Any, Optional

import torch

from .errors import ExtensionError

__all__ = ["native", "runtime_info"]

_module: Optional[ModuleType] = None
_reason = ""

if os.environ.get("STREAMSCHED_DISABLE_EXT", "0") == "1":
    _reason = "disabled by STREAMSCHED_DISABLE_EXT=1"
elif importlib.util.find_spec(f"{__package__}._C") is None:
    # Without this check Python reports a missing module as "cannot import name '_C'
    # from partially initialized module (most likely due to a circular import)".
    _reason = "streamsched._C is not built (no compiled extension next to the package)"
else:
    try:
        from . import _C as _module  # type: ignore[attr-defined, no-redef]
    except ImportError as exc:
        _module = None
        _reason = f"streamsched._C could not be imported: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken binary raises all sorts of things
        _module = None
        _reason = f"streamsched._C failed to load: {type(exc).__name__}: {exc}"

if _module is None:
    if os.environ.get("STREAMSCHED_REQUIRE_EXT", "0") == "1":
        raise ExtensionError(
            f"STREAMSCHED_REQUIRE_EXT=1 but the native runtime is not available ({_reason}). "
            "Build it with `make ext` (or `python setup.py build_ext --inplace`); see the README."
        )
    if "disabled" not in _reason:
        warnings.warn(
            f"streamsched: using the pure-Python runtime ({_reason}); results are the same, "
            "host overhead per task is higher. Build the extension with `make ext`.",
            RuntimeWarning,
            stacklevel=2,
        )


def native() -> Optional[ModuleType]:
    """The loaded ``streamsched._C`` module, or ``None``."""
    return _module


def runtime_info() -> dict[str, Any]:
    """Which runtime is active and why, with the versions that matter.

    Example::

        >>> info = runtime_info()
        >>> sorted(info)  # doctest: +NORMALIZE_WHITESPACE
        ['cuda_available', 'native', 'native_cuda', 'python', 'reason', 'runtime', 'torch', 'torch_cuda']
    """
    native_cuda = bool(_module is not None and _module.cuda_compiled())
    return {
        "runtime": "native" if _module is not None else "python",
        "native": _module is not None,
        "native_cuda": native_cuda,
        "reason": _reason or "loaded",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "python": sys.version.split()[0],
    }
