"""Reliability: faults, the bad-input matrix of docs/reliability.md, and a short stress run."""

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks import stress

from .helpers import Towers, assert_close, called_on


class Branches(nn.Module):
    """``n`` towers, each ending in a branch that can be armed to raise."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(n))
        self.fail = -1
        self.exc: type = RuntimeError
        self.alive: list = []

    @ss.branch
    def end(self, h, k: int):
        self.alive.append(weakref.ref(h))
        if k == self.fail:
            raise self.exc(f"tower {k} failed")
        return h * 1.0

    def forward(self, x):
        return torch.stack([self.end(t(x), k) for k, t in enumerate(self.towers)]).sum(0)


@pytest.mark.parametrize("executor", ["serial", "threads", "streams"])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_fault_in_branch_k_propagates_releases_memory_and_recovers(executor, k, exc):
    model = Branches(4)
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=4, min_task_cost=0.0, fuse=False)
    x = torch.randn(8, 32)
    expected = model(x)  # eager: the wrapper is compared with the model, not with itself
    assert_close(called_on(sm, "recorded", x), expected)
    assert_close(called_on(sm, f"plan:{executor}", x), expected)
    threads = threading.active_count()
    model.alive.clear()
    model.fail, model.exc = k, exc
    with pytest.raises(exc, match=f"tower {k} failed"):
        sm(x)
    gc.collect()
    assert model.alive and all(ref() is None for ref in model.alive), "values of the failed call are still alive"
    assert threading.active_count() <= threads
    model.fail = -1
    assert_close(called_on(sm, f"plan:{executor}", x), expected)


def test_wrong_device_and_mixed_devices_raise_like_eager():
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(2, 16))
    meta = torch.empty(2, 16, device="meta")
    with pytest.raises(RuntimeError, match="device") as info:
        sm(meta)
    assert "towers.0.0" in str(info.value)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.fc(x) + y

    two = ss.StreamScheduledModule(Two())
    with pytest.raises(RuntimeError, match="device"):
        two(torch.randn(2, 4), torch.empty(2, 4, device="meta"))
    assert two(torch.randn(2, 4), torch.randn(2, 4)).shape == (2, 4)


def test_missing_and_extra_arguments_are_type_errors():
    sm = ss.StreamScheduledModule(Towers(2, 8))
    with pytest.raises(TypeError, match="Towers.forward"):
        sm(torch.randn(2, 8), extra=torch.randn(2))
    with pytest.raises(TypeError, match="Towers.forward"):
        sm()
    assert sm(torch.randn(2, 8)).shape == (2, 8)


def test_output_structure_that_depends_on_a_flag():
    class Either(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, pair: bool = False):
            h = self.fc(x)
            return (h, -h) if pair else h

    model = Either()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for path in ("recorded", "plan"):
        x = torch.randn(3, 4)
        out = called_on(sm, path, x)
        assert isinstance(out, torch.Tensor)
        assert_close(out, model(x))
        x = torch.randn(3, 4)
        out = called_on(sm, path, x, pair=True)
        assert type(out) is tuple and len(out) == 2
        assert_close(out, model(x, pair=True))


def test_output_structure_that_depends_on_a_shape_is_a_trace_error():
    class ByShape(nn.Module):
        def forward(self, x):
            return (x, x) if x.shape[0] > 1 else x

    with pytest.raises(ss.TraceError, match="ByShape.forward"):
        ss.StreamScheduledModule(ByShape(), strict=True)(torch.randn(2, 3))
    relaxed = ss.StreamScheduledModule(ByShape(), strict=False)
    out = relaxed(torch.randn(2, 3))
    assert isinstance(out, tuple)


def test_modules_added_and_removed_after_wrapping():
    class Growing(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(8, 8)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    model = Growing()
    sm = ss.StreamScheduledModule(model, executor="serial")

    def recorded_then_planned() -> None:
        for path in ("recorded", "plan"):
            x = torch.randn(2, 8)
            assert_close(called_on(sm, path, x), model(x))

    recorded_then_planned()
    model.layers.append(nn.Linear(8, 8))
    recorded_then_planned()  # re-traced: the new layer runs
    assert "layers_1" in sm.plan.tasks[0].nodes
    del model.layers[0]
    recorded_then_planned()


def test_config_field_of_the_wrong_type():
    with pytest.raises(ss.ConfigError, match="leaf_modules"):
        ss.StreamScheduledModule(Towers(2, 8), leaf_modules=3)
    with pytest.raises(ss.ConfigError, match="fuse"):
        ss.StreamScheduledModule(Towers(2, 8), fuse="yes")


def test_a_short_stress_run_is_clean(capsys):
    assert stress.main(["--runs", "60", "--soak", "300"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("stress: OK") and "mismatches 0" in line and "mutations caught" in line
