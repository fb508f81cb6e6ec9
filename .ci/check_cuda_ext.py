"""Checks of the extension build, for `make cuda-build` and `make gpu-check`.

  check_cuda_ext.py built DIR      the streamsched._C under DIR (DIR/streamsched/_C*.so):
                                   every undefined symbol resolves once torch is loaded,
                                   it imports, cuda_compiled() is True, and its CPU
                                   bookkeeping runs
  check_cuda_ext.py fallback WORK  a failed compile leaves a working pure-Python install:
                                   pip builds a copy of the project against a broken CUDA
                                   toolkit under WORK; one warning and no _C without
                                   STREAMSCHED_REQUIRE_EXT, a clear failure with it or
                                   with USE_CUDA=1

Run with the Python of the environment the extension was built for. No GPU needed.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARNING = "WARNING: streamsched._C was not built"


START = time.monotonic()


def say(message: str) -> None:
    print(f"check_cuda_ext [{time.monotonic() - START:5.1f}s]: {message}", flush=True)


def fail(message: str) -> None:
    say(f"FAIL: {message}", flush=True)
    sys.exit(1)


def check_built(directory: str) -> None:
    found = glob.glob(os.path.join(directory, "streamsched", "_C*.so"))
    if len(found) != 1:
        fail(f"expected one streamsched/_C*.so under {directory}, found {found}")
    path = os.path.abspath(found[0])
    # A fresh process: the first dlopen of the library, after torch's, with every symbol
    # bound at once (RTLD_NOW). An undefined symbol, or a needed library that is not
    # loaded and cannot be found, makes dlopen fail here rather than at first call.
    probe = (
        "import ctypes, os, sys, torch\n"
        "ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_LOCAL)\n"
        "maps = [line.split()[-1] for line in open('/proc/self/maps') if '/' in line]\n"
        "stem = lambda path: os.path.basename(path).split('.so')[0]\n"
        "for name in sys.argv[2:]:\n"
        "    print(name, '->', next((m for m in maps if stem(m) == stem(name)), 'not loaded'))\n"
    )
    needed = []
    if shutil.which("readelf"):
        dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
        needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    proc = subprocess.run([sys.executable, "-c", probe, path, *needed], capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"dlopen(RTLD_NOW) of {path} after `import torch` failed:\n{proc.stderr.strip()}")
    say(f"every symbol of {path} resolves after `import torch`; its libraries:")
    print("  " + "\n  ".join(proc.stdout.strip().splitlines()))

    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("_C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if os.path.abspath(module.__file__) != path:
        fail(f"loaded {module.__file__}, not {path}")
    if module.cuda_compiled() is not True:
        fail(f"{path}: cuda_compiled() is {module.cuda_compiled()!r}, the CUDA backend is missing")
    # The bookkeeping without a device: fork, two tasks on two streams, a wait, a join.
    task = module.TaskSync
    tasks = [task(0, 0, [], True, [0], [1], [], []), task(1, 1, [0], False, [1], [2], [1], [1])]
    rt = module.StreamRuntime(tasks, 2, [], [2], False, 0)
    env = [None, None, None]
    rt.begin(True)
    for i in range(2):
        rt.enter(i)
        rt.leave(i, env)
    rt.end(env, True)
    kinds = [entry[0] for entry in rt.take_log()]
    expected = ["fork", "launch", "record", "wait", "launch", "record_stream", "free", "join", "output"]
    if kinds != expected:
        fail(f"SyncLog of the CPU bookkeeping is {kinds}, expected {expected}")
    if not torch.cuda.is_available():
        # The CUDA backend is linked in and reachable: without a GPU it must refuse cleanly.
        try:
            module.StreamRuntime(tasks, 2, [], [2], True, 0)
        except RuntimeError as exc:
            say(f"without a GPU the CUDA backend refuses cleanly: {str(exc).splitlines()[0]}")
        else:
            fail("a CUDA StreamRuntime was created although torch sees no GPU")
    say(f"OK: {path} (torch {torch.__version__}, CUDA {torch.version.cuda}), cuda_compiled() True")


def _copy_project(dest: str) -> None:
    """The files a build reads, without build outputs (an in-tree _C*.so above all)."""
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", ".ext-built")
    os.makedirs(dest)
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(ROOT, name), dest)
    for name in ("csrc", "streamsched"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name), ignore=ignore)


def _pip_wheel(src: str, out: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "-v", "--no-deps"]
    cmd += ["--no-build-isolation", "-w", out, src]
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def check_fallback(work: str) -> None:
    import torch

    if torch.version.cuda is None:
        fail("run this with a CUDA build of PyTorch (the broken toolkit must be picked up)")
    work = os.path.abspath(work)
    shutil.rmtree(work, ignore_errors=True)
    src = os.path.join(work, "src")
    _copy_project(src)
    # A toolkit that looks right (the header, the version PyTorch wants) and does not compile.
    toolkit = os.path.join(work, "broken-toolkit")
    os.makedirs(os.path.join(toolkit, "include"))
    major, minor = torch.version.cuda.split(".")[:2]
    with open(os.path.join(toolkit, "include", "cuda_runtime_api.h"), "w") as f:
        f.write(f"#define CUDART_VERSION {int(major) * 1000 + int(minor) * 10}\n#error broken CUDA toolkit\n")
    env = {k: v for k, v in os.environ.items() if k not in ("STREAMSCHED_REQUIRE_EXT", "SKIP_EXT", "CUDA_PATH")}
    env.update(CUDA_HOME=toolkit, USE_CUDA="auto", MAX_JOBS="1", PIP_NO_INDEX="1")
    log = os.path.join(work, "pip.log")

    # 1. Optional: the install goes on, one warning, no extension in the wheel.
    wheels = os.path.join(work, "wheels")
    proc = _pip_wheel(src, wheels, env)
    with open(log, "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        fail(f"pip wheel with a broken toolkit failed (rc {proc.returncode}); log: {log}")
    count = (proc.stdout + proc.stderr).count(WARNING)
    if count != 1:
        fail(f"expected the build warning once, saw it {count} times; log: {log}")
    (wheel,) = glob.glob(os.path.join(wheels, "streamsched-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        native = [n for n in z.namelist() if n.endswith(".so")]
    if native:
        fail(f"the wheel holds {native} although the compile failed")
    site = os.path.join(work, "site")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--target", site, wheel], check=True, env=env)
    probe = (
        "import sys, warnings; warnings.simplefilter('ignore')\n"
        "# Only the installed copy: not the editable install of the checkout this runs from.\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
        "import streamsched, torch\n"
        "info = streamsched.runtime_info()\n"
        "assert streamsched.__file__.startswith(sys.argv[1]), streamsched.__file__\n"
        "assert streamsched._native.native() is None, streamsched._native.native()\n"
        "assert info['runtime'] == 'python', info\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "x = torch.randn(2, 4)\n"
        "assert torch.equal(streamsched.StreamScheduledModule(m)(x), m(x))\n"
        "print(info['runtime'], info['reason'])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe, site], env=dict(env, PYTHONPATH=site), cwd=work, capture_output=True, text=True
    )
    if run.returncode != 0:
        fail(f"the install without _C does not work:\n{run.stdout}{run.stderr}")
    say(f"broken toolkit, USE_CUDA=auto: installed with one warning; runtime {run.stdout.strip()}")

    # 2. Required: the same build fails, and says why.
    required = (
        ({"STREAMSCHED_REQUIRE_EXT": "1"}, "ERROR: streamsched._C failed to build"),
        ({"USE_CUDA": "1", "CUDA_HOME": "/nonexistent"}, "USE_CUDA=1, but CUDA_HOME=/nonexistent is not a CUDA"),
    )
    for extra, expect in required:
        proc = _pip_wheel(src, os.path.join(work, "wheels-required"), dict(env, **extra))
        out = proc.stdout + proc.stderr
        with open(log, "a") as f:
            f.write(out)
        if proc.returncode == 0 or expect not in out:
            fail(f"with {extra}: expected a failed build saying {expect!r} (rc {proc.returncode}); log: {log}")
        say(f"with {extra}: the build fails: {expect!r}")
    say("OK: fallback")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("built", "fallback"):
        raise SystemExit(__doc__)
    if argv[0] == "built":
        check_built(argv[1])
    else:
        check_fallback(argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
