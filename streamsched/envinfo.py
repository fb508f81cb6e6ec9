"""What this machine is: Python, PyTorch, CPU, the native runtime, and the GPUs (via NVML).

Benchmark numbers and schedule profiles mean little without the machine they came from;
:func:`environment_report` collects it as a plain dict (JSON-ready) and never raises: on a
machine without NVML or without a GPU the report says why there is no GPU section.

NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``) is initialised at most once
per process. GPUs are listed in PyTorch's numbering: when ``CUDA_VISIBLE_DEVICES`` lists
indices (or UUIDs), GPU ``i`` of the report is the ``i``-th entry there, and its NVML index
is recorded next to it.

Example::

    >>> from streamsched.envinfo import environment_report, format_report
    >>> report = environment_report()
    >>> sorted(report)   # doctest: +NORMALIZE_WHITESPACE
    ['cpu', 'environment', 'gpus', 'nvml', 'platform', 'python', 'streamsched', 'torch']
    >>> print(format_report(report))   # doctest: +SKIP
"""

from __future__ import annotations

import os
import platform
import sys
import threading
from typing import Any, Callable, Optional, Union

import torch

from ._native import runtime_info
from ._version import __version__

__all__ = ["environment_report", "format_report", "visible_nvml_devices", "cpu_name", "device_name"]

_ENVIRONMENT_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_LAUNCH_BLOCKING",
    "NVTX_DISABLE",
    "OMP_NUM_THREADS",
    "STREAMSCHED_REQUIRE_EXT",
    "STREAMSCHED_DISABLE_EXT",
)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: Union[str, torch.device]) -> str:
    """A human name for a device: the GPU's name (``"NVIDIA H100 80GB HBM3"``), or the
    CPU's (:func:`cpu_name`); any other device as PyTorch writes it."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        return cpu_name()
    return str(dev)


def visible_nvml_devices(cuda_visible_devices: Optional[str], count: int) -> list[Union[int, str]]:
    """The NVML devices CUDA exposes, in CUDA's order: NVML indices, or UUID strings.

    ``None`` (variable unset) means every device. As CUDA does, the list stops at the first
    entry that names no device (``"0,7,1"`` on a 2-GPU machine is just GPU 0).

    >>> visible_nvml_devices("2,0", 4), visible_nvml_devices(None, 2), visible_nvml_devices("", 2)
    ([2, 0], [0, 1], [])
    >>> visible_nvml_devices("GPU-8a3c", 2)
    ['GPU-8a3c']
    """
    if cuda_visible_devices is None:
        return list(range(count))
    out: list[Union[int, str]] = []
    for item in (part.strip() for part in cuda_visible_devices.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit():
            index = int(item)
            if index < 0 or index >= count or index in out:
                break
            out.append(index)
        else:
            out.append(item)  # a UUID ("GPU-...", "MIG-..."): looked up by UUID
    return out


class _Nvml:
    """The NVML library, initialised on first use, once per process; ``reason`` says why
    it is unavailable."""

    def __init__(self, importer: Optional[Callable[[], Any]] = None):
        self._importer = importer
        self._lock = threading.Lock()
        self._started = False
        self.lib: Any = None
        self.reason: Optional[str] = None

    def start(self) -> bool:
        with self._lock:
            if not self._started:
                self._started = True
                self._init()
            return self.lib is not None

    def _init(self) -> None:
        try:
            if self._importer is not None:
                lib = self._importer()
            else:
                import pynvml as lib  # lazy: only when a report asks for GPUs; without it the report says why
        except ImportError:
            self.reason = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            lib.nvmlInit()
        except lib.NVMLError_LibraryNotFound:
            self.reason = "the NVML library (libnvidia-ml.so) was not found: no NVIDIA driver is installed"
        except lib.NVMLError_DriverNotLoaded:
            self.reason = "the NVIDIA driver is not loaded"
        except lib.NVMLError as exc:
            self.reason = f"NVML failed to initialise: {exc}"
        except Exception as exc:  # noqa: BLE001 - a broken install must not break a report
            self.reason = f"NVML failed to initialise: {type(exc).__name__}: {exc}"
        else:
            self.lib = lib

    def query(self, errors: list[str], getter: str, *args: Any) -> Any:
        """``pynvml.<getter>(*args)``; ``None`` when the device does not support it (or on any
        other NVML error, which is added to ``errors``)."""
        lib = self.lib
        try:
            value = getattr(lib, getter)(*args)
        except lib.NVMLError_NotSupported:
            return None
        except lib.NVMLError as exc:
            errors.append(f"{getter}: {exc}")
            return None
        except Exception as exc:  # noqa: BLE001 - e.g. a getter this pynvml version lacks
            errors.append(f"{getter}: {type(exc).__name__}: {exc}")
            return None
        return value.decode() if isinstance(value, bytes) else value


_NVML = _Nvml()


def _torch_gpu(index: int) -> dict[str, Any]:
    """What PyTorch knows of CUDA device ``index`` (SM count, compute capability, memory)."""
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return {}
    try:
        props = torch.cuda.get_device_properties(index)
    except Exception:  # noqa: BLE001 - a report must not raise
        return {}
    return {
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_total_mib": props.total_memory // (1 << 20),
    }


def _nvml_gpu(nvml: _Nvml, device: Union[int, str]) -> dict[str, Any]:
    lib = nvml.lib
    errors: list[str] = []
    if isinstance(device, int):
        handle = nvml.query(errors, "nvmlDeviceGetHandleByIndex", device)
    else:
        handle = nvml.query(errors, "nvmlDeviceGetHandleByUUID", device)
    if handle is None:
        return {"nvml_index": device, "errors": errors or [f"no NVML device {device!r}"]}
    q = nvml.query
    memory = q(errors, "nvmlDeviceGetMemoryInfo", handle)
    util = q(errors, "nvmlDeviceGetUtilizationRates", handle)
    power = q(errors, "nvmlDeviceGetPowerUsage", handle)
    return {
        "nvml_index": device,
        "name": q(errors, "nvmlDeviceGetName", handle),
        "uuid": q(errors, "nvmlDeviceGetUUID", handle),
        "clocks_mhz": {
            "sm": q(errors, "nvmlDeviceGetClockInfo", handle, lib.NVML_CLOCK_SM),
            "sm_max": q(errors, "nvmlDeviceGetMaxClockInfo", handle, lib.NVML_CLOCK_SM),
            "memory": q(errors, "nvmlDeviceGetClockInfo", handle, lib.NVML_CLOCK_MEM),
            "memory_max": q(errors, "nvmlDeviceGetMaxClockInfo", handle, lib.NVML_CLOCK_MEM),
        },
        "memory_mib": None
        if memory is None
        else {"total": memory.total // (1 << 20), "used": memory.used // (1 << 20)},
        "utilization_pct": None if util is None else {"gpu": util.gpu, "memory": util.memory},
        "power_w": None if power is None else power / 1000.0,
        "errors": errors,
    }


def _gpus(nvml: _Nvml) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    status: dict[str, Any] = {"available": False, "reason": None, "driver": None, "device_count": 0}
    gpus: list[dict[str, Any]] = []
    torch_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nvml.start():
        errors: list[str] = []
        status["available"] = True
        status["driver"] = nvml.query(errors, "nvmlSystemGetDriverVersion")
        count = nvml.query(errors, "nvmlDeviceGetCount") or 0
        status["device_count"] = count
        visible = visible_nvml_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), count)
        if not visible:
            status["reason"] = "no NVIDIA GPU" if count == 0 else "CUDA_VISIBLE_DEVICES hides every GPU"
        for index, device in enumerate(visible):
            gpu = {"index": index, **_nvml_gpu(nvml, device)}
            # PyTorch has the numbers NVML does not: SMs, compute capability.
            for key, value in _torch_gpu(index).items():
                if gpu.get(key) is None:
                    gpu[key] = value
            gpu.setdefault("sm_count", None)
            gpus.append(gpu)
        if errors:
            status["errors"] = errors
    else:
        status["reason"] = nvml.reason
        gpus = [{"index": i, **_torch_gpu(i)} for i in range(torch_count)]
    return status, gpus


def _streamsched() -> dict[str, Any]:
    try:
        runtime = runtime_info()
    except Exception as exc:  # noqa: BLE001 - a report must not raise
        runtime = {"error": f"{type(exc).__name__}: {exc}"}
    return {"version": __version__, "runtime": runtime}


def environment_report() -> dict[str, Any]:
    """Python, platform, PyTorch (CUDA, cuDNN), CPU and thread counts, streamsched and its
    native runtime, and every visible GPU (name, driver, SMs, clocks, memory, utilisation).

    JSON-serialisable; never raises. ``report["nvml"]["reason"]`` says why there is no GPU
    data (NVML library missing, driver not loaded, no GPU).
    """
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001
        cudnn = None
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    nvml_status, gpus = _gpus(_NVML)
    return {
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "processor": platform.processor() or None,
        },
        "cpu": {
            "name": cpu_name(),
            "count": os.cpu_count(),
            "available": affinity,
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
        },
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": cudnn,
            "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        },
        "streamsched": _streamsched(),
        "nvml": nvml_status,
        "gpus": gpus,
        "environment": {key: os.environ[key] for key in _ENVIRONMENT_KEYS if key in os.environ},
    }


def _or(value: Any, unknown: str = "?") -> str:
    return unknown if value is None else str(value)


def _runtime_line(runtime: dict[str, Any]) -> str:
    """Which runtime runs, said plainly: a native runtime without the CUDA backend that a
    CUDA build of PyTorch could use is not just "native"."""
    if runtime.get("native_cuda_missing"):
        return (
            f"runtime native WITHOUT its CUDA backend (PyTorch {_or(runtime.get('torch'))} is a CUDA "
            f"{_or(runtime.get('torch_cuda'))} build; the extension was compiled for CPU only)"
        )
    return f"runtime {_or(runtime.get('runtime'))} ({_or(runtime.get('reason'))})"


def format_report(report: dict[str, Any]) -> str:
    """The report as a few lines of text (missing entries print as ``?``)."""
    py, plat, cpu = report.get("python", {}), report.get("platform", {}), report.get("cpu", {})
    tor, ss, nvml = report.get("torch", {}), report.get("streamsched", {}), report.get("nvml", {})
    runtime = ss.get("runtime", {})
    lines = [f"streamsched {_or(ss.get('version'))}: {_runtime_line(runtime)}"]
    if runtime.get("build_hint"):
        lines.append(f"    to fix: {runtime['build_hint']}")
    lines += [
        f"python {_or(py.get('version'))} ({_or(py.get('implementation'))}) on {_or(plat.get('system'))} "
        f"{_or(plat.get('release'))} {_or(plat.get('machine'))}",
        f"torch {_or(tor.get('version'))}: CUDA {_or(tor.get('cuda'), 'none')}, cuDNN {_or(tor.get('cudnn'), 'none')}, "
        f"CUDA available: {'yes' if tor.get('cuda_available') else 'no'}",
        f"CPU: {_or(cpu.get('name'))}, {_or(cpu.get('count'))} cores "
        f"({_or(cpu.get('available'))} available to this process), "
        f"torch threads {_or(cpu.get('torch_threads'))} (inter-op {_or(cpu.get('torch_interop_threads'))})",
    ]
    gpus = report.get("gpus", [])
    if nvml.get("available"):
        lines.append(f"NVML: driver {_or(nvml.get('driver'))}, {_or(nvml.get('device_count'))} GPU(s)")
    else:
        lines.append(f"NVML: unavailable ({_or(nvml.get('reason'), 'unknown reason')})")
    if not gpus:
        lines.append("GPUs: none" + (f" ({nvml['reason']})" if nvml.get("available") and nvml.get("reason") else ""))
    for gpu in gpus:
        cc = f", sm_{gpu['compute_capability'].replace('.', '')}" if gpu.get("compute_capability") else ""
        lines.append(
            f"GPU {gpu.get('index')} (NVML {_or(gpu.get('nvml_index'))}): {_or(gpu.get('name'))}, "
            f"{_or(gpu.get('sm_count'))} SMs{cc}"
        )
        clocks = gpu.get("clocks_mhz") or {}
        memory = gpu.get("memory_mib") or {}
        util = gpu.get("utilization_pct") or {}
        if clocks or memory or util:
            lines.append(
                f"    clocks SM {_or(clocks.get('sm'))}/{_or(clocks.get('sm_max'))} MHz, memory "
                f"{_or(clocks.get('memory'))}/{_or(clocks.get('memory_max'))} MHz; memory "
                f"{_or(memory.get('used'))}/{_or(memory.get('total', gpu.get('memory_total_mib')))} MiB used; "
                f"utilisation GPU {_or(util.get('gpu'))}%, memory {_or(util.get('memory'))}%"
            )
        for error in gpu.get("errors") or []:
            lines.append(f"    NVML error: {error}")
    env = report.get("environment") or {}
    if env:
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    return "\n".join(lines)
