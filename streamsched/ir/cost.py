"""Estimated cost of each node, in microseconds, from shapes alone.

The estimate is a roofline: ``max(flops / peak_flops, bytes / bandwidth)`` plus a fixed
per-launch overhead. It only has to rank tasks and tell tiny branches from heavy ones;
where precision matters, a measured profile replaces it (``SchedulerConfig.profile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx, nn

from ..frontend import node_meta
from ..frontend.meta import TensorMeta, ValueMeta, tensor_metas
from ..frontend.nodes import is_glue

__all__ = ["DeviceModel", "device_model_for", "estimate_node_cost", "node_flops"]


@dataclass(frozen=True)
class DeviceModel:
    """Throughputs of a device, per microsecond, and the host cost of one kernel launch."""

    name: str
    flops_per_us: float
    bytes_per_us: float
    launch_us: float


CPU_MODEL = DeviceModel("cpu", flops_per_us=4.0e4, bytes_per_us=8.0e3, launch_us=4.0)
# A Hopper-class GPU at fp32 without tensor cores; launch is the host-side cost.
GPU_MODEL = DeviceModel("cuda", flops_per_us=4.0e7, bytes_per_us=2.5e6, launch_us=5.0)


def device_model_for(device: Optional[torch.device]) -> DeviceModel:
    if device is not None and device.type == "cuda":
        return GPU_MODEL
    return CPU_MODEL


def _prod(xs: Any) -> int:
    return int(math.prod(xs)) if xs else 1


def _first_tensor(metas: list[ValueMeta]) -> Optional[TensorMeta]:
    for m in metas:
        for t in tensor_metas(m):
            return t
    return None


def node_flops(node: fx.Node, module: Optional[nn.Module], in_metas: list[ValueMeta], out_meta: ValueMeta) -> float:
    """Floating-point operations of one node (approximate, for ranking)."""
    outs = tensor_metas(out_meta)
    out = outs[0] if outs else None
    first_in = _first_tensor(in_metas)
    if module is not None:
        if isinstance(module, nn.Linear) and first_in is not None:
            return 2.0 * first_in.numel * module.out_features
        if isinstance(module, nn.modules.conv._ConvNd) and out is not None:
            per_out = module.in_channels // module.groups * _prod(module.kernel_size)
            if isinstance(module, nn.modules.conv._ConvTransposeNd) and first_in is not None:
                return 2.0 * first_in.numel * module.out_channels // module.groups * _prod(module.kernel_size)
            return 2.0 * out.numel * per_out
        if isinstance(module, (nn.RNNBase,)) and first_in is not None:
            gates = {"LSTM": 4, "GRU": 3}.get(type(module).__name__, 1)
            return 2.0 * gates * first_in.numel * module.hidden_size * module.num_layers * 2
        if isinstance(module, nn.MultiheadAttention) and first_in is not None:
            e = module.embed_dim
            return 8.0 * first_in.numel * e
    if node.op in ("call_function", "call_method") and out is not None:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name in ("matmul", "mm", "bmm", "baddbmm", "addmm", "linear", "einsum", "__matmul__"):
            ins = [t for m in in_metas for t in tensor_metas(m)]
            if len(ins) >= 2 and ins[0].shape:
                k = ins[0].shape[-1]
                return 2.0 * out.numel * k
        if name in ("conv1d", "conv2d", "conv3d"):
            ins = [t for m in in_metas for t in tensor_metas(m)]
            if len(ins) >= 2:
                w = ins[1]
                return 2.0 * out.numel * _prod(w.shape[1:])
    total = sum(t.numel for t in outs)
    return float(total) * (8.0 if module is not None and "Norm" in type(module).__name__ else 1.0)


def _parameters(module: nn.Module) -> Any:
    """``module.parameters()``; a module without children read from its own table."""
    if module._modules or type(module).parameters is not nn.Module.parameters:
        return module.parameters(recurse=True)
    # As parameters() yields them: each once (one may be registered under two names).
    return {id(p): p for p in module._parameters.values() if p is not None}.values()


def node_bytes(in_metas: list[ValueMeta], out_meta: ValueMeta, module: Optional[nn.Module]) -> float:
    total = sum(t.nbytes for m in in_metas for t in tensor_metas(m))
    total += sum(t.nbytes for t in tensor_metas(out_meta))
    if module is not None:
        total += sum(p.numel() * p.element_size() for p in _parameters(module))
    return float(total)


def estimate_node_cost(
    node: fx.Node,
    module: Optional[nn.Module],
    metas: dict[fx.Node, ValueMeta],
    device: DeviceModel,
) -> float:
    """Estimated microseconds for one node; glue nodes cost (almost) nothing."""
    if is_glue(node):
        return 0.1
    in_metas = [metas[n] for n in node.all_input_nodes if n in metas]
    out_meta = metas.get(node, ())
    fixed = node_meta.fixed_cost_us(node)
    if fixed is not None:
        return fixed
    flops = node_flops(node, module, in_metas, out_meta)
    nbytes = node_bytes(in_metas, out_meta, module)
    work = max(flops / device.flops_per_us, nbytes / device.bytes_per_us)
    launches = 1
    if module is not None and module._modules:
        # A container leaf (a branch module) launches one kernel per inner leaf.
        launches = max(1, sum(1 for m in module.modules() if not list(m.children())))
    return work + device.launch_us * launches
