"""Schedule profiles: measuring, the JSON round trip, and refusing a profile made for something else."""

from __future__ import annotations

import pytest
import torch

import streamsched as ss
from streamsched.errors import ConfigError, ProfileMismatchError
from streamsched.observe import schedule_profiles as profiles
from streamsched.observe.schedule_profiles import (
    ScheduleProfile,
    check_profile,
    load_profile,
    measure_profile,
    profile_costs,
)
from streamsched.observe.timeline import ObservedCall, TaskSpan
from streamsched.testing import assert_path

from .helpers import ConvTowers, Towers


@pytest.fixture(scope="module")
def measured() -> tuple[ss.StreamScheduledModule, ScheduleProfile]:
    torch.manual_seed(0)
    sm = ss.StreamScheduledModule(ConvTowers(), executor="threads", num_streams=4, min_task_cost=0.0)
    with torch.no_grad():
        profile = measure_profile(sm, torch.randn(2, 8, 12, 12), runs=3)
    return sm, profile


def test_profile_measures_every_task_of_the_plan(measured):
    sm, profile = measured
    assert profile.plan == sm.plan
    assert (profile.model, profile.signature, profile.device) == ("ConvTowers", "float32[2, 8, 12, 12]", "cpu")
    assert profile.executor == "threads" and profile.runs == 3
    assert profile.torch_version == torch.__version__ and profile.streamsched_version == ss.__version__
    assert set(profile.task_us) == {t.name for t in sm.plan.tasks}
    assert all(us > 0 for us in profile.task_us.values())
    assert profile_costs(profile) == profile.task_us


def test_task_cost_is_the_median_duration_over_the_runs(monkeypatch, measured):
    sm, _ = measured
    schedule = sm._ss.last
    durations = {"a": [30.0, 10.0, 20.0], "b": [5.0, 7.0, 1000.0]}  # one outlier in b

    def fake_runs(sm, *inputs, runs, warmup):
        calls = []
        for r in range(runs):
            spans, t = [], 0.0
            for i, (name, values) in enumerate(durations.items()):
                spans.append(TaskSpan(task=i, name=name, stream=0, start_us=t, end_us=t + values[r]))
                t += values[r]
            calls.append(ObservedCall(schedule, t, spans))
        return calls

    monkeypatch.setattr(profiles, "record_runs", fake_runs)  # the name measure_profile calls
    profile = measure_profile(sm, torch.randn(2, 8, 12, 12), runs=3)
    assert profile.task_us == {"a": 20.0, "b": 7.0}


def test_round_trip_through_json(measured, tmp_path):
    _, profile = measured
    path = profile.save(tmp_path / "nested" / "conv.json")
    loaded = load_profile(path)
    assert loaded == profile
    assert profile_costs(loaded) == profile_costs(profile)
    check_profile(loaded, "ConvTowers", "float32[2, 8, 12, 12]", "cpu")  # fits: no error


@pytest.mark.parametrize(
    "field, args, named",
    [
        ("model", ("Towers", "float32[2, 8, 12, 12]", "cpu"), ["model", "'ConvTowers'", "'Towers'"]),
        (
            "signature",
            ("ConvTowers", "float32[4, 8, 12, 12]", "cpu"),
            ["input signature", "'float32[2, 8, 12, 12]'", "'float32[4, 8, 12, 12]'"],
        ),
        ("device", ("ConvTowers", "float32[2, 8, 12, 12]", "cuda:0"), ["device", "'cpu'", "'cuda:0'"]),
    ],
)
def test_a_profile_for_something_else_is_refused_naming_what_differs(measured, tmp_path, field, args, named):
    _, profile = measured
    loaded = load_profile(profile.save(tmp_path / "p.json"))
    with pytest.raises(ProfileMismatchError) as info:
        check_profile(loaded, *args)
    message = str(info.value)
    for text in named:
        assert text in message
    other_fields = {"model", "input signature", "device"} - {named[0]}
    assert not any(f"{other}:" in message for other in other_fields)
    assert isinstance(info.value, ValueError)


def test_every_difference_is_named_at_once(measured):
    _, profile = measured
    with pytest.raises(ProfileMismatchError, match=r"model: .*; input signature: .*; device: "):
        check_profile(profile, "Towers", "float32[1]", "cuda:1")


def test_cuda_device_spellings_are_compared_as_devices(measured):
    _, profile = measured
    cuda_profile = profile.model_copy(update={"device": "cuda:0"})
    check_profile(cuda_profile, "ConvTowers", "float32[2, 8, 12, 12]", "cuda")  # "cuda" is the current one
    with pytest.raises(ProfileMismatchError, match="device"):
        check_profile(cuda_profile, "ConvTowers", "float32[2, 8, 12, 12]", "cuda:1")


def test_loading_something_that_is_not_a_profile(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "Towers"}')
    with pytest.raises(ConfigError, match="bad.json is not a streamsched schedule profile"):
        load_profile(bad)
    bad.write_text("not json at all")
    with pytest.raises(ConfigError, match="bad.json"):
        load_profile(bad)
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.json")


def test_profiles_work_for_serial_plans_too():
    sm = ss.StreamScheduledModule(Towers(3, 32), executor="serial")
    profile = measure_profile(sm, torch.randn(4, 32), runs=2)
    assert profile.executor == "serial"
    assert set(profile.task_us) == {t.name for t in sm.plan.tasks}
    assert profiles.PROFILE_FORMAT == profile.format


def test_measured_costs_reach_every_planned_task(measured, tmp_path):
    sm, profile = measured
    costs = profile_costs(profile)
    path = profile.save(tmp_path / "towers.json")
    replanned = ss.StreamScheduledModule(
        sm.module, executor="threads", num_streams=4, min_task_cost=0.0, profile=str(path)
    )
    with torch.no_grad():
        replanned(torch.randn(2, 8, 12, 12))
    assert [t.name for t in replanned.plan.tasks] == [t.name for t in profile.plan.tasks]
    for task in replanned.plan.tasks:
        assert task.cost_us == pytest.approx(costs[task.name], abs=1e-3), task.name
    assert any("profile" in note for note in replanned.plan.notes)


def test_a_profile_for_another_input_is_refused_naming_the_file(measured, tmp_path):
    sm, profile = measured
    path = profile.save(tmp_path / "towers.json")
    other = ss.StreamScheduledModule(sm.module, profile=str(path))
    with pytest.raises(ss.ProfileMismatchError) as info:
        other(torch.randn(3, 8, 12, 12))
    assert "towers.json" in str(info.value) and "signature" in str(info.value).lower()
    again = ss.StreamScheduledModule(sm.module, profile=str(path))
    with torch.no_grad():
        assert again(torch.randn(2, 8, 12, 12)).shape[0] == 2  # the matching input still works


def test_documented_import_paths_name_the_schedule_profiles_module():
    """``streamsched.observe.profiles`` (docs/observability.md) and ``streamsched.profiles``
    keep importing what ``streamsched.observe.schedule_profiles`` holds."""
    import streamsched.observe.profiles as old_path
    from streamsched.observe.profiles import load_profile as old_load
    from streamsched.observe.profiles import measure_profile as old_measure

    from streamsched import profiles as short_path
    from streamsched.observe import profiles as attribute

    assert old_path is profiles and attribute is profiles
    assert old_load is load_profile and old_measure is measure_profile
    assert short_path.measure_profile is measure_profile and short_path.ScheduleProfile is ScheduleProfile


def test_a_missing_profile_file_names_the_option_and_the_model_and_the_next_call_recovers(measured, tmp_path):
    """A mistyped ``profile=`` path: the error says which option of which wrapper points at
    nothing and how such a file is made (a bare ``[Errno 2]`` named only the path), keeps
    the type ``FileNotFoundError``, and once the file exists the same wrapper plans with it
    and computes as eager."""
    sm, profile = measured
    model = sm.module
    path = tmp_path / "towers.json"
    wrapped = ss.StreamScheduledModule(model, executor="threads", num_streams=4, min_task_cost=0.0, profile=str(path))
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad(), pytest.raises(FileNotFoundError) as info:
        wrapped(x)
    message = str(info.value)
    assert "SchedulerConfig.profile" in message and "ConvTowers" in message, message
    assert "python -m streamsched profile" in message and str(path) in message, message
    assert info.value.filename == str(path)
    profile.save(path)
    with torch.no_grad():
        for _ in range(2):  # the recording call, then the compiled plan
            x = torch.randn(2, 8, 12, 12)
            out = wrapped(x)
            torch.testing.assert_close(out, model(x))
    assert_path(wrapped, "plan:threads")
    assert any("profile" in note for note in wrapped.plan.notes)
