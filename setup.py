"""Build of the optional native runtime ``streamsched._C``.

``USE_CUDA=auto|0|1`` (default ``auto``: CUDA when the installed PyTorch was built with
it and a CUDA toolkit is found). Without CUDA the same module is built from the C++
sources alone: it carries the bookkeeping logic and the SyncLog, not the CUDA calls.

The toolkit: ``$CUDA_HOME`` (or ``$CUDA_PATH``) when set, and then no other; else
``/usr/local/cuda``; else the toolkit of the ``nvcc`` on ``PATH``, with symbolic links
and wrapper scripts resolved (nvcc reports where it lives). A toolkit is a directory
with ``include/cuda_runtime_api.h``; its CUDA major version must be PyTorch's. The one
chosen is printed and handed to ``torch.utils.cpp_extension`` (which would otherwise
guess from the first ``nvcc`` on ``PATH``, wrapper scripts included).

The extension is optional for an install: if it cannot be compiled, ``pip install``
goes on with one warning and the pure-Python runtime does the same job
(``streamsched.runtime_info()`` says which). The failure is an error instead where the
extension was asked for: ``STREAMSCHED_REQUIRE_EXT=1``, ``USE_CUDA=1``, or a direct
``python setup.py build_ext`` (what ``make`` runs). ``SKIP_EXT=1`` installs the Python
package alone (``make`` then builds the extension in place with
``python setup.py build_ext --inplace``). ``STREAMSCHED_WERROR=1`` compiles with
``-Wall -Werror`` (C++, and nvcc's host compiler).
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

DEFAULT_CUDA_HOME = "/usr/local/cuda"


def _say(message):
    print(f"streamsched setup: {message}", file=sys.stderr, flush=True)


def _toolkit_version(home):
    """The CUDA version of a toolkit directory as (major, minor), or None if it is none."""
    header = os.path.join(home, "include", "cuda_runtime_api.h")
    try:
        with open(header, encoding="utf-8", errors="replace") as f:
            match = re.search(r"^#define\s+CUDART_VERSION\s+(\d+)", f.read(), re.MULTILINE)
    except OSError:
        return None
    if match is None:
        return None
    number = int(match.group(1))
    return number // 1000, number % 1000 // 10


def _nvcc_toolkit(nvcc):
    """The toolkit an nvcc belongs to: its resolved path's parent, else the directory the
    real nvcc reports for itself (a wrapper script that execs it resolves to nothing)."""
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if _toolkit_version(home):
        return home
    try:
        out = subprocess.run(
            [nvcc, "-dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ _HERE_="):  # the directory of the real nvcc binary
            home = os.path.dirname(os.path.realpath(line.split("=", 1)[1].strip()))
            if _toolkit_version(home):
                return home
    return None


def find_cuda_home():
    """``(path, how)``: the CUDA toolkit to build with and how it was found, or
    ``(None, why not)``. An explicit ``$CUDA_HOME``/``$CUDA_PATH`` is the only candidate."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            if _toolkit_version(value):
                return value, f"${var}"
            return None, f"{var}={value} is not a CUDA toolkit (no include/cuda_runtime_api.h there)"
    if _toolkit_version(DEFAULT_CUDA_HOME):
        return DEFAULT_CUDA_HOME, DEFAULT_CUDA_HOME
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None, "no CUDA toolkit found ($CUDA_HOME unset, no /usr/local/cuda, no nvcc on PATH)"
    home = _nvcc_toolkit(nvcc)
    if home is None:
        return None, f"the nvcc on PATH ({nvcc}) belongs to no toolkit with include/cuda_runtime_api.h"
    return home, f"nvcc on PATH ({nvcc})"


def _cuda_toolkit(torch):
    """``(path, which)`` for a toolkit PyTorch's CUDA build can use, else ``(None, why not)``."""
    if torch.version.cuda is None:
        return None, f"PyTorch {torch.__version__} was built without CUDA"
    home, how = find_cuda_home()
    if home is None:
        return None, how
    major, minor = _toolkit_version(home)
    torch_major = int(torch.version.cuda.split(".")[0])
    if major != torch_major:
        return None, (
            f"the CUDA toolkit at {home} (via {how}) is CUDA {major}.{minor}, "
            f"PyTorch {torch.__version__} was built for CUDA {torch.version.cuda}"
        )
    return home, (
        f"CUDA toolkit {os.path.realpath(home)} (CUDA {major}.{minor}, via {how}); "
        f"PyTorch {torch.__version__} built for CUDA {torch.version.cuda}"
    )


def _required():
    """Whether a failed build must fail the command (see the module docstring)."""
    return (
        os.environ.get("STREAMSCHED_REQUIRE_EXT") == "1"
        or os.environ.get("USE_CUDA", "auto").lower() == "1"
        or "build_ext" in sys.argv[1:]
    )


def _optional_build_ext(base, note=""):
    """torch's BuildExtension with ``optional`` honoured: torch's ninja build raises
    RuntimeError on a compile error, which setuptools' optional-extension handling does
    not catch, so a failed compile would fail the whole install. Says ``note`` (the
    toolkit used, or why none) when it builds."""

    class BuildExt(base):
        _failed = False

        def run(self):
            if note:
                _say(note)
            super().run()

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as exc:  # noqa: BLE001 - compilers fail in many ways
                self._give_up(None, exc)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001
                self._give_up(ext, exc)

        def _give_up(self, ext, exc):
            # Called per extension, and again for the whole build if that raised: say it once.
            name = ext.name if ext is not None else "streamsched._C"
            reason = " ".join([type(exc).__name__ + ":"] + (str(exc).strip().splitlines() or [""])[:1])
            said, BuildExt._failed = BuildExt._failed, True
            if _required() or (ext is not None and not ext.optional):
                if not said:
                    _say(f"ERROR: {name} failed to build ({reason}); see the compiler output above")
                raise exc
            if not said:
                _say(
                    f"WARNING: {name} was not built ({reason}; the compiler output is above). "
                    "streamsched will use its pure-Python runtime: same results, more host time per task. "
                    "STREAMSCHED_REQUIRE_EXT=1 makes this an error."
                )

    return BuildExt


def _extensions():
    if os.environ.get("SKIP_EXT") == "1":
        return [], {}
    try:
        import torch
    except ImportError:  # metadata-only builds (sdist) without torch installed
        return [], {}
    use_cuda = os.environ.get("USE_CUDA", "auto").lower()
    if use_cuda not in ("auto", "0", "1"):
        raise SystemExit(f"USE_CUDA must be auto, 0 or 1, not {use_cuda!r}")
    home, note = None, "building without the CUDA backend: USE_CUDA=0"
    if use_cuda != "0":
        home, note = _cuda_toolkit(torch)
        if home is None and use_cuda == "1":
            raise SystemExit(f"streamsched setup: USE_CUDA=1, but {note}. Set CUDA_HOME to a CUDA toolkit.")
        if home is None:
            note = f"building without the CUDA backend: {note}"
        else:
            # torch.utils.cpp_extension reads CUDA_HOME once, at import: set both.
            os.environ["CUDA_HOME"] = home
    import torch.utils.cpp_extension as cpp_extension

    if home is not None:
        cpp_extension.CUDA_HOME = home
    cpu_sources = sorted(glob.glob("csrc/*.cpp"))
    flags = {"cxx": ["-O3"]}
    if os.environ.get("STREAMSCHED_WERROR") == "1":
        flags["cxx"] += ["-Wall", "-Werror"]
    if home is not None:
        flags["cxx"].append("-DSTREAMSCHED_WITH_CUDA")
        flags["nvcc"] = ["-O3", "-DSTREAMSCHED_WITH_CUDA"]
        if os.environ.get("STREAMSCHED_WERROR") == "1":
            flags["nvcc"] += ["-Xcompiler=-Wall,-Werror"]
        sources = cpu_sources + sorted(glob.glob("csrc/cuda/*.cpp"))
        ext = cpp_extension.CUDAExtension("streamsched._C", sources, extra_compile_args=flags, optional=True)
    else:
        ext = cpp_extension.CppExtension("streamsched._C", cpu_sources, extra_compile_args=flags, optional=True)
    # ninja compiles the sources in parallel where it is installed (the GPU machines).
    base = cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)
    return [ext], {"build_ext": _optional_build_ext(base, note)}


if __name__ == "__main__":  # pip and `python setup.py` run it so; tests import it
    if sys.argv[1:] == ["--print-cuda-home"]:  # for .ci/gpu-check.sh: the toolkit a build would use
        print(find_cuda_home()[0] or "")
        sys.exit(0)
    ext_modules, cmdclass = _extensions()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
