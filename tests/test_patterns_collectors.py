"""Forward hooks that collect features into a ``defaultdict`` an object holds, read back
and cleared by the model's forward (timm's ``features_only=True, feature_cls="hook"``:
``FeatureHooks``, ``FeatureHookNet``). The forward changes that dict (a lookup with the
traced device inserts a key, the read replaces its entry): it cannot be traced, and runs
as written under eager dispatch on every call. The first refused trace must leave the
dict as it found it, and every later trace (another signature: training after eval)
must see the change again: a trace that missed it returned the empty collection it read
while tracing, an empty list, on every call."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from functools import partial

import pytest
import torch
from torch import nn

import streamsched as ss

from .helpers import calls_alongside

D = 8


class Collector:
    """A plain object holding what forward hooks hand over, by device (FeatureHooks)."""

    def __init__(self, named: dict[str, nn.Module]):
        self.outputs = defaultdict(OrderedDict)
        for name, module in named.items():
            module.register_forward_hook(partial(self._collect, name))

    def _collect(self, name, module, args, out):
        self.outputs[out.device][name] = out

    def get(self, device):
        out = self.outputs[device]
        self.outputs[device] = OrderedDict()  # cleared after reading
        return out


class HookedFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.a = nn.Sequential(nn.Linear(D, D), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.c = nn.Linear(D, D)
        self.collector = Collector({"a": self.a, "c": self.c})

    def forward(self, x):
        x = self.stem(x)
        x = self.c(self.b(self.a(x)))
        return list(self.collector.get(x.device).values())


@pytest.mark.parametrize("executor", ["serial", "threads", "auto"])
def test_features_collected_by_hooks_into_a_defaultdict(executor):
    torch.manual_seed(0)
    model, ref = HookedFeatures(), HookedFeatures()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor)

    def check(call, actual, expected):
        assert len(actual) == len(expected) == 2, f"call {call}: {len(actual)} features, eager {len(expected)}"
        # Nothing a trace made stayed in the collector: devices only, each emptied.
        assert all(isinstance(k, torch.device) for k in model.collector.outputs), list(model.collector.outputs)
        assert all(not v for v in model.collector.outputs.values())

    calls_alongside(
        sm,
        model,
        ref,
        [False, False, False, True, True, True, False],
        ("eager-dispatch", "as-written"),
        "collector",
        D,
        check,
    )
