"""setup.py: which CUDA toolkit it picks, and what a failed extension build does.

The end-to-end checks (the CUDA build itself, a pip build against a broken toolkit) need
the CUDA build of PyTorch and run in `make cuda-build` (.ci/check_cuda_ext.py); these are
the fast, torch-free parts.
"""

import importlib.util
import os
import stat
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def setup_py(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("streamsched_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines only: setup() runs under __main__
    for var in ("CUDA_HOME", "CUDA_PATH", "STREAMSCHED_REQUIRE_EXT", "USE_CUDA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(module, "DEFAULT_CUDA_HOME", str(tmp_path / "no-default-toolkit"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(sys, "argv", ["setup.py", "bdist_wheel"])
    return module


def toolkit(path: Path, version: int = 13000) -> Path:
    (path / "include").mkdir(parents=True)
    (path / "bin").mkdir()
    (path / "include" / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION  {version}\n")
    return path


def script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_explicit_cuda_home_is_the_only_candidate(setup_py, tmp_path, monkeypatch):
    other = toolkit(tmp_path / "default")
    monkeypatch.setattr(setup_py, "DEFAULT_CUDA_HOME", str(other))
    mine = toolkit(tmp_path / "mine")
    monkeypatch.setenv("CUDA_HOME", str(mine))
    assert setup_py.find_cuda_home() == (str(mine), "$CUDA_HOME")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nonexistent"))
    home, why = setup_py.find_cuda_home()
    assert home is None and "is not a CUDA toolkit" in why  # not the default one instead


def test_default_location_before_path(setup_py, tmp_path, monkeypatch):
    default = toolkit(tmp_path / "default")
    monkeypatch.setattr(setup_py, "DEFAULT_CUDA_HOME", str(default))
    assert setup_py.find_cuda_home() == (str(default), str(default))


def test_nvcc_symlink_is_resolved(setup_py, tmp_path, monkeypatch):
    real = toolkit(tmp_path / "cuda-13.0")
    nvcc = script(real / "bin" / "nvcc", "exit 0")
    (tmp_path / "bin").mkdir()
    os.symlink(nvcc, tmp_path / "bin" / "nvcc")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    home, how = setup_py.find_cuda_home()
    assert home == str(real) and "nvcc on PATH" in how


def test_nvcc_wrapper_script_is_resolved(setup_py, tmp_path, monkeypatch):
    # /usr/local/bin/nvcc on the development machines: a script that execs the real one,
    # so its own parent (/usr/local) is no toolkit. The real nvcc says where it lives.
    real = toolkit(tmp_path / "cuda-13.0")
    script(real / "bin" / "nvcc", f'echo "#$ _HERE_={real / "bin"}" >&2')
    script(tmp_path / "wrapper" / "bin" / "nvcc", f'exec {real / "bin" / "nvcc"} "$@"')
    monkeypatch.setenv("PATH", str(tmp_path / "wrapper" / "bin"))
    assert setup_py.find_cuda_home()[0] == str(real)


def test_nothing_found(setup_py):
    home, why = setup_py.find_cuda_home()
    assert home is None and "no CUDA toolkit found" in why


def fake_torch(cuda):
    return types.SimpleNamespace(__version__="2.x", version=types.SimpleNamespace(cuda=cuda))


def test_toolkit_must_match_torch_major_version(setup_py, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(toolkit(tmp_path / "cuda-12.4", version=12040)))
    home, why = setup_py._cuda_toolkit(fake_torch("13.0"))
    assert home is None and "CUDA 12.4" in why and "CUDA 13.0" in why
    assert setup_py._cuda_toolkit(fake_torch("12.8"))[0] == str(tmp_path / "cuda-12.4")
    home, why = setup_py._cuda_toolkit(fake_torch(None))
    assert home is None and "without CUDA" in why


class FailingBuild:
    """Stands in for torch's BuildExtension: the ninja build raises RuntimeError."""

    def run(self):
        self.build_extensions()

    def build_extensions(self):
        for ext in self.extensions:
            self.build_extension(ext)

    def build_extension(self, ext):
        raise RuntimeError("Error compiling objects for extension")


def run_failing_build(setup_py):
    build = setup_py._optional_build_ext(FailingBuild, "CUDA toolkit /x (CUDA 13.0)")()
    build.extensions = [types.SimpleNamespace(name="streamsched._C", optional=True)]
    build.run()


def test_failed_build_of_an_install_warns_once(setup_py, capsys):
    run_failing_build(setup_py)
    err = capsys.readouterr().err
    assert err.count("WARNING: streamsched._C was not built") == 1
    assert err.count("CUDA toolkit /x") == 1  # the toolkit used, said when building
    assert "pure-Python runtime" in err and "Error compiling objects" in err


@pytest.mark.parametrize(
    "env, argv",
    [
        ({"STREAMSCHED_REQUIRE_EXT": "1"}, ["setup.py", "bdist_wheel"]),
        ({"USE_CUDA": "1"}, ["setup.py", "editable_wheel"]),
        ({}, ["setup.py", "build_ext", "--inplace"]),  # what make runs: the extension was asked for
    ],
)
def test_failed_build_is_an_error_where_the_extension_was_asked_for(setup_py, monkeypatch, capsys, env, argv):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError, match="Error compiling"):
        run_failing_build(setup_py)
    assert capsys.readouterr().err.count("ERROR: streamsched._C failed to build") == 1
