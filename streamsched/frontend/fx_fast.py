"""torch.fx's per-call tracing work, without the generality the common calls do not need.

``fx.Tracer`` does, for every module call and every recorded operation, work sized for
any argument and any tracing context: ``create_arg`` asks a dozen type questions of each
argument (parameter, buffer, module, named tuple, opaque object, proxyable class) before
it finds a proxy or an int; ``Graph.create_node`` walks every node's arguments with pytree
to warn of raw symbolic ints; ``call_module`` copies the scope object per call; and each
node's module stack is copied with ``copy.copy``. On a model of a thousand small members
that was most of the trace.

:class:`FastTracerMixin` answers the calls whose every value is of a kind it knows
(proxies, numbers, strings, dtypes, devices, ``None``, ``...``, and tuples, lists, slices
and string-keyed dicts of them) the way fx does, more cheaply, and hands everything else
to fx. The graph, node names, arguments and ``meta`` come out the same
(``tests/test_fx_fast.py`` traces models both ways and compares). ``ENABLED = False``
switches it off.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import fx
from torch.fx import traceback as fx_traceback
from torch.fx.proxy import Scope

try:
    # Newer torch names it ``is_custom_class`` and logs a deprecation warning on every
    # call of the old name (hundreds a trace).
    from torch._library.opaque_object import is_custom_class as _is_opaque_type
except ImportError:  # pragma: no cover - depends on the torch version
    try:
        from torch._library.opaque_object import is_opaque_type as _is_opaque_type
    except ImportError:
        _is_opaque_type = None

ENABLED = True

# Atoms a node argument may be that are never symbolic and that fx keeps as they are.
_ATOMS = (
    int,
    float,
    bool,
    complex,
    str,
    type(None),
    type(Ellipsis),
    torch.dtype,
    torch.device,
    torch.memory_format,
    torch.layout,
)

_FX_LOG = logging.getLogger(fx.proxy.__name__)


def _registered_opaque(kind: type) -> bool:
    """Whether ``kind`` was registered as an opaque object type (fx then treats its values
    otherwise): such types never take the fast path."""
    if _is_opaque_type is None:  # pragma: no cover - a torch without opaque objects
        return False
    try:
        return bool(_is_opaque_type(kind))
    except Exception:  # noqa: BLE001 - a registry of another version: be careful
        return True


def _fast_types(proxy_types: tuple[type, ...]) -> tuple[frozenset[type], frozenset[type]]:
    atoms = frozenset(t for t in _ATOMS if not _registered_opaque(t))
    proxies = frozenset(t for t in proxy_types if not _registered_opaque(t))
    return atoms, proxies


def _plain(value: Any, atoms: frozenset[type]) -> bool:
    """Whether every value inside ``value`` (a node's converted arguments) is a node or an
    atom, through tuples, lists, dicts and slices only: then fx's walk for raw symbolic
    ints would find none."""
    kind = type(value)
    if kind in atoms or kind is fx.Node:
        return True
    if kind is tuple or kind is list or kind is fx.immutable_collections.immutable_list:
        return all(_plain(v, atoms) for v in value)
    if kind is dict or kind is fx.immutable_collections.immutable_dict:
        return all(_plain(v, atoms) for v in value.values())
    if kind is slice:
        return _plain(value.start, atoms) and _plain(value.stop, atoms) and _plain(value.step, atoms)
    return False


def set_arguments(node: fx.Node, args: tuple, kwargs: dict) -> None:
    """``node.args = args; node.kwargs = kwargs`` for a node just made without arguments.
    The setters go through ``Node.__setattr__``, which takes the node out of the graph's
    lookup table and puts it back (keyed by op and target: a no-op for a node that is
    the table's newest); fx's own update is called directly where it exists."""
    update = getattr(node, "_update_args_kwargs", None)
    if update is None:  # pragma: no cover - another torch
        node.args, node.kwargs = args, kwargs
    else:
        update(args, kwargs if kwargs else node.kwargs)


def fast_context(tracer: Any) -> bool:
    """Whether ``tracer`` (a :class:`FastTracerMixin` tracer) makes its nodes the fast
    way now: fx's context is the plain one (see ``create_node``) and the scope is fx's
    own ``Scope`` (see ``call_module``)."""
    return bool(
        tracer.__dict__.get("_fast")
        and type(tracer.scope) is Scope
        and not tracer.check_mutable_operations
        and not tracer.record_stack_traces
        and tracer.graph.owning_module is None
        and not fx_traceback.has_preserved_node_meta()
        and not _FX_LOG.isEnabledFor(logging.DEBUG)
    )


class FastTracerMixin:
    """Mixed into an ``fx.Tracer`` subclass, before ``fx.Tracer``: cheaper ``create_arg``,
    ``create_node`` and ``call_module`` with fx's results (see the module docstring)."""

    #: Proxy classes whose instances become their node (fx: ``isinstance(a, Proxy)``).
    fast_proxy_types: tuple[type, ...] = (fx.Proxy, fx.proxy.Attribute)

    def _fast_setup(self) -> None:
        self._fast_atoms, self._fast_proxies = _fast_types(self.fast_proxy_types)
        self._fast = ENABLED

    def create_arg(self, a: Any) -> Any:
        if self.__dict__.get("_fast"):
            kind = type(a)
            if kind in self._fast_atoms:
                return a
            if kind in self._fast_proxies:
                return a.node
            if kind is tuple:
                return tuple([self.create_arg(v) for v in a])
            if kind is list:
                return [self.create_arg(v) for v in a]
            if kind is slice:
                return slice(self.create_arg(a.start), self.create_arg(a.stop), self.create_arg(a.step))
            if kind is dict and all(type(k) is str for k in a):
                return {k: self.create_arg(v) for k, v in a.items()}
        return super().create_arg(a)  # type: ignore[misc]

    def create_node(
        self,
        kind: str,
        target: Any,
        args: tuple,
        kwargs: dict,
        name: Optional[str] = None,
        type_expr: Optional[Any] = None,
    ) -> fx.Node:
        graph: fx.Graph = self.graph  # type: ignore[attr-defined]
        atoms = self._fast_atoms if self.__dict__.get("_fast") else None
        if (
            atoms is None
            or type(args) is not tuple
            or type(kwargs) is not dict
            or self.check_mutable_operations  # type: ignore[attr-defined]
            or self.record_stack_traces  # type: ignore[attr-defined]
            or graph.owning_module is not None
            or fx_traceback.has_preserved_node_meta()
            or _FX_LOG.isEnabledFor(logging.DEBUG)
            or not (_plain(args, atoms) and _plain(kwargs, atoms))
        ):
            return super().create_node(kind, target, args, kwargs, name, type_expr)  # type: ignore[misc]
        # As fx's TracerBase.create_node does, but the node is made without arguments and
        # given them after: the graph's pytree walk for raw symbolic ints is skipped where
        # ``_plain`` found none.
        node = graph.create_node(kind, target, None, None, name, type_expr)
        if args or kwargs:
            set_arguments(node, args, kwargs)
        scope = self.scope  # type: ignore[attr-defined]
        self.node_name_to_scope[node.name] = (scope.module_path, scope.module_type)  # type: ignore[attr-defined]
        stack = self.module_stack  # type: ignore[attr-defined]
        if stack:
            node.meta["nn_module_stack"] = stack.copy() if type(stack) is OrderedDict else copy.copy(stack)
        return node

    def call_module(self, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        scope = self.scope  # type: ignore[attr-defined]
        if not self.__dict__.get("_fast") or type(scope) is not Scope:
            return super().call_module(m, forward, args, kwargs)  # type: ignore[misc]
        # fx's Tracer.call_module, with the scope saved as two values (fx copies the
        # Scope object with copy.copy on every call).
        path = self.path_of_module(m)  # type: ignore[attr-defined]
        saved = scope.module_path, scope.module_type
        scope.module_path, scope.module_type = path, type(m)
        try:
            num_calls = self.num_calls.get(path, 0)  # type: ignore[attr-defined]
            module_key = f"{path}@{num_calls}" if num_calls > 0 else path
            self.module_stack[module_key] = (path, type(m))  # type: ignore[attr-defined]
            self.num_calls[path] = num_calls + 1  # type: ignore[attr-defined]
            if not self.is_leaf_module(m, path):  # type: ignore[attr-defined]
                out = forward(*args, **kwargs)
            else:
                out = self.create_proxy("call_module", path, args, kwargs)  # type: ignore[attr-defined]
            key, _ = self.module_stack.popitem(last=True)  # type: ignore[attr-defined]
            if key != module_key:
                raise AssertionError(f"Unexpected key {key}, expected {module_key}")
        finally:
            scope.module_path, scope.module_type = saved
        return out
