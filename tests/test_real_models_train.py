"""benchmarks/real_models_bench.py's training table: the loss it reads, the gradient
check (a wrong, missing or extra gradient is WRONG; float32 noise on a gradient that is
zero in exact arithmetic is not) and one small case end to end."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch
from torch import nn

from benchmarks.zoo.real import MLPEnsemble, vectors

ROOT = Path(__file__).resolve().parent.parent


def _load():
    path = ROOT / "benchmarks" / "real_models_bench.py"
    spec = importlib.util.spec_from_file_location("_bench_script_real_models_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


class _Output(OrderedDict):
    """Like a transformers ``ModelOutput``: a mapping whose fields are attributes too."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def test_loss_reads_logits_else_last_hidden_state_else_every_tensor():
    logits, hidden, other = torch.randn(2, 3), torch.randn(2, 4), torch.randn(5)
    assert bench.loss_tensors(_Output(logits=logits, hidden_states=other))[0] is logits
    assert len(bench.loss_tensors(_Output(logits=logits, hidden_states=other))) == 1
    assert bench.loss_tensors(_Output(last_hidden_state=hidden, pooler_output=other))[0] is hidden
    assert [id(t) for t in bench.loss_tensors(_Output(last_hidden_state=hidden, logits=logits))] == [id(logits)]
    got = bench.loss_tensors((hidden, [other, torch.arange(3)], {"x": logits}))
    assert [id(t) for t in got] == [id(hidden), id(other), id(logits)]  # integer tensors left out
    loss = bench.training_loss((hidden, other))
    assert torch.allclose(loss, hidden.square().mean() + other.square().mean())


def test_derandomize_sets_dropout_rates_to_zero():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.Sequential(nn.AlphaDropout(0.5)))
    bench.derandomize(model)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd))
    x = torch.randn(8, 4)
    model.train()
    assert torch.equal(model(x), model(x))


def _grads(model: nn.Module, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (model(x).square().mean() * scale).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_check_flags_wrong_missing_and_extra_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 4)
    reference = _grads(model, x)
    rel, absolute, reason = bench.grad_error(model, reference)
    assert rel == 0.0 and absolute == 0.0 and reason is None

    _grads(model, x, scale=1.01)  # every gradient 1% off
    rel, _, reason = bench.grad_error(model, reference)
    assert rel > bench.GRAD_RTOL and reason is None

    _grads(model, x)
    model[0].bias.grad = None  # a parameter eager has a gradient for, the variant none
    rel, _, reason = bench.grad_error(model, reference)
    assert math.isinf(rel) and "0.bias" in reason

    _grads(model, x)
    rel, _, reason = bench.grad_error(model, {n: g for n, g in reference.items() if n != "2.weight"})
    assert math.isinf(rel) and "2.weight" in reason


def test_grad_check_tolerates_noise_on_a_gradient_that_is_zero_in_exact_arithmetic():
    # Attention's key bias: softmax ignores a constant added to a row, so its gradient is
    # float32 noise (1e-19 in BERT), relative to itself anything; against the floor, nothing.
    reference = {"w": torch.full((3,), 0.05), "key_bias": torch.tensor([1.5e-19, -1e-19])}
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(3))
    model.key_bias = nn.Parameter(torch.zeros(2))
    model.w.grad = reference["w"].clone()
    model.key_bias.grad = torch.tensor([1e-20, 2e-19])
    rel, _, reason = bench.grad_error(model, reference)
    assert reason is None and rel < 1e-12
    model.key_bias.grad = torch.tensor([1e-4, 0.0])  # a real error: 2e-3 of the model's scale
    rel, _, _ = bench.grad_error(model, reference)
    assert rel > bench.GRAD_RTOL


def test_training_table_end_to_end():
    torch.set_num_threads(1)
    case = bench.Case(
        "mlp_x4",
        "torch",
        partial(MLPEnsemble, 4, d_in=8, hidden=16, d_out=2, activation=nn.ReLU, mean=False),
        vectors(4, 8),
        "4 MLPs",
    )
    args = argparse.Namespace(rounds=3, warmup=1, sample_ms=1.0)
    table = bench.run_training(case, args)
    assert set(table) == {"eager", "eager (copy)", "streamsched"}
    for name, row in table.items():
        assert row["ok"] is True, (name, row)
        assert row["grad_params"] == 4 * 6
        assert len(row["samples_ms"]) == 3
    plan = table["streamsched"]
    assert plan["settled"] is True and plan["settle_calls"] <= 60
    assert plan["executor"] in {"serial", "threads", "eager"}
    if plan["trial"] is not None:
        assert "forward and backward" in plan["reason"]
    report = {
        "environment": {
            "device_name": "cpu",
            "threads": 1,
            "torch": torch.__version__,
            "streamsched": "x",
            "runtime_info": {},
            "date": "d",
        },
        "options": {"rounds": 3, "sample_ms": 1.0},
        "models": [{"name": case.name, "library": case.library, "input": case.note, "train": table}],
    }
    text = bench.markdown(report)
    assert "## Training step" in text and "## Inference" not in text and "| mlp_x4 (torch) |" in text


def test_the_cpu_clock_leaves_out_time_the_thread_did_not_run():
    """``--clock cpu``: a sample counts the calling thread's CPU time, not the time it
    waited (another process holding the core looks like this sleep to the wall clock)."""
    import time

    cpu = bench.CpuClock().per_call_s(lambda: time.sleep(0.02), 2)
    wall = bench.Clock(torch.device("cpu")).per_call_s(lambda: time.sleep(0.02), 2)
    assert wall >= 0.02 > 0.005 > cpu
    report = {
        "environment": {
            "device_name": "cpu",
            "threads": 1,
            "torch": torch.__version__,
            "streamsched": "x",
            "runtime_info": {},
            "date": "d",
        },
        "options": {"rounds": 3, "sample_ms": 1.0, "clock": "cpu"},
        "models": [],
    }
    assert "of the calling thread's CPU time" in bench.markdown(report)
