"""Build of the optional native runtime ``streamsched._C``.

``USE_CUDA=auto|0|1`` (default ``auto``: CUDA when the installed PyTorch was built with
it and a CUDA toolkit is found). Without CUDA the same module is built from the C++
sources alone: it carries the bookkeeping logic and the SyncLog, not the CUDA calls.
The extension is optional: if it cannot be compiled, the install goes on and the
pure-Python runtime does the same job (``streamsched.runtime_info()`` says which).
``SKIP_EXT=1`` installs the Python package alone (``make`` then builds the extension in
place with ``python setup.py build_ext --inplace``).
"""

import glob
import os
import shutil

from setuptools import setup


def _extensions():
    if os.environ.get("SKIP_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:  # metadata-only builds (sdist) without torch installed
        return [], {}
    use_cuda = os.environ.get("USE_CUDA", "auto").lower()
    if use_cuda not in ("auto", "0", "1"):
        raise SystemExit(f"USE_CUDA must be auto, 0 or 1, not {use_cuda!r}")
    cuda_ok = torch.version.cuda is not None and CUDA_HOME is not None
    if use_cuda == "1" and not cuda_ok:
        raise SystemExit("USE_CUDA=1 but PyTorch has no CUDA support or no CUDA toolkit was found")
    with_cuda = use_cuda == "1" or (use_cuda == "auto" and cuda_ok)
    sources = sorted(glob.glob("csrc/*.cpp"))
    flags = {"cxx": ["-O3"]}
    if with_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cpp"))
        flags["cxx"].append("-DSTREAMSCHED_WITH_CUDA")
        flags["nvcc"] = ["-O3", "-DSTREAMSCHED_WITH_CUDA"]
        ext = CUDAExtension("streamsched._C", sources, extra_compile_args=flags, optional=True)
    else:
        ext = CppExtension("streamsched._C", sources, extra_compile_args=flags, optional=True)
    # ninja compiles the sources in parallel where it is installed (the GPU machines).
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
