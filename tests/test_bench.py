"""The benchmark suite: its report (schema, correctness on every row, WRONG rows shown),
its timing method, its command line, and the two benchmark scripts."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.suite import SuiteOptions, main, run_suite
from benchmarks.suite import peers as peer_registry
from benchmarks.suite.cases import parse_families, suite_cases
from benchmarks.suite.correctness import compare, tolerance
from benchmarks.suite.peers import compile_skip_reason
from benchmarks.suite.timing import Clock, Stats, measure_interleaved, percentile
from benchmarks.suite.training import grad_error, hand_written_model
from benchmarks.suite.variant import BuiltCase, SuiteContext, Variant, settle
from streamsched import StreamScheduledModule
from streamsched.runner import Runner
from streamsched.testing import in_trial

ROOT = Path(__file__).resolve().parent.parent

ENV_KEYS = {"device", "device_name", "torch", "streamsched", "runtime_info", "date", "threads"}
CASE_KEYS = {"id", "family", "label", "kind", "params", "input_shapes", "rounds", "correctness", "rows"}
ROW_KEYS = {
    "name",
    "status",
    "reason",
    "max_abs_err",
    "tolerance",
    "setup_s",
    "stats",
    "speedup_vs_eager",
    "samples_ms",
    "calls_per_sample",
}
STAT_KEYS = {"median_ms", "min_ms", "p10_ms", "p90_ms", "spread_ms"}


def _load_script(name: str):
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    code = main(["--quick", "--device", "cpu", "--out", str(tmp_path), *extra])
    report = json.loads((tmp_path / "bench.json").read_text())
    table = (tmp_path / "bench.md").read_text()
    return code, report, table


# --- the report -------------------------------------------------------------------


def test_quick_suite_report_has_the_documented_schema(tmp_path):
    code, report, table = _run(tmp_path, "--models", "critic_ensemble,parallel_fcn")
    assert code == 0
    assert report["schema"] == "streamsched.bench/1"
    assert ENV_KEYS <= set(report["environment"])
    assert report["environment"]["threads"] == torch.get_num_threads()
    assert report["wrong"] == [] and report["errors"] == []
    ids = [case["id"] for case in report["cases"]]
    assert ids == [c.id for c in suite_cases("cpu", True, ["parallel_fcn", "critic_ensemble"])]
    assert any(case["kind"].startswith("training") for case in report["cases"])
    for case in report["cases"]:
        assert CASE_KEYS <= set(case)
        names = [row["name"] for row in case["rows"]]
        assert names[0] == "eager" and "streamsched" in names
        for row in case["rows"]:
            assert ROW_KEYS <= set(row), row["name"]
            if row["status"] in ("n/a", "skipped"):
                assert row["reason"], row["name"]
                continue
            assert row["status"] == "ok", (case["id"], row)
            # the correctness figure, and the raw samples it was timed with
            assert isinstance(row["max_abs_err"], float) and row["max_abs_err"] <= row["tolerance"]
            assert len(row["samples_ms"]) == case["rounds"] == 2
            assert STAT_KEYS <= set(row["stats"])
            assert row["stats"]["min_ms"] <= row["stats"]["median_ms"]
            expected = case["eager_median_ms"] / row["stats"]["median_ms"]
            assert row["speedup_vs_eager"] == pytest.approx(expected)
        # the table has a row per variant of the case
        assert f"### {case['label']}" in table
        for name in names:
            assert f"| {name} |" in table
    assert "## Speedup over eager" in table
    # the compile peer is off in quick mode, and says so
    reasons = {row["reason"] for case in report["cases"] for row in case["rows"] if row["name"] == "torch.compile"}
    assert reasons == {"disabled (--no-compile)"}


def test_the_critics_hand_written_peer_computes_the_same_function(tmp_path):
    """The critics' inference case has the hand-written stack beside the fused plan (the
    row issue 26 compares with), computing the model's function."""
    code, report, _ = _run(tmp_path, "--models", "critic_ensemble")
    inference = report["cases"][0]
    rows = {row["name"]: row for row in inference["rows"]}
    hand = rows["stacked baddbmm (hand-written)"]
    assert hand["status"] == "ok" and hand["max_abs_err"] < 1e-5 and hand["samples_ms"]
    assert rows["streamsched serial"]["info"]["fused_groups"] > 0


def test_peers_of_the_reference_case_compute_the_same_function(tmp_path):
    code, report, _ = _run(tmp_path, "--models", "parallel_fcn")
    inference = report["cases"][0]
    rows = {row["name"]: row for row in inference["rows"]}
    for name in ("torch.func vmap", "grouped conv (hand-written)", "stacked baddbmm (hand-written)"):
        assert rows[name]["status"] == "ok" and rows[name]["max_abs_err"] < 1e-5
    # fusion happened in the fused variants and not in the others
    assert rows["streamsched serial"]["info"]["fused_groups"] > 0
    assert rows["streamsched serial, no fusion"]["info"]["fused_groups"] == 0
    # the default (auto) runs an inference structure's first call as written: its one-off
    # cost and its plan are those of the call that planned, the second
    assert rows["streamsched"]["info"]["fused_groups"] > 0
    assert rows["streamsched"]["setup_what"].startswith("first two calls")
    assert rows["streamsched serial"]["setup_what"] == "first call (trace + fuse + plan)"
    assert rows["streamsched threads"]["info"]["executor"] == "threads"
    # and the plan its timed calls ran (the auto trial may choose after the first calls)
    assert rows["streamsched threads"]["info"]["timed"]["executor"] == "threads"
    assert rows["streamsched"]["info"]["timed"]["executor"] in ("serial", "threads", "eager")
    train = report["cases"][1]
    assert {row["name"] for row in train["rows"]} == {
        "eager",
        "streamsched",
        "streamsched, grad_handoff=direct",
        "streamsched, no fusion",
        "streamsched, fused_parameters()",
        "stacked baddbmm (hand-written)",
    }
    for row in train["rows"]:
        assert row["status"] == "ok" and row["max_abs_err"] <= 1e-5 and row["tolerance"] == 1e-5
    rows = {row["name"]: row for row in train["rows"]}
    # The stacked optimizer steps one tensor per fused group of parameters, as the
    # hand-written stacked model does.
    assert rows["streamsched, fused_parameters()"]["info"]["optimizer_tensors"] == 4
    assert rows["stacked baddbmm (hand-written)"]["info"]["optimizer_tensors"] == 4
    assert rows["stacked baddbmm (hand-written)"]["samples_ms"]
    assert rows["streamsched"]["info"]["optimizer_tensors"] == rows["eager"]["info"]["optimizer_tensors"] == 32


def _wrong_peer(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    return [Variant("deliberately wrong", call=lambda *xs: case.model(*xs) + 1.0)]


def _raising_peer(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    raise RuntimeError("peer exploded | on purpose")


def test_a_wrong_variant_is_marked_wrong_and_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_registry, "PEERS", [*peer_registry.PEERS, _wrong_peer])
    code, report, table = _run(tmp_path, "--models", "critic_ensemble")
    assert code == 1
    row = next(r for r in report["cases"][0]["rows"] if r["name"] == "deliberately wrong")
    assert row["status"] == "WRONG"
    assert row["max_abs_err"] == pytest.approx(1.0, abs=1e-6)
    assert row["samples_ms"], "a wrong row is still timed and shown"
    assert report["wrong"] == [f"{report['cases'][0]['id']}: deliberately wrong"]
    line = next(line for line in table.splitlines() if line.startswith("| deliberately wrong |"))
    assert "**WRONG**" in line
    assert "**WRONG**" in next(line for line in table.splitlines() if line.startswith("| CriticEnsemble"))


def test_a_failing_peer_is_an_error_row_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_registry, "PEERS", [*peer_registry.PEERS, _raising_peer])
    code, report, table = _run(tmp_path, "--models", "multitask_heads")
    assert code == 0  # not a streamsched row
    rows = {row["name"]: row for row in report["cases"][0]["rows"]}
    assert rows["_raising_peer"]["status"] == "error"
    assert "peer exploded" in rows["_raising_peer"]["detail"]
    assert rows["streamsched"]["status"] == "ok"
    assert "peer exploded \\| on purpose" not in table  # the detail stays in the JSON


def test_a_model_that_does_not_script_is_marked_not_applicable():
    # NASNetCells iterates over a Python list of tuples in forward: TorchScript refuses it.
    spec = suite_cases("cpu", True, ["nasnet_cells"])[0]
    model = spec.build().eval()
    case = BuiltCase(spec, model, spec.make_inputs(torch.device("cpu")), torch.device("cpu"))
    (variant,) = peer_registry.jit_script(case, SuiteContext(torch.device("cpu")))
    assert variant.status == "n/a" and variant.reason == "does not script"
    assert variant.call is None and variant.detail


# --- correctness and timing -------------------------------------------------------


def test_compare_reports_the_largest_error_and_structural_mismatches():
    a = torch.randn(3, 4)
    b = a.clone()
    b[1, 2] += 0.25
    assert compare(a, b).max_abs_err == pytest.approx(0.25)
    assert compare({"x": a, "y": a}, {"x": a, "y": b}).max_abs_err == pytest.approx(0.25)
    bad_shape = compare(a, a[:2])
    assert math.isinf(bad_shape.max_abs_err) and "shape" in bad_shape.reason
    assert math.isinf(compare([a], [a, a]).max_abs_err)
    nan = a.clone()
    nan[0, 0] = float("nan")
    assert math.isinf(compare(nan, a).max_abs_err)
    assert compare(nan, nan.clone()).max_abs_err == 0.0
    assert tolerance(a * 1000, 1e-4) == pytest.approx(1e-4 * float((a * 1000).abs().max()))
    assert tolerance(a * 1e-3, 1e-4) == pytest.approx(1e-4)


def test_grad_error_finds_a_wrong_and_a_missing_gradient():
    model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
    model(torch.randn(4, 5)).sum().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert grad_error(model, reference) == (0.0, None)
    model[0].weight.grad[1, 1] += 3e-5
    err, reason = grad_error(model, reference)
    assert err == pytest.approx(3e-5, rel=1e-3) and reason is None
    model[2].bias.grad = None
    err, reason = grad_error(model, reference)
    assert math.isinf(err) and reason == "no .grad for 2.bias"


@pytest.mark.parametrize("family", ["parallel_fcn", "critic_ensemble"])
def test_hand_written_stacked_gradients_are_compared_member_by_member(family):
    spec = next(c for c in suite_cases("cpu", True, [family]) if c.kind == "train")
    torch.manual_seed(0)
    model = spec.build().train()
    hand = hand_written_model(model)
    (x,) = spec.make_inputs(torch.device("cpu"))
    torch.testing.assert_close(hand(x), model(x))
    target = torch.randn(model(x).shape)
    torch.nn.functional.mse_loss(model(x), target).backward()
    torch.nn.functional.mse_loss(hand(x), target).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    err, reason = grad_error(hand, reference)
    assert err < 1e-6 and reason is None
    # every member's gradient is read from the stacks: one wrong element is found
    name = list(reference)[-4]  # a weight of the last member (fc1, or the critic's middle layer)
    reference[name][0, 0] += 1e-3
    err, reason = grad_error(hand, reference)
    assert err == pytest.approx(1e-3, rel=1e-2) and reason is None
    next(iter(hand.parameters())).grad = None
    err, reason = grad_error(hand, reference)
    assert math.isinf(err) and reason.startswith("no .grad for")


def test_percentile_and_stats_follow_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 90) == 7.0
    stats = Stats.of([float(v) for v in range(1, 12)])  # 1..11
    assert stats.median_ms == 6.0 and stats.min_ms == 1.0
    assert stats.p10_ms == pytest.approx(2.0) and stats.p90_ms == pytest.approx(10.0)
    assert stats.spread_ms == pytest.approx(8.0)
    with pytest.raises(ValueError, match="percentile"):
        percentile([], 50)


def test_rounds_are_interleaved_with_a_rotating_order():
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    result = measure_interleaved(fns, Clock(torch.device("cpu")), rounds=3, warmup=1, target_sample_s=0.0)
    timed = calls[3 + 6 :]  # after 1 warm-up and 2 calibration calls each
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(m.samples_ms) == 3 and m.calls_per_sample == 1 for m in result.values())
    with pytest.raises(ValueError, match="rounds"):
        measure_interleaved(fns, Clock(torch.device("cpu")), rounds=0)


def test_compile_policy_names_why_a_model_is_not_compiled():
    small, large = suite_cases("cpu", False, ["critic_ensemble"])[0], suite_cases("cpu", False, ["inception3"])[0]
    cpu = torch.device("cpu")

    def case(spec):
        return BuiltCase(spec, nn.Identity(), (), cpu)

    assert compile_skip_reason(case(small), SuiteContext(cpu, compile="auto")) is None
    assert "--compile" in compile_skip_reason(case(large), SuiteContext(cpu, compile="auto"))
    assert compile_skip_reason(case(large), SuiteContext(cpu, compile="on")) is None
    assert compile_skip_reason(case(small), SuiteContext(cpu, compile="off")) == "disabled (--no-compile)"
    ctx = SuiteContext(cpu, compile="on", over_budget={"critic_ensemble": "took 999 s"})
    assert compile_skip_reason(case(small), ctx) == "took 999 s"


# --- command line -----------------------------------------------------------------


def test_unknown_model_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--models", "resnet50"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnet50'" in err and "parallel_fcn" in err


@pytest.mark.parametrize("args, message", [(["--rounds", "0"], "--rounds"), (["--threads", "0"], "--threads")])
def test_bad_options_name_the_option(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["--quick", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--device", "cuda"])
    assert "CUDA is not available" in capsys.readouterr().err


def test_model_names_accept_class_names():
    assert parse_families("ParallelFCN, Inception3") == ["parallel_fcn", "inception3"]
    assert parse_families(None)[0] == "parallel_fcn"


def test_list_prints_the_cases_without_running(capsys, tmp_path):
    assert main(["--list", "--device", "cpu", "--models", "inception3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "inception3/b1/s149" in out and "inception3/b8/s149" in out
    assert not (tmp_path / "bench.json").exists()


# --- the benchmark scripts ----------------------------------------------------------


def test_planning_bench_writes_its_json(tmp_path, capsys):
    script = _load_script("planning_bench")
    edges, costs = script.random_dag(200, 64, seed=3)
    assert all(u < v and v - u <= 64 for u, v in edges) and len(costs) == 200
    preds = [0] * 200
    for _, v in edges:
        preds[v] += 1
    assert preds[0] == 0 and all(1 <= k <= 3 for k in preds[1:])
    assert script.main(["--out", str(tmp_path), "--repeats", "1", "--sizes", "300", "--members", "6"]) == 0
    report = json.loads((tmp_path / "planning_bench.json").read_text())
    assert [g["nodes"] for g in report["assign_streams"]] == [300, 300]
    assert all(g["streams_used"] <= 8 and g["total_s"] > 0 for g in report["assign_streams"])
    assert [fc["fuse"] for fc in report["first_call"]] == [True, False]
    assert all(fc["max_abs_err_vs_eager"] < 1e-5 for fc in report["first_call"])
    assert [r["fuse"] for r in report["new_size"]] == [True, False, True]
    assert all(r["max_abs_err_vs_eager"] < 1e-5 and r["planning_call_cpu_s"] > 0 for r in report["new_size"])


def test_overhead_bench_runs_every_executor_on_the_same_program(tmp_path, capsys):
    script = _load_script("overhead_bench")
    out = tmp_path / "sub" / "overhead.json"  # a .json path is written as such
    code = script.main(["--out", str(out), "--width", "3", "--depth", "2", "--rounds", "2", "--sample-ms", "0"])
    assert code == 0
    report = json.loads(out.read_text())
    names = {row["executor"] for row in report["rows"]}
    assert {"serial", "streams (Python)", "threads", "module call"} <= names
    assert ("streams (native)" in names) == report["native_available"]
    assert report["tasks"] >= 6 and report["num_streams"] >= 2
    assert all(row["max_abs_err_vs_eager"] < 1e-5 for row in report["rows"])
    assert "us/task" in capsys.readouterr().out


def test_progress_reports_grow_case_by_case():
    seen: list[list[str]] = []
    options = SuiteOptions(device="cpu", quick=True, families=["critic_ensemble", "multitask_heads"], compile="off")
    final = run_suite(
        options, log=lambda message: None, on_case=lambda rep: seen.append([c["id"] for c in rep["cases"]])
    )
    ids = [c["id"] for c in final["cases"]]
    assert len(ids) >= 2 and seen == [ids[: k + 1] for k in range(len(ids))]


# --- slower and device-specific ----------------------------------------------------


@pytest.mark.slow
def test_compile_peer_reports_its_compile_time(tmp_path):
    code, report, _ = _run(tmp_path, "--models", "multitask_heads", "--compile")
    assert code == 0
    row = next(r for r in report["cases"][0]["rows"] if r["name"] == "torch.compile")
    assert row["status"] == "ok" and row["setup_s"] > 0 and row["setup_what"].startswith("compile")


@pytest.mark.cuda
def test_overhead_bench_on_cuda_runs_real_streams(tmp_path, monkeypatch):
    from streamsched.ir import cost

    # The GPU's own cost model (the cuda-marked tests plan with one scaled to test shapes):
    # with it, the first GPU run's plan was one task on one stream, and nothing per task was
    # measured; the benchmark now plans with throughputs at which its layers weigh.
    monkeypatch.setattr(
        cost, "GPU_MODEL", cost.DeviceModel("cuda", flops_per_us=4.0e7, bytes_per_us=2.5e6, launch_us=5.0)
    )
    script = _load_script("overhead_bench")
    args = ["--device", "cuda", "--out", str(tmp_path), "--width", "3", "--depth", "2", "--rounds", "2"]
    assert script.main(args) == 0
    report = json.loads((tmp_path / "overhead_bench.json").read_text())
    names = {row["executor"] for row in report["rows"]}
    assert "threads" not in names and {"serial", "streams (Python)", "module call"} <= names
    assert report["tasks"] == 3 * 2 + 1 and report["num_streams"] > 1


@pytest.mark.cuda
@pytest.mark.gpu  # timings, and torch.compile's CUDA graphs need real CUDA
def test_quick_suite_on_cuda_includes_the_cuda_peers(tmp_path):
    code = main(["--quick", "--device", "cuda", "--out", str(tmp_path), "--models", "critic_ensemble"])
    report = json.loads((tmp_path / "bench.json").read_text())
    assert code == 0
    names = {row["name"] for row in report["cases"][0]["rows"]}
    assert {
        "CUDA graph (eager, 1 stream)",
        "streamsched streams",
        "streamsched, cuda_graph",
        "torch.compile reduce-overhead",
    } <= names
    for row in report["cases"][0]["rows"]:
        if row["status"] == "ok":
            assert row["max_abs_err"] <= row["tolerance"]


def test_streamsched_variants_are_timed_after_their_executor_trial(tmp_path, monkeypatch):
    """An ``auto`` wrapper's trial runs each way in turn for its first calls after planning
    (more of them than the suite's warm-up): the suite calls it until the trial decided,
    and reports those calls as part of its one-off cost, so no timed call is a trial's."""
    timed = Runner._timed

    def schedule_faster(self, compiled, name, *args, **kwargs):  # the same trial on every machine
        out, _ = timed(self, compiled, name, *args, **kwargs)
        return out, 1e-3 if name == "eager" else 1e-4

    monkeypatch.setattr(Runner, "_timed", schedule_faster)
    model = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = model

        def forward(self, x):
            return torch.stack([h(x) for h in self.heads]).sum(0)

    x = torch.randn(4, 16)
    ctx = SuiteContext(device=torch.device("cpu"))
    sm = StreamScheduledModule(Heads(), executor="auto", fuse=False, min_task_cost=0.0)
    with torch.no_grad():
        for _ in range(3):  # the suite's warm-up alone would still be in the trial
            sm(x)
        assert in_trial(sm)
        calls, seconds = settle(sm, lambda: sm(x), ctx)
        assert calls > 0 and seconds > 0 and not in_trial(sm)
        sm(x)
        assert not in_trial(sm) and sm._ss.last_path.startswith("plan")
    assert settle(sm, lambda: sm(x), ctx) == (0, 0.0)
    monkeypatch.undo()  # the suite's own trials, as measured
    code, report, table = _run(tmp_path, "--models", "multitask_heads")
    rows = {r["name"]: r for case in report["cases"] for r in case["rows"] if case["kind"].startswith("inference")}
    assert "calls of the executor trial" in rows["streamsched"]["setup_what"]
    assert "executor trial" not in rows["streamsched serial"]["setup_what"]
