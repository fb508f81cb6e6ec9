"""An install that lost the native runtime, or only its CUDA backend, says so plainly.

``pip install`` with ``USE_CUDA=auto`` builds a CPU-only extension where no usable CUDA
toolkit is found, without failing. On a CUDA build of PyTorch the package then warns once
at import, and ``python -m streamsched info`` says "WITHOUT its CUDA backend" (not
"runtime native (loaded)"), both with the pip command that builds the backend. Without
any extension, the advice names pip first and ``make ext`` only for a source checkout.

The import-time checks run in a subprocess whose ``streamsched._C`` is a stand-in (CPU
only) and whose ``torch.version.cuda`` says CUDA: the real extension of this checkout is
never loaded, whichever PyTorch build runs the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

from streamsched import _native
from streamsched.envinfo import environment_report, format_report

# The subprocess: a CPU-only stand-in for streamsched._C, PyTorch made to look like a
# CUDA build, then the import; prints the warnings, runtime_info() and the info report.
_SCRIPT = r"""
import importlib.machinery, json, sys, types, warnings
import torch

cuda_compiled = sys.argv[1] == "cuda"
fake = types.ModuleType("streamsched._C")
fake.__spec__ = importlib.machinery.ModuleSpec("streamsched._C", loader=None)
fake.cuda_compiled = lambda: cuda_compiled
sys.modules["streamsched._C"] = fake
if torch.version.cuda is None:
    torch.version.cuda = "13.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import streamsched
    from streamsched.envinfo import environment_report, format_report
print(json.dumps({
    "warnings": [str(w.message) for w in caught if "streamsched" in str(w.message)],
    "where": [w.filename for w in caught if "streamsched" in str(w.message)],
    "info": streamsched.runtime_info(),
    "report": format_report(environment_report()),
}))
"""


def _import_with(cuda_compiled: bool) -> dict:
    env = {**os.environ, "STREAMSCHED_DISABLE_EXT": "0", "STREAMSCHED_REQUIRE_EXT": "0"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "cuda" if cuda_compiled else "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cpu_only_extension_on_cuda_pytorch_warns_once_and_info_says_so():
    seen = _import_with(cuda_compiled=False)
    cuda_warnings = [w for w in seen["warnings"] if "CUDA backend" in w]
    assert len(cuda_warnings) == 1, seen["warnings"]
    assert seen["where"] == ["<string>"]  # the user's `import streamsched` (the -c script), not _native.py
    assert "USE_CUDA=1 pip install" in cuda_warnings[0] and "make ext" not in cuda_warnings[0]
    info = seen["info"]
    assert info["native"] and not info["native_cuda"] and info["native_cuda_missing"]
    assert "USE_CUDA=1 pip install" in info["build_hint"]
    first = seen["report"].splitlines()[0]
    assert "WITHOUT its CUDA backend" in first and "(loaded)" not in first
    assert "USE_CUDA=1 pip install" in seen["report"]


def test_extension_with_its_cuda_backend_says_nothing():
    seen = _import_with(cuda_compiled=True)
    assert not [w for w in seen["warnings"] if "CUDA backend" in w], seen["warnings"]
    info = seen["info"]
    assert info["native_cuda"] and not info["native_cuda_missing"] and info["build_hint"] is None
    assert "runtime native (loaded)" in seen["report"].splitlines()[0]


def test_no_extension_advice_names_pip_before_make(monkeypatch):
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_reason", "streamsched._C is not built (no compiled extension next to the package)")
    info = _native.runtime_info()
    hint = info["build_hint"]
    assert hint.index("pip install") < hint.index("make ext") and "source checkout" in hint
    text = format_report(environment_report())
    assert "runtime python" in text and "pip install" in text
    # Disabled on purpose: nothing to fix.
    monkeypatch.setattr(_native, "_reason", "disabled by STREAMSCHED_DISABLE_EXT=1")
    assert _native.runtime_info()["build_hint"] is None


def test_cuda_backend_missing_follows_what_native_reports(monkeypatch):
    cpu_only = types.SimpleNamespace(cuda_compiled=lambda: False)
    monkeypatch.setattr(_native, "_module", cpu_only)
    monkeypatch.setattr(_native.torch.version, "cuda", "13.0")
    assert _native.cuda_backend_missing()
    monkeypatch.setattr(_native.torch.version, "cuda", None)  # a CPU build of PyTorch: nothing missing
    assert not _native.cuda_backend_missing()


def test_build_hints_name_pip_and_the_checkout_command():
    assert "pip install" in _native.build_hint() and "make ext" in _native.build_hint()
    assert "USE_CUDA=1" in _native.build_hint(cuda=True)
