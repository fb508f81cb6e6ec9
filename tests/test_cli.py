"""``python -m streamsched``: info, plan, timeline, profile, delegation; and the environment report."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched import cli, envinfo
from streamsched.cli import main, parse_options, parse_shape
from streamsched.envinfo import environment_report, format_report, visible_nvml_devices
from streamsched.observe.schedule_profiles import load_profile
from streamsched.planning.plan import Plan

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
INCEPTION = ["benchmarks.zoo:Inception3", "--input-shape", "1,3,75,75"]
TOWERS = ["tests.helpers:Towers", "--input-shape", "4,64"]


needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the plot extra) is not installed"
)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- info and the environment report ---------------------------------------------------------


def test_info_prints_the_report(capsys):
    code, out, err = run(capsys, "info")
    assert code == 0, err
    assert f"torch {torch.__version__}" in out and f"streamsched {ss.__version__}" in out
    assert "NVML" in out


def test_info_json_is_the_report(capsys):
    code, out, _ = run(capsys, "info", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["torch"]["version"] == torch.__version__
    assert report["streamsched"]["runtime"] == ss.runtime_info()
    assert report["cpu"]["count"] == os.cpu_count()
    if not report["nvml"]["available"]:
        assert report["nvml"]["reason"]  # says why


def test_python_dash_m_streamsched_info_runs():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "streamsched", "info"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"torch {torch.__version__}" in done.stdout


def test_visible_devices_follow_cuda_visible_devices():
    assert visible_nvml_devices(None, 3) == [0, 1, 2]
    assert visible_nvml_devices("2,0", 3) == [2, 0]
    assert visible_nvml_devices("1,5,0", 3) == [1]  # CUDA stops at the first invalid entry
    assert visible_nvml_devices("", 3) == []
    assert visible_nvml_devices("-1", 3) == []
    assert visible_nvml_devices("GPU-abc, 1", 3) == ["GPU-abc", 1]


def fake_pynvml(init_error: str = "", count: int = 3) -> types.ModuleType:
    """A stand-in for pynvml: ``count`` GPUs; SM clocks unsupported, utilisation failing."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    for name in ("LibraryNotFound", "DriverNotLoaded", "NotSupported", "Unknown"):
        setattr(nvml, f"NVMLError_{name}", type(f"NVMLError_{name}", (NVMLError,), {}))
    nvml.NVMLError = NVMLError
    nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM = 1, 2
    nvml.inits = 0

    def init():
        nvml.inits += 1
        if init_error:
            raise getattr(nvml, f"NVMLError_{init_error}")("cannot")

    def clock(handle, kind):
        if kind == nvml.NVML_CLOCK_SM:
            raise nvml.NVMLError_NotSupported("not on this GPU")
        return 1593

    def utilization(handle):
        raise nvml.NVMLError_Unknown("GPU is lost")

    nvml.nvmlInit = init
    nvml.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    nvml.nvmlDeviceGetCount = lambda: count
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nvml.nvmlDeviceGetName = lambda h: f"Fake GPU {h[1]}".encode()
    nvml.nvmlDeviceGetUUID = lambda h: f"GPU-{h[1]:04d}"
    nvml.nvmlDeviceGetClockInfo = clock
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980 if kind == nvml.NVML_CLOCK_SM else 2619
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 << 30, used=(h[1] + 1) << 30)
    nvml.nvmlDeviceGetUtilizationRates = utilization
    nvml.nvmlDeviceGetPowerUsage = lambda h: 123456
    return nvml


def test_report_lists_visible_gpus_in_cuda_order_with_unsupported_values_as_none(monkeypatch):
    fake = fake_pynvml()
    monkeypatch.setattr(envinfo, "_NVML", envinfo._Nvml(importer=lambda: fake))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    report = environment_report()
    environment_report()
    assert fake.inits == 1  # initialised once per process
    assert report["nvml"]["available"] and report["nvml"]["driver"] == "550.54.15"
    gpus = report["gpus"]
    assert [(g["index"], g["nvml_index"], g["name"]) for g in gpus] == [(0, 2, "Fake GPU 2"), (1, 0, "Fake GPU 0")]
    first = gpus[0]
    assert first["clocks_mhz"] == {"sm": None, "sm_max": 1980, "memory": 1593, "memory_max": 2619}
    assert first["memory_mib"] == {"total": 80 * 1024, "used": 3 * 1024}
    assert first["utilization_pct"] is None
    assert any("GPU is lost" in e for e in first["errors"])
    assert first["power_w"] == pytest.approx(123.456)
    assert report["environment"]["CUDA_VISIBLE_DEVICES"] == "2,0"
    text = format_report(report)
    assert "GPU 0 (NVML 2): Fake GPU 2" in text and "driver 550.54.15" in text and "GPU is lost" in text
    json.dumps(report)


@pytest.mark.parametrize(
    "error, reason",
    [
        ("LibraryNotFound", "not found"),
        ("DriverNotLoaded", "driver is not loaded"),
        ("Unknown", "failed to initialise"),
    ],
)
def test_report_says_why_nvml_is_unavailable(monkeypatch, error, reason):
    fake = fake_pynvml(init_error=error)
    monkeypatch.setattr(envinfo, "_NVML", envinfo._Nvml(importer=lambda: fake))
    report = environment_report()
    assert report["nvml"]["available"] is False
    assert reason in report["nvml"]["reason"]
    assert reason in format_report(report)


def test_report_without_pynvml_or_without_gpus(monkeypatch):
    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(envinfo, "_NVML", envinfo._Nvml(importer=missing))
    assert "nvidia-ml-py" in environment_report()["nvml"]["reason"]
    monkeypatch.setattr(envinfo, "_NVML", envinfo._Nvml(importer=lambda: fake_pynvml(count=0)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    report = environment_report()
    assert report["nvml"]["available"] and report["gpus"] == [] and report["nvml"]["reason"] == "no NVIDIA GPU"


# --- plan ----------------------------------------------------------------------------------------


def test_plan_of_inception(capsys):
    code, out, err = run(capsys, "plan", *INCEPTION, "executor=threads", "num_streams=4")
    assert code == 0, err
    assert "Plan for Inception3 (float32[1, 3, 75, 75] on cpu): executor threads" in out
    assert "Mixed_5b" in out


def test_plan_json_of_a_small_model_honours_the_options(capsys):
    code, out, err = run(capsys, "plan", *TOWERS, "--json", "num_streams=2", "executor=threads", "min_task_cost=0")
    assert code == 0, err
    plan = Plan.from_json(out)
    assert plan.model == "Towers" and plan.signature == "float32[4, 64]"
    assert plan.executor == "threads" and plan.stream_bound == 2


def test_plan_under_auto_prints_the_trials_decision(capsys):
    """The calls after planning are the executor trial: the plan printed is the decided one,
    with what the trial measured, not the plan still under trial."""
    code, out, err = run(capsys, "plan", *TOWERS, "--json")
    assert code == 0, err
    plan = Plan.from_json(out)
    assert plan.trial is not None and plan.trial.chosen in plan.trial.best_us
    assert plan.trial.calls and min(plan.trial.calls.values()) >= 1
    code, out, err = run(capsys, "plan", *TOWERS)
    assert code == 0, err
    assert "measured (fastest of the first calls)" in out


class RecordsMode(nn.Module):
    """Remembers the train flag and grad mode of every call it gets."""

    seen: list[tuple[bool, bool]] = []

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    @ss.branch
    def note(self, h):
        RecordsMode.seen.append((self.training, torch.is_grad_enabled()))
        return h

    def forward(self, x):
        return self.note(torch.cat([h(x) for h in self.heads], dim=1))


@pytest.mark.parametrize(
    "flag, mode", [([], (False, False)), (["--eval"], (False, False)), (["--train"], (True, True))]
)
def test_plan_runs_eval_under_no_grad_or_train_with_grad(capsys, flag, mode):
    RecordsMode.seen.clear()
    code, _, err = run(capsys, "plan", "tests.test_cli:RecordsMode", "--input-shape", "2,8", *flag)
    assert code == 0, err
    assert RecordsMode.seen and set(RecordsMode.seen) == {mode}


def test_plan_options_may_come_before_the_flags(capsys):
    code, out, err = run(capsys, "plan", "tests.test_cli:RecordsMode", "fuse=false", "--input-shape", "2,8", "--json")
    assert code == 0, err
    assert Plan.from_json(out).fused_groups == []
    code, out, err = run(capsys, "plan", "tests.test_cli:RecordsMode", "--input-shape", "2,8", "--json")
    assert Plan.from_json(out).fused_groups  # the three heads fuse by default


def test_parse_shape_and_options():
    assert parse_shape("1,3,299,299") == (1, 3, 299, 299)
    assert parse_shape("8x64") == (8, 64)
    opts = parse_options(["num_streams=4", "fuse=False", "min_task_cost=2.5", "executor=threads", "chaos=none"])
    assert opts == {"num_streams": 4, "fuse": False, "min_task_cost": 2.5, "executor": "threads", "chaos": None}


# --- timeline and profile ------------------------------------------------------------------------


@needs_matplotlib
def test_timeline_command_writes_trace_and_chart(capsys, tmp_path):
    out_path = tmp_path / "towers"
    code, out, err = run(capsys, "timeline", *TOWERS, "--out", str(out_path), "--runs", "2", "executor=threads")
    assert code == 0, err
    assert "overlap" in out and "critical path" in out
    trace = json.loads(out_path.with_suffix(".json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    assert out_path.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)


def test_profile_command_writes_a_profile(capsys, tmp_path):
    out_path = tmp_path / "profiles" / "towers.json"
    # Steadiness is tests/test_profile_spread.py's; here a busy machine must not refuse the profile.
    code, out, err = run(capsys, "profile", *TOWERS, "--out", str(out_path), "--runs", "2", "--max-spread", "1000")
    assert code == 0, err
    profile = load_profile(out_path)
    assert profile.model == "Towers" and profile.signature == "float32[4, 64]" and profile.runs == 2
    assert set(profile.task_us) == {t.name for t in profile.plan.tasks}
    assert str(out_path) in out


# --- bad input: one line on stderr, status 2 (1 when the model itself fails) ---------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "no_such_module_xyz:Model", "--input-shape", "1,3"], "cannot import module 'no_such_module_xyz'"),
        (["plan", "benchmarks.zoo:Incepton3", "--input-shape", "1,3"], "did you mean Inception3"),
        (["plan", "benchmarks.zoo", "--input-shape", "1,3"], "expected MODULE:FACTORY"),
        (["plan", "builtins:dict", "--input-shape", "1,3"], "not an nn.Module"),
        (["plan", *INCEPTION[:2], "1,three,75"], "bad input shape '1,three,75'"),
        (["plan", *INCEPTION[:2], "1,0"], "bad input shape '1,0'"),
        (["plan", "benchmarks.zoo:Inception3"], "--input-shape"),
        (["plan", *TOWERS, "num_stream=4"], "did you mean 'num_streams'"),
        (["plan", *TOWERS, "num_streams=0"], "num_streams"),
        (["plan", *TOWERS, "fast"], "key=value"),
        (["plan", *TOWERS, "--dtype", "float8"], "invalid choice: 'float8'"),
        (["plan", *TOWERS, "--device", "tpu:x"], "bad --device"),
        (["timeline", *TOWERS, "--out", "x", "--runs", "0"], "--runs must be at least 1"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_usage_error(capsys):
    code, _, err = run(capsys, "plan", *TOWERS, "--device", "cuda")
    assert code == 2 and "CUDA is not available" in err


def test_a_model_that_fails_on_the_inputs_exits_1_naming_the_module(capsys):
    code, _, err = run(capsys, "plan", "benchmarks.zoo:Inception3", "--input-shape", "1,4,75,75")
    assert code == 1
    assert "Conv2d_1a_3x3" in err and "4 channels" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["info", "plan", "timeline", "profile"])
def test_help_everywhere(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and f"python -m streamsched {command}" in out
    code, out, _ = run(capsys, "--help")
    assert code == 0 and command in out


# --- bench and stress are delegated to the checkout's benchmarks/ -------------------------------

DELEGATES = {"bench": "benchmarks.suite", "stress": "benchmarks.stress"}


@pytest.mark.parametrize("command", ["bench", "stress"])
def test_delegated_commands_get_their_arguments_untouched(capsys, monkeypatch, command):
    seen = []
    fake = types.ModuleType(DELEGATES[command])
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, DELEGATES[command], fake)
    argv = ["--help", "--out", "x", "plan=1", "-k"]
    assert main([command, *argv]) == 3
    assert seen == [argv]


@pytest.mark.parametrize("command", ["bench", "stress"])
def test_delegated_command_that_cannot_be_imported_exits_1(capsys, monkeypatch, command):
    monkeypatch.setitem(sys.modules, DELEGATES[command], None)  # "import" now fails
    code, _, err = run(capsys, command, "--quick")
    assert code == 1
    assert f"{DELEGATES[command]} is not available" in err


@pytest.mark.parametrize("command", ["bench", "stress"])
def test_delegated_command_outside_a_checkout_says_where_the_suite_lives(capsys, monkeypatch, command):
    monkeypatch.setattr(cli, "_find_checkout", lambda: None)
    code, _, err = run(capsys, command, "--quick")
    assert code == 1
    assert "benchmarks/" in err and "checkout" in err
    assert "Traceback" not in err


def test_the_checkout_is_found_beside_the_package_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cli._find_checkout() == REPO


@pytest.mark.parametrize("command", ["bench", "stress"])
def test_python_dash_m_streamsched_delegates_run_from_the_repository_root(command):
    done = subprocess.run(
        [sys.executable, "-m", "streamsched", command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"python -m streamsched {command}" in done.stdout


def test_importing_the_library_imports_nothing_from_the_checkout():
    code = "import sys, streamsched, streamsched.cli; print([m for m in sys.modules if m.startswith('benchmarks')])"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
