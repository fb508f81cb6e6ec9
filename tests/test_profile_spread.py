"""Schedule profiles record how steady their measurements were, and plan with robust figures.

A profile is measured in rounds; a task keeps its fastest round median (other work on the
machine only adds time), and the spread of its round medians is stored. The CLI refuses
a profile whose rounds' totals spread wider than ``--max-spread`` (nothing written) and
warns about single tasks that do.
"""

from __future__ import annotations

import pytest
import torch

import streamsched as ss
from streamsched import cli
from streamsched.observe import profiles
from streamsched.observe.profiles import load_profile, measure_profile, profile_costs
from streamsched.observe.timeline import ObservedCall, TaskSpan

from .helpers import Towers

TOWERS = ["tests.helpers:Towers", "--input-shape", "4,64"]


def _fake_rounds(schedule, per_round: list[dict[str, list[float]]]):
    """A stand-in for record_runs: round r's calls take ``per_round[r][task][call]`` us."""
    rounds = iter(per_round)

    def fake_runs(sm, *inputs, runs, warmup):
        durations = next(rounds)
        calls = []
        for r in range(runs):
            spans, t = [], 0.0
            for i, (name, values) in enumerate(durations.items()):
                spans.append(TaskSpan(task=i, name=name, stream=0, start_us=t, end_us=t + values[r]))
                t += values[r]
            calls.append(ObservedCall(schedule, t, spans))
        return calls

    return fake_runs


@pytest.fixture(scope="module")
def planned() -> ss.StreamScheduledModule:
    sm = ss.StreamScheduledModule(Towers(3, 32), executor="serial")
    sm(torch.randn(4, 32))
    return sm


def test_a_busy_round_neither_sets_the_figure_nor_goes_unnoticed(monkeypatch, planned):
    schedule = planned._ss.last
    per_round = [
        {"a": [300.0, 310.0, 290.0], "b": [50.0, 52.0, 51.0]},  # the machine was busy
        {"a": [11.0, 10.0, 12.0], "b": [5.0, 6.0, 4.0]},
        {"a": [10.0, 9.0, 30.0], "b": [5.0, 5.0, 5.0]},
    ]
    monkeypatch.setattr(profiles, "record_runs", _fake_rounds(schedule, per_round))
    profile = measure_profile(planned, torch.randn(4, 32), runs=3, rounds=3)
    assert profile.rounds == 3 and profile.runs == 3
    # Each task: the fastest of its round medians (a: 300, 11, 10 -> 10; b: 51, 5, 5 -> 5).
    assert profile.task_us == {"a": 10.0, "b": 5.0}
    assert profile_costs(profile) == {"a": 10.0, "b": 5.0}  # what the planner reads
    assert profile.task_spread == {"a": pytest.approx(29.0), "b": pytest.approx(9.2)}
    assert profile.round_total_us == [351.0, 16.0, 15.0]
    assert profile.spread() == pytest.approx(336 / 15)
    assert [name for name, _ in profile.unsteady_tasks(0.5)] == ["a", "b"]


def test_steady_rounds_have_small_spread_and_round_trip(monkeypatch, planned, tmp_path):
    schedule = planned._ss.last
    steady = {"a": [10.0, 10.5, 9.5], "b": [5.0, 5.0, 5.0]}
    monkeypatch.setattr(profiles, "record_runs", _fake_rounds(schedule, [steady] * 2))
    profile = measure_profile(planned, torch.randn(4, 32), runs=3, rounds=2)
    assert profile.spread() == 0.0 and profile.unsteady_tasks(0.01) == []
    loaded = load_profile(profile.save(tmp_path / "p.json"))
    assert loaded == profile and loaded.task_spread == {"a": 0.0, "b": 0.0}


def test_rounds_must_be_positive(planned):
    with pytest.raises(ValueError, match="rounds"):
        measure_profile(planned, torch.randn(4, 32), rounds=0)


def test_cli_refuses_a_profile_that_spread_too_wide(monkeypatch, capsys, tmp_path):
    per_round = [{"a": [400.0] * 2}, {"a": [10.0] * 2}, {"a": [11.0] * 2}]
    real = profiles.measure_profile

    def measure_with_a_busy_round(sm, *inputs, runs, rounds):
        sm(*inputs)  # plans (record_runs' warm-up, which the stand-in skips)
        monkeypatch.setattr(profiles, "record_runs", _fake_rounds(sm._ss.last, per_round))
        return real(sm, *inputs, runs=runs, rounds=rounds)

    monkeypatch.setattr(cli, "measure_profile", measure_with_a_busy_round)
    out_path = tmp_path / "busy.json"
    code = cli.main(["profile", *TOWERS, "--out", str(out_path), "--runs", "2"])
    out, err = capsys.readouterr()
    assert code == 1 and not out_path.exists(), (out, err)
    assert "not steady" in err and "--max-spread" in err
    # Accepted when asked, with the task named as unsteady.
    per_round[:] = [{"a": [400.0] * 2}, {"a": [10.0] * 2}, {"a": [11.0] * 2}]
    code = cli.main(["profile", *TOWERS, "--out", str(out_path), "--runs", "2", "--max-spread", "100"])
    out, err = capsys.readouterr()
    assert code == 0 and out_path.exists(), err
    assert load_profile(out_path).task_us == {"a": 10.0}


def test_cli_warns_about_an_unsteady_task_in_a_steady_total(monkeypatch, capsys, tmp_path):
    # Task "small" doubles between rounds but weighs 2% of the total: no refusal, a warning.
    per_round = [{"big": [1000.0] * 2, "small": [20.0] * 2}, {"big": [1000.0] * 2, "small": [45.0] * 2}]
    real = profiles.measure_profile

    def measure(sm, *inputs, runs, rounds):
        sm(*inputs)  # plans (record_runs' warm-up, which the stand-in skips)
        monkeypatch.setattr(profiles, "record_runs", _fake_rounds(sm._ss.last, per_round))
        return real(sm, *inputs, runs=runs, rounds=2)

    monkeypatch.setattr(cli, "measure_profile", measure)
    out_path = tmp_path / "steady.json"
    code = cli.main(["profile", *TOWERS, "--out", str(out_path), "--runs", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and out_path.exists(), err
    assert "small (125%)" in err and "big" not in err
    assert "spread" in out
