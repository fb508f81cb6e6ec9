"""Loading the optional native runtime ``streamsched._C``, failing well.

If the extension is missing or cannot be loaded, streamsched keeps working on its
pure-Python runtime (same decisions, same SyncLog, more host time per task) and says so
once. ``STREAMSCHED_REQUIRE_EXT=1`` turns that fallback into an
:class:`~streamsched.errors.ExtensionError` (CI sets it, so a broken build cannot pass
silently); ``STREAMSCHED_DISABLE_EXT=1`` forces the Python runtime (to compare the two).

An install can also lose only the CUDA backend: ``pip install`` with ``USE_CUDA=auto``
(the default) builds a CPU-only extension where no usable CUDA toolkit is found. On a
CUDA build of PyTorch that is said once at import too, with the command that builds the
backend (:func:`cuda_backend_missing`, :func:`build_hint`); ``python -m streamsched info``
says it as well.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from types import ModuleType
from typing import Any, Optional

import torch

from .errors import ExtensionError, user_stacklevel

__all__ = ["native", "runtime_info", "cuda_backend_missing", "build_hint"]

# How to get the extension: a pip user reinstalls (the build needs a C++ compiler and the
# PyTorch it builds against, hence --no-build-isolation); from a checkout, make builds it.
_PIP_REBUILD = "pip install --force-reinstall --no-deps --no-build-isolation streamsched"


def build_hint(cuda: bool = False) -> str:
    """How to build the native runtime (with its CUDA backend when ``cuda``), for pip users
    and from a source checkout."""
    if cuda:
        return (
            f"rebuild it with CUDA: `USE_CUDA=1 {_PIP_REBUILD}` (a CUDA toolkit matching PyTorch's CUDA "
            "version, found at $CUDA_HOME or /usr/local/cuda; USE_CUDA=1 makes a failed CUDA build an "
            "error instead of a CPU-only install; add -v to see the compiler), or from a source checkout "
            "`USE_CUDA=1 python setup.py build_ext --inplace`"
        )
    return (
        f"reinstall it with `{_PIP_REBUILD}` (needs a C++ compiler; add -v to see the build, and "
        "STREAMSCHED_REQUIRE_EXT=1 to make a failed build an error), or from a source checkout run `make ext`"
    )


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
            f"To build it, {build_hint()}."
        )
    if "disabled" not in _reason:
        warnings.warn(
            f"streamsched: using the pure-Python runtime ({_reason}); results are the same, "
            f"host overhead per task is higher. To build the extension, {build_hint()}.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )


def cuda_backend_missing() -> bool:
    """Whether PyTorch is a CUDA build but the loaded native runtime was compiled without
    its CUDA backend (CUDA streams then run their bookkeeping in Python)."""
    return _module is not None and torch.version.cuda is not None and not _module.cuda_compiled()


if cuda_backend_missing():
    warnings.warn(
        f"streamsched: the native runtime was built without its CUDA backend, but PyTorch {torch.__version__} "
        f"is a CUDA {torch.version.cuda} build: on CUDA the streams executor's bookkeeping runs in Python "
        f"(same results, more host time per task). To {build_hint(cuda=True)}.",
        RuntimeWarning,
        stacklevel=user_stacklevel(),
    )


def native() -> Optional[ModuleType]:
    """The loaded ``streamsched._C`` module, or ``None``."""
    return _module


def runtime_info() -> dict[str, Any]:
    """Which runtime is active and why, with the versions that matter.

    Example::

        >>> info = runtime_info()
        >>> sorted(info)  # doctest: +NORMALIZE_WHITESPACE
        ['build_hint', 'cuda_available', 'native', 'native_cuda', 'native_cuda_missing', 'python', 'reason',
         'runtime', 'torch', 'torch_cuda']

    ``native_cuda_missing`` is true on a CUDA build of PyTorch whose native runtime lacks
    the CUDA backend; ``build_hint`` says how to build what is missing (``None`` when
    nothing is).
    """
    native_cuda = bool(_module is not None and _module.cuda_compiled())
    missing = cuda_backend_missing()
    if _module is None and "disabled" not in _reason:
        hint: Optional[str] = build_hint()
    elif missing:
        hint = build_hint(cuda=True)
    else:
        hint = None
    return {
        "runtime": "native" if _module is not None else "python",
        "native": _module is not None,
        "native_cuda": native_cuda,
        "native_cuda_missing": missing,
        "build_hint": hint,
        "reason": _reason or ("loaded, without its CUDA backend" if missing else "loaded"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "python": sys.version.split()[0],
    }
