"""Schedule profiles record how steady their measurements were, and plan with robust figures.

A profile is measured in rounds; a task keeps its fastest round median (other work on the
machine only adds time), and the spread of its round medians is stored. The CLI refuses
a profile whose rounds' totals spread wider than ``--max-spread`` (nothing written) and
warns about single tasks that do.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import streamsched as ss
from streamsched import cli
from streamsched.observe import schedule_profiles as profiles
from streamsched.observe.schedule_profiles import load_profile, measure_profile, profile_costs
from streamsched.observe.timeline import ObservedCall, TaskSpan
from streamsched.testing import last_path

from .helpers import Towers

TOWERS = ["tests.helpers:Towers", "--input-shape", "4,64"]


def _fake_rounds(schedule, per_round: list[dict[str, list[float]]]):
    """A stand-in for record_runs: round r's calls take ``per_round[r][task][call]`` us
    (the list repeats when more rounds are measured)."""
    rounds = itertools.cycle(per_round)

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


def test_measured_until_steady_a_slowed_round_is_set_aside(monkeypatch, planned):
    schedule = planned._ss.last
    per_round = [
        {"a": [300.0] * 3, "b": [50.0] * 3},  # another process took the cores
        {"a": [10.0] * 3, "b": [5.0] * 3},
        {"a": [11.0] * 3, "b": [5.0] * 3},
        {"a": [10.5] * 3, "b": [5.5] * 3},
        {"a": [999.0] * 3, "b": [999.0] * 3},  # never measured: steady after round 4
    ]
    monkeypatch.setattr(profiles, "record_runs", _fake_rounds(schedule, per_round))
    profile = measure_profile(planned, torch.randn(4, 32), runs=3, rounds=3, steady=0.5)
    assert profile.round_total_us == [350.0, 15.0, 16.0, 16.0] and profile.rounds == 4
    assert profile.kept_rounds == [1, 2, 3] and profile.kept_totals() == [15.0, 16.0, 16.0]
    assert profile.task_us == {"a": 10.0, "b": 5.0}
    assert profile.spread() == pytest.approx(1 / 15)


def test_measured_until_steady_gives_up_after_max_rounds(monkeypatch, planned):
    schedule = planned._ss.last
    per_round = [{"a": [10.0 * 3**r] * 2} for r in range(5)]  # each round 3x the last: never steady
    monkeypatch.setattr(profiles, "record_runs", _fake_rounds(schedule, per_round))
    profile = measure_profile(planned, torch.randn(4, 32), runs=2, rounds=2, steady=0.5, max_rounds=5)
    assert profile.rounds == 5 and profile.round_total_us == [10.0, 30.0, 90.0, 270.0, 810.0]
    assert profile.kept_totals() == [10.0, 30.0] and profile.spread() == pytest.approx(2.0)


def test_rounds_must_be_positive(planned):
    with pytest.raises(ValueError, match="rounds"):
        measure_profile(planned, torch.randn(4, 32), rounds=0)


def test_cli_refuses_a_profile_that_spread_too_wide(monkeypatch, capsys, tmp_path):
    per_round = [{"a": [10.0 * 2**r] * 2} for r in range(9)]  # each round twice the last
    real = profiles.measure_profile

    def measure_with_a_busy_round(sm, *inputs, **options):
        # record_runs' warm-up, which the stand-in skips: in inference the first call runs
        # as written and the second plans
        sm(*inputs)
        sm(*inputs)
        assert last_path(sm) != "as-written"
        monkeypatch.setattr(profiles, "record_runs", _fake_rounds(sm._ss.last, per_round))
        return real(sm, *inputs, **options)

    monkeypatch.setattr(cli, "measure_profile", measure_with_a_busy_round)
    out_path = tmp_path / "busy.json"
    code = cli.main(["profile", *TOWERS, "--out", str(out_path), "--runs", "2"])
    out, err = capsys.readouterr()
    assert code == 1 and not out_path.exists(), (out, err)
    # The fastest 3 of 9 rounds, 10, 20 and 40 us, spread 300%.
    assert "not steady" in err and "--max-spread" in err and "after 9 rounds" in err and "300%" in err
    # Accepted when asked.
    code = cli.main(["profile", *TOWERS, "--out", str(out_path), "--runs", "2", "--max-spread", "5"])
    out, err = capsys.readouterr()
    assert code == 0 and out_path.exists(), err
    assert load_profile(out_path).task_us == {"a": 10.0}
    assert "set aside" not in out  # three rounds were steady enough: no more measured


def test_cli_sets_a_slowed_round_aside(monkeypatch, capsys, tmp_path):
    per_round = [{"a": [400.0] * 2}, {"a": [10.0] * 2}, {"a": [11.0] * 2}, {"a": [10.5] * 2}]
    real = profiles.measure_profile

    def measure(sm, *inputs, **options):
        sm(*inputs)  # as written (an inference structure's first call), then planned
        sm(*inputs)
        assert last_path(sm) != "as-written"
        monkeypatch.setattr(profiles, "record_runs", _fake_rounds(sm._ss.last, per_round))
        return real(sm, *inputs, **options)

    monkeypatch.setattr(cli, "measure_profile", measure)
    out_path = tmp_path / "aside.json"
    code = cli.main(["profile", *TOWERS, "--out", str(out_path), "--runs", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and out_path.exists(), err
    assert "1 slower round(s) set aside: 0.40 ms" in out
    profile = load_profile(out_path)
    assert profile.kept_rounds == [1, 2, 3] and profile.task_us == {"a": 10.0}


def test_cli_warns_about_an_unsteady_task_in_a_steady_total(monkeypatch, capsys, tmp_path):
    # Task "small" doubles between rounds but weighs 2% of the total: no refusal, a warning.
    per_round = [{"big": [1000.0] * 2, "small": [20.0] * 2}, {"big": [1000.0] * 2, "small": [45.0] * 2}]
    real = profiles.measure_profile

    def measure(sm, *inputs, **options):
        # record_runs' warm-up, which the stand-in skips: in inference the first call runs
        # as written and the second plans
        sm(*inputs)
        sm(*inputs)
        assert last_path(sm) != "as-written"
        monkeypatch.setattr(profiles, "record_runs", _fake_rounds(sm._ss.last, per_round))
        return real(sm, *inputs, **{**options, "rounds": 2})

    monkeypatch.setattr(cli, "measure_profile", measure)
    out_path = tmp_path / "steady.json"
    code = cli.main(["profile", *TOWERS, "--out", str(out_path), "--runs", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and out_path.exists(), err
    assert "small (125%)" in err and "big" not in err
    assert "spread" in out
