"""What each graph value looked like on a real call: shapes, dtypes, devices.

The first call with a new input signature runs the traced graph node by node (this *is*
that call's forward, so its result is returned to the user) and records a
:class:`TensorMeta` for every tensor it produces. Fusion signatures, cost estimates and
the plan are computed from these records.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import fx

__all__ = ["TensorMeta", "ValueMeta", "describe", "run_and_record", "tensor_metas"]


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    contiguous: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}[{', '.join(map(str, self.shape))}]"


@functools.cache
def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ConstMeta:
    """A non-tensor value; ``value`` kept when small and hashable (ints, shapes)."""

    type_name: str
    value: Any = None


ValueMeta = Union[TensorMeta, ConstMeta, tuple]


def describe(value: Any) -> ValueMeta:
    if isinstance(value, torch.Tensor):
        return TensorMeta(
            tuple(value.shape),
            value.dtype,
            value.device,
            value.requires_grad,
            value.is_contiguous(),
        )
    if isinstance(value, (tuple, list)):
        return tuple(describe(v) for v in value)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)):
        return ConstMeta(type(value).__name__, value)
    return ConstMeta(type(value).__name__)


def tensor_metas(meta: ValueMeta) -> list[TensorMeta]:
    """All tensors in a (possibly nested) value description."""
    if isinstance(meta, TensorMeta):
        return [meta]
    if isinstance(meta, tuple):
        return [t for m in meta for t in tensor_metas(m)]
    return []


def run_and_record(
    graph: fx.Graph,
    root: torch.nn.Module,
    inputs: list[Any],
    on_error: Callable[[BaseException, fx.Node], None],
    record: Optional[dict[fx.Node, ValueMeta]] = None,
    effects: Any = None,
) -> Any:
    """Run ``graph`` node by node on real inputs, recording each value's description.

    Values are dropped after their last use, as ``torch.fx.Interpreter`` does, so the
    first call's peak memory is that of eager execution. ``on_error`` is called with the
    exception and the failing node before it propagates (to add the module path).
    ``effects`` (an active :class:`~streamsched.frontend.effects.EffectRecorder`) is told which
    node runs, so it attributes each storage access to its node.
    """
    nodes = list(graph.nodes)
    last_use: dict[fx.Node, fx.Node] = {}
    for node in reversed(nodes):
        for inp in node.all_input_nodes:
            last_use.setdefault(inp, node)
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        frees.setdefault(user, []).append(value)

    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    result: Any = None

    def load(a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: env[n])

    for node in nodes:
        if effects is not None:
            effects.begin(node.name)
        try:
            if node.op == "placeholder":
                value = next(it)
            elif node.op == "get_attr":
                value = fetch_attr(root, node.target)
            elif node.op == "call_module":
                value = root.get_submodule(node.target)(*load(node.args), **load(node.kwargs))
            elif node.op == "call_function":
                value = node.target(*load(node.args), **load(node.kwargs))
            elif node.op == "call_method":
                self_obj, *rest = load(node.args)
                value = getattr(self_obj, node.target)(*rest, **load(node.kwargs))
            elif node.op == "output":
                result = load(node.args[0])
                continue
            else:  # pragma: no cover - fx has no other ops
                raise RuntimeError(f"unknown fx op {node.op}")
        except Exception as exc:
            on_error(exc, node)
            raise
        finally:
            if effects is not None:
                effects.end()
        env[node] = value
        if record is not None:
            record[node] = describe(value)
        for dead in frees.get(node, ()):
            env.pop(dead, None)
    return result


def fetch_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj
