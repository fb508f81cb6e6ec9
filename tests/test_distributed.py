"""DistributedDataParallel over a StreamScheduledModule trains like one process on the
global batch: two CPU processes (gloo), each on half of the batch, against a single
process on all of it.

The two ranks are spawned once and train every configuration in turn (starting the
processes is most of the cost). Each rank writes its gradients and parameters to a file
and reports on a queue; a rank that crashes fails the run with its traceback, ranks
that hang are named after a timeout.
"""

from __future__ import annotations

import datetime
import queue
import socket
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, ParallelFCN

from .helpers import Towers, assert_close

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

WORLD = 2
GLOBAL_BATCH = 64
STEPS = 3
LR = 0.1
COLLECTIVE_TIMEOUT_S = 30.0
STARTUP_S = 60.0  # two fresh interpreters importing torch on a small, busy machine

# name -> (model factory, input width, batch dimension of the output); none of them has
# BatchNorm, whose batch statistics would differ between a half batch and the whole one.
MODELS = {
    "pfcn": (lambda: ParallelFCN(32), 32 * 20, 0),
    "towers": (lambda: Towers(4, 128), 128, 0),
    "ensemble": (lambda: CriticEnsemble(8), 23, 1),  # [critics, batch, 1]
}

# (id, model, StreamScheduledModule options, DistributedDataParallel options)
CONFIGS = [
    ("pfcn-fused-threads", "pfcn", {"executor": "threads", "fuse": True}, {}),
    ("pfcn-fused-serial-bucket_view", "pfcn", {"executor": "serial"}, {"gradient_as_bucket_view": True}),
    # DDP's reducer hooks every parameter's gradient accumulator: the direct hand-off
    # must see that and leave the gradients to autograd.
    ("pfcn-direct-handoff-serial", "pfcn", {"executor": "serial", "grad_handoff": "direct"}, {}),
    ("ensemble-fused-streams", "ensemble", {"executor": "streams", "fuse": True}, {}),
    ("towers-unfused-threads", "towers", {"executor": "threads", "fuse": False, "min_task_cost": 0.0}, {}),
]


class RankFailure(AssertionError):
    """A rank of the distributed run crashed, hung, or reported an error."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(name: str) -> nn.Module:
    torch.manual_seed(1234)  # the same initial parameters in every process
    return MODELS[name][0]()


def global_data(name: str, model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: a global batch of inputs and regression targets, the same in every process."""
    generator = torch.Generator().manual_seed(99)
    width = MODELS[name][1]
    with torch.no_grad():
        out_shape = model(torch.zeros(GLOBAL_BATCH, width)).shape
    return [
        (torch.randn(GLOBAL_BATCH, width, generator=generator), torch.randn(out_shape, generator=generator))
        for _ in range(STEPS)
    ]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def train_single_process(name: str) -> dict[str, Any]:
    """The reference: one process, the whole global batch, SGD, no wrapper."""
    model = make_model(name)
    data = global_data(name, model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train_rank(rank: int, name: str, config: dict, ddp_options: dict, device: str) -> dict[str, Any]:
    """DDP(StreamScheduledModule(model)) on this rank's half of every global batch."""
    model = make_model(name)
    data = [(x.to(device), y.to(device)) for x, y in global_data(name, model)]
    model.to(device)
    sm = ss.StreamScheduledModule(model, num_streams=4, **config)
    if device != "cpu":
        ddp_options = {"device_ids": [torch.device(device).index], **ddp_options}
    ddp = DistributedDataParallel(sm, **ddp_options)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    per_rank = GLOBAL_BATCH // WORLD
    out_batch_dim = MODELS[name][2]
    grads = []
    for x, y in data:
        start = rank * per_rank
        opt.zero_grad()
        loss_fn(ddp(x[start : start + per_rank]), y.narrow(out_batch_dim, start, per_rank)).backward()
        grads.append({n: p.grad.to("cpu", copy=True) for n, p in model.named_parameters()})
        opt.step()
    return {
        "grads": grads,
        "params": {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()},
        "executor": sm.plan.executor,
        "num_streams": sm.plan.num_streams,
        "fused_groups": len(sm.plan.fused_groups),
        "grad_handoffs": sorted({s.grad_handoff for s in sm._ss.fusion._stacks.values()}),
    }


def _rank_main(rank: int, port: int, configs: list, out_dir: str, fail_rank: int, device: str) -> None:
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
        # The cost model the test process's cuda-marked tests plan with (conftest.py), set
        # here too: with a GPU's own throughputs these small branches weigh less than a
        # launch and the unfused plan comes out on one stream (as it did on an H200).
        import streamsched.ir.cost

        from .conftest import TEST_SHAPES_GPU_MODEL

        streamsched.ir.cost.GPU_MODEL = TEST_SHAPES_GPU_MODEL
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        # A fused member of shape [1, k] gets its gradient as a [1, k] slice with strides
        # (1, 1): the memory order of DDP's (k, 1) bucket view, but DDP compares strides
        # literally and warns. The values are unaffected.
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
        if rank == fail_rank:
            raise RuntimeError(f"planted failure on rank {rank}")
        results = {cid: train_rank(rank, name, config, ddp_opts, device) for cid, name, config, ddp_opts in configs}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _rank_entry(rank: int, port: int, configs: list, out_dir: str, fail_rank: int, device: str, q: Any) -> None:
    try:
        _rank_main(rank, port, configs, out_dir, fail_rank, device)
        q.put((rank, "ok", ""))
    except BaseException:  # noqa: BLE001 - reported to the test process
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(configs: list, out_dir: Path, fail_rank: int = -1, device: str = "cpu") -> list[dict[str, Any]]:
    """Spawn WORLD ranks, wait for their reports, return each rank's results.

    Raises RankFailure with the tracebacks of every rank that failed (one crash makes the
    others fail too, in whatever order they report), or naming the ranks that sent nothing
    before the deadline; every process is ended either way.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (free_port(), configs, str(out_dir), fail_rank, device, q)
    procs = [ctx.Process(target=_rank_entry, args=(rank,) + args, daemon=True) for rank in range(WORLD)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, str]] = {}
    deadline = STARTUP_S + COLLECTIVE_TIMEOUT_S
    try:
        while len(reports) < WORLD:
            try:
                rank, status, detail = q.get(timeout=deadline)
            except queue.Empty:
                silent = [r for r in range(WORLD) if r not in reports]
                ended = {r: procs[r].exitcode for r in silent if procs[r].exitcode is not None}
                failed = "".join(f"\nrank {r} failed:\n{d}" for r, (st, d) in sorted(reports.items()) if st != "ok")
                raise RankFailure(
                    f"ranks {silent} sent no result within {deadline:.0f} s "
                    f"(exit codes of those that ended: {ended or 'none ended'}){failed}"
                ) from None
            reports[rank] = (status, detail)
        failures = [f"rank {r} failed:\n{d}" for r, (st, d) in sorted(reports.items()) if st != "ok"]
        if failures:
            raise RankFailure("\n".join(failures))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(CONFIGS, tmp_path_factory.mktemp("ddp"))


def assert_equals_single_process(per_rank: list[dict[str, Any]], name: str, config: dict, atol: float) -> None:
    reference = train_single_process(name)
    for rank, result in enumerate(per_rank):
        assert result["executor"] == config["executor"]
        if config.get("fuse", True):
            assert result["fused_groups"] > 0, "the fused configuration must actually fuse"
            assert result["grad_handoffs"] == ["autograd"], "DDP's hooks must keep gradients on autograd"
        else:
            assert result["num_streams"] > 1, "the unfused configuration must run branches side by side"
        for step, (g_rank, g_ref) in enumerate(zip(result["grads"], reference["grads"])):
            assert g_rank.keys() == g_ref.keys()
            for n in g_ref:
                assert_close(g_rank[n], g_ref[n], atol=atol, rtol=atol * 10, what=f"rank {rank} step {step} grad {n}")
        for n in reference["params"]:
            assert_close(
                result["params"][n], reference["params"][n], atol=atol, rtol=atol * 10, what=f"rank {rank} {n}"
            )
    # DDP's all-reduce gave both ranks the same gradients, hence the same parameters.
    for n in per_rank[0]["params"]:
        assert torch.equal(per_rank[0]["params"][n], per_rank[1]["params"][n]), n


@pytest.mark.parametrize("cid, name, config, ddp_options", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_ddp_over_a_wrapped_model_equals_single_process_training(ddp_results, cid, name, config, ddp_options):
    assert_equals_single_process([results[cid] for results in ddp_results], name, config, atol=1e-5)


def test_a_crashing_rank_fails_the_run_with_its_traceback(tmp_path):
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed.*planted failure on rank 1"):
        run_ranks(CONFIGS[:1], tmp_path, fail_rank=1)


# On CUDA, the backward of each branch runs on the side stream its forward ran on. DDP
# creates every parameter's gradient accumulator when it is constructed (on the stream
# current then) and hooks its all-reduce onto them, so each gradient reaches its bucket
# on that one stream after autograd made it wait for the side stream that computed it.
# Spin kernels (chaos) on the side streams make any missing wait show as wrong values.
# gloo runs two ranks on one GPU (NCCL would need one GPU per rank).
CUDA_CONFIGS = [
    (
        "towers-unfused-streams-chaos",
        "towers",
        {"executor": "streams", "fuse": False, "min_task_cost": 0.0, "chaos": 3},
        {},
    ),
    ("pfcn-fused-streams-chaos", "pfcn", {"executor": "streams", "chaos": 5}, {}),
    ("ensemble-fused-streams-bucket_view", "ensemble", {"executor": "streams"}, {"gradient_as_bucket_view": True}),
]


@pytest.mark.cuda
@pytest.mark.gpu  # worker processes: the emulated device lives in one process
def test_ddp_on_cuda_with_side_streams_equals_single_process_training(tmp_path):
    results = run_ranks(CUDA_CONFIGS, tmp_path, device="cuda:0")
    for cid, name, config, _ in CUDA_CONFIGS:
        assert_equals_single_process([r[cid] for r in results], name, config, atol=1e-4)
