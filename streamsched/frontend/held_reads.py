"""Refusing a trace whose reads of held tensors run-time code may make stale.

The trace runs the forward once, and what the forward reads from state held outside
the graph's parameters and buffers (a tensor in a dict a plain object holds, an item of
a list, an attribute of an object, a module's plain tensor attribute) it reads then,
at trace time: the graph holds that tensor as a constant (or a ``get_attr`` read in
graph order, not in the forward's order). That is exact only where nothing writes that
state during the call. Code the trace does not run does run during the call: hooks of a
leaf module (they fire in its ``__call__`` at run time, not while the trace makes its
``call_module`` node), the forward of a module run as one opaque call, and
``@streamsched.branch`` / opaque functions. A forward hook that stores its module's
output where the forward reads it back (a feature collector) would hand every call the
previous call's tensor: the trace read the value the last call left, and the held-state
guards, seeing it replaced, only re-trace to bake the next stale one.

Whether such code writes the state cannot be told from outside (a hook that only reads
looks like one that writes), so a graph that reads a held tensor while such code runs
in the same call is refused: the forward then runs in eager dispatch, where each read
happens when eager's does. Global module hooks already make the wrapper run the model
as written (``runner``), and a hook added after planning changes the hook guards
(``state``), so the next call re-traces and meets this check.
"""

from __future__ import annotations

import dis
import functools
import inspect
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..branch import BranchCall, runs_as_branch
from .binder import is_plain
from .effects import storage_key
from .hooks import has_hooks
from .opaque_functions import OpaqueFunction

__all__ = ["HeldWrites", "run_time_code", "stale_held_read"]


def stale_held_read(
    graph: fx.Graph,
    root: torch.nn.Module,
    resolve: Callable[[str], Any],
    fresh: set[int],
    baked: tuple[torch.Tensor, ...],
) -> Optional[str]:
    """Why ``graph`` may answer a call with a stale held tensor (module docstring), or
    None. ``fresh``: the storages of tensors made while tracing; ``baked``: held tensors
    the trace computed with as real tensors."""
    read = _held_read(graph, root, resolve, fresh, baked)
    if read is None:
        return None
    writer = run_time_code(graph, resolve)
    if writer is None:
        return None
    return (
        f"the forward reads {read}, held outside the parameters and buffers, which {writer} runs "
        "during the same call and may replace: the trace would read it before that code runs"
    )


def _held_read(
    graph: fx.Graph, root: torch.nn.Module, resolve: Callable[[str], Any], fresh: set[int], baked: tuple
) -> Optional[str]:
    """A description of the first held tensor ``graph`` reads (a constant or a plain
    attribute, not a parameter or buffer, not made while tracing), or None."""
    if baked:
        return f"a held {_describe(baked[0])} (computed with while tracing)"
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = str(node.target).rpartition(".")
        try:
            owner = resolve(owner_path) if owner_path else root
            value = getattr(owner, name)
        except Exception:  # noqa: BLE001 - not resolvable here: not a held tensor we can name
            continue
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        if isinstance(owner, torch.nn.Module) and name in owner._buffers:
            continue
        if storage_key(value) in fresh:
            continue
        return f"a held {_describe(value)} ('{node.target}' in the graph)"
    return None


def run_time_code(
    graph: fx.Graph, resolve: Callable[[str], Any], opaque_types: Optional[tuple[type, ...]] = None
) -> Optional[str]:
    """A description of the first code the graph runs at run time that the trace did
    not see (a hook, an opaque module's forward, a branch or opaque function), or None.
    ``opaque_types``: where given, a module of a class outside ``torch`` counts only where
    it is a branch or of one of these types (opaque because tracing failed, or listed as
    a leaf), not a member left a call of its own for fusion, whose forward traces; and
    only code that may assign something (:func:`may_write`: a hook that only reads or
    logs, a branch computing on tensors, assigns nothing of the model's)."""
    writers = opaque_types is not None
    for node in graph.nodes:
        if node.op == "call_module":
            module = resolve(node.target)
            for sub in module.modules():
                if has_hooks(sub) and (not writers or any(may_write(h) for h in _hooks_of(sub))):
                    return f"a hook of {type(sub).__name__} ('{node.target}')"
            if runs_as_branch(module) or (
                not type(module).__module__.startswith("torch.")
                and (opaque_types is None or isinstance(module, opaque_types))
            ):
                if not writers or any(
                    may_write(type(m).forward) for m in module.modules() if not type(m).__module__.startswith("torch.")
                ):
                    return f"{type(module).__name__}.forward ('{node.target}', run as one call)"
        elif node.op == "call_function" and isinstance(node.target, (BranchCall, OpaqueFunction)):
            if not writers or may_write(getattr(node.target, "fn", None) or node.target):
                return f"the opaque function {getattr(node.target, 'label', None) or node.target}"
    return None


def _hooks_of(module: torch.nn.Module) -> list:
    return [
        *module._forward_hooks.values(),
        *module._forward_pre_hooks.values(),
        *module._backward_hooks.values(),
        *getattr(module, "_backward_pre_hooks", {}).values(),
    ]


# Bytecode that assigns (or deletes) an attribute, an item or a global.
_STORES = frozenset(
    {"STORE_ATTR", "DELETE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR", "STORE_GLOBAL", "DELETE_GLOBAL", "STORE_SLICE"}
)
# Method and function names that change a container or an object in place.
_MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
        "__setitem__",
        "__delitem__",
        "__setattr__",
        "__iadd__",
        "setattr",
        "delattr",
        "exec",
        "vars",
        "sort",
        "reverse",
        "register_buffer",
        "register_parameter",
        "add_module",
    }
)


def may_write(fn: Any, depth: int = 0) -> bool:
    """Whether ``fn`` (a function, bound method, ``partial``, callable object) may assign
    Python state: its bytecode (and the functions defined in it, and the module-level
    functions it calls by name, three levels down) stores an attribute, an item or a
    global, or calls a method or function of a name that changes things in place
    (``append``, ``update``, ``setattr``). True where the code cannot be read."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    # (A decorated function's own code: ``@streamsched.branch`` wraps with functools.wraps.)
    fn = inspect.unwrap(fn) if callable(fn) else fn
    code = getattr(fn, "__code__", None)
    if code is None:
        call = vars(type(fn)).get("__call__")
        code = getattr(call, "__code__", None)
        if code is None:
            return True
    if depth > 3:
        return True
    namespace = getattr(fn, "__globals__", {})
    todo = [code]
    while todo:
        c = todo.pop()
        todo.extend(k for k in c.co_consts if hasattr(k, "co_code"))
        for ins in dis.get_instructions(c):
            if ins.opname in _STORES:
                return True
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_GLOBAL", "LOAD_NAME") and ins.argval in _MUTATORS:
                return True
            if ins.opname == "LOAD_GLOBAL":
                callee = namespace.get(ins.argval)
                if (
                    getattr(callee, "__code__", None) is not None
                    and not getattr(callee, "__module__", "").startswith("torch")
                    and may_write(callee, depth + 1)
                ):
                    return True
    return False


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} tensor"


_MISSING = object()
_VERSION = ("_version", "_version")  # (trace._VERSION: a tensor's version guard)


class HeldWrites:
    """The held plain state a trace read (an attribute of a traced-through module or of
    an object the modules hold: ``self.n``, ``self.holder.scale``, ``if self.flag:``; an
    entry of a dict or list they hold; a class attribute, a global) where code the trace
    did not run runs during each call (:func:`run_time_code`). Such code may write that
    state before the forward reads it (a hook storing ``int(x.shape[0])`` that the forward
    multiplies by): the trace baked in the value the previous call left, eager reads the
    one this call wrote.

    Which held values such code writes cannot be told from its text, so the wrapper
    watches the calls: the first call with the trace runs the model as written, exact,
    while every attribute assignment to a tracked module or watched object is logged
    (``_generation.log_writes``: the value written need not differ, a hook writing the
    value it holds on one call may write another on the next) and the guarded values are
    compared after it (:meth:`written`). A trace whose read state was written is refused
    (eager dispatch); one whose was not is planned, and each of its later calls is watched
    the same way (a write that begins later refuses it from then on, and warns where the
    call ran the plan and the value it read changed). Writes the trace did not read (a
    counter the forward never reads, a logger) keep the plan."""

    __slots__ = ("owners", "names", "guards", "values", "writer", "observed")

    def __init__(self, owners: dict, names: Optional[frozenset], guards: tuple, values: dict, writer: str):
        self.owners = owners  # id -> a traced-through module or a watched held object
        self.names = names  # the attribute names traced code reads (None: any)
        self.guards = guards  # (owner, name, GlobalValue): compared after each watched call
        self.values = values  # (id, name) -> the value the trace read
        self.writer = writer  # the run-time code, for messages
        self.observed = False  # whether a call ran as written, watched, with no such write

    @classmethod
    def of(
        cls,
        graph: fx.Graph,
        resolve: Callable[[str], Any],
        owners: list,
        names: Optional[frozenset],
        guards: tuple,
        opaque_types: tuple[type, ...] = (),
    ) -> Optional[HeldWrites]:
        """None where the graph runs no code the trace did not see (hooks, branches,
        modules of ``opaque_types``, opaque functions), or the trace read no held plain
        state."""
        writer = run_time_code(graph, resolve, tuple(t for t in opaque_types if isinstance(t, type)))
        if writer is None:
            return None
        by_id: dict[int, Any] = {}
        values: dict[tuple[int, str], Any] = {}
        for owner in owners:
            by_id[id(owner)] = owner
            for name, value in _plain_items(owner):
                if names is None or name in names:
                    values[(id(owner), name)] = value
        # Guards of plain data only: a tensor's (by identity, or its version) is the held
        # tensor reads' matter (``stale_held_read``), a function's (a helper, a branch
        # method in the class's dict) no hook writes.
        data = tuple(g for g in guards if not (g[2].same or g[2].functions or g[2].name == _VERSION))
        if not values and not data:
            return None
        return cls(by_id, names, data, values, writer)

    def written(self, seen: set[tuple[int, str]]) -> Optional[tuple[str, bool]]:
        """``(what, changed)``: the first held value the trace read that was assigned
        during the watched call (``seen``, from ``log_writes``) or no longer holds its
        guard, and whether its value now differs from the one the trace read; or None."""
        names = self.names
        for oid, name in seen:
            owner = self.owners.get(oid)
            if owner is None or (names is not None and name not in names) or name.startswith("_streamsched"):
                continue
            if isinstance(owner, torch.nn.Module) and name not in owner.__dict__:
                continue  # a parameter, buffer or submodule: traces read those on every call
            if name == "training" and isinstance(owner, torch.nn.Module):
                continue  # plans are keyed by every module's mode
            now = _value(owner, name)
            before = self.values.get((oid, name), _MISSING)
            changed = before is _MISSING or not (type(now) is type(before) and now == before)
            return f"{type(owner).__name__}.{name}", changed
        for owner, name, guard in self.guards:
            if not guard.holds(owner):
                return f"{_owner_name(owner)}[{name!r}]", True
        return None

    def refusal(self, what: str) -> str:
        """Why a trace is refused, for ``sm.plan``."""
        return (
            f"the forward reads {what}, held outside the parameters and buffers, which {self.writer} wrote during a "
            "call: the trace would read it before that code runs"
        )


def _plain_items(owner: Any) -> list[tuple[str, Any]]:
    """The attributes of ``owner`` a trace may bake in (plain values)."""
    items = owner.__dict__ if isinstance(owner, torch.nn.Module) else getattr(owner, "__dict__", {})
    return [(k, v) for k, v in list(items.items()) if not k.startswith("_streamsched") and is_plain(v)]


def _value(owner: Any, name: str) -> Any:
    table = owner.__dict__ if hasattr(owner, "__dict__") else {}
    value = table.get(name, _MISSING)
    return getattr(owner, name, _MISSING) if value is _MISSING else value


def _owner_name(owner: Any) -> str:
    inner = getattr(owner, "obj", None)  # (trace._Attributes)
    return type(inner if inner is not None else owner).__name__
