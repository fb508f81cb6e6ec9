"""Alike members traced once: the later members' nodes made from the first's recording.

A model of a thousand alike members (``ParallelFCN``: a ``ModuleList`` of MLPs, each
``fc2(relu(fc1(x)))``) spent most of its trace in torch.fx's per-call machinery for each
member: the patched ``__call__`` and ``__getattr__``, ``_call_impl``, the forward's own
code, the leaf decisions and ``create_proxy`` (argument conversion, proxies) of every
child call. This module makes the trace of such a member without running any of that,
where doing so provably gives the nodes a real trace gives.

The proof rests on the forward's code (:func:`code_plan`), not on comparing modules: a
forward whose bytecode only loads its arguments and locals, reads children of ``self``
by name and calls them, stores locals and returns one of them (or a tuple of them), with
no branch, no global, closure or other attribute read, no operator and no constant but
plain atoms, does nothing in a trace but call those children in that order, each with
values the earlier calls returned. Where every child it calls is a leaf (decided for
each member, as the trace decides it), with the same class as the first member's, no
instance ``forward``, no forward or forward-pre hook and no ``__call__`` of its own,
that trace is one ``call_module`` node per call, whose name, ``meta``, scope, module stack and call count
follow from the child's path alone. So the first member of a kind is traced the normal
way and its nodes recorded (:class:`Recording`); a later member of the same kind makes
the same calls on its own children (:meth:`MemberReplay.replay`), in the way
``FastTracerMixin.call_module`` and ``create_proxy`` make a leaf call's node, the rank
tracker noting each one for real. Anything else (a hook on the member or a global one,
an override of ``__call__`` / ``_call_impl`` / ``__getattr__``, a child that is not a
leaf or not plain, learned leaf outputs, an output capture in progress, fx's context
not the plain one, an autocast or inference-mode change) traces the member the normal
way. ``ENABLED = False`` switches replay off.
"""

from __future__ import annotations

import copy
import dis
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import fx

from .fx_fast import fast_context, set_arguments
from .hooks import capture_collecting, global_hooks

ENABLED = True

# Instructions a replayable forward may hold (3.11 and 3.12 spellings). A load of an
# attribute must read a child of ``self`` (checked in code_plan).
_ALLOWED = frozenset(
    {
        "RESUME",
        "NOP",
        "CACHE",
        "LOAD_FAST",
        "STORE_FAST",
        "LOAD_CONST",
        "RETURN_CONST",
        "LOAD_ATTR",
        "LOAD_METHOD",
        "PUSH_NULL",
        "PRECALL",
        "CALL",
        "POP_TOP",
        "BUILD_TUPLE",
        "RETURN_VALUE",
    }
)
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_CONSTANTS = (type(None), bool, int, float, str)
# Code flags that rule a forward out: *args, **kwargs, generators and coroutines. (A
# closure's cells are refused by co_freevars.)
_REFUSED_FLAGS = 0x04 | 0x08 | 0x20 | 0x80 | 0x100 | 0x200

_plans: weakref.WeakKeyDictionary[types.CodeType, Optional[tuple[str, ...]]] = weakref.WeakKeyDictionary()

# Names a class may not define (below nn.Module) for its members to be replayed: each
# would run code of its own on the call, or read the children otherwise.
_MEMBER_OVERRIDES = ("__call__", "_call_impl", "_wrapped_call_impl", "__getattr__", "__getattribute__")
_CHILD_OVERRIDES = ("__call__",)


def code_plan(code: types.CodeType) -> Optional[tuple[str, ...]]:
    """The names of the children of ``self`` that a forward of ``code`` reads, where its
    code does nothing in a trace but call them (module docstring); ``None`` where it
    may do anything else."""
    try:
        return _plans[code]
    except KeyError:
        pass
    plan = _code_plan(code)
    _plans[code] = plan
    return plan


def _code_plan(code: types.CodeType) -> Optional[tuple[str, ...]]:
    if code.co_flags & _REFUSED_FLAGS or code.co_freevars or code.co_cellvars:
        return None
    if code.co_argcount < 1 or code.co_kwonlyargcount:
        return None
    names: list[str] = []
    previous = None
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op == "CACHE":
            continue
        if op not in _ALLOWED:
            return None
        if op in _ATTRIBUTE_LOADS:
            # Only ``self.<name>``: the instruction before loads local 0 (``self``).
            if previous is None or previous.opname != "LOAD_FAST" or previous.arg != 0:
                return None
            names.append(ins.argval)
        elif previous is not None and previous.opname == "LOAD_FAST" and previous.arg == 0:
            return None  # ``self`` used otherwise than for a child: passed, returned...
        if op == "STORE_FAST" and ins.arg == 0:
            return None
        if op in ("LOAD_CONST", "RETURN_CONST") and type(ins.argval) not in _CONSTANTS:
            return None
        previous = ins
    if previous is not None and previous.opname == "LOAD_FAST" and previous.arg == 0:
        return None
    return tuple(dict.fromkeys(names))


def _class_plain(cls: type, names: tuple[str, ...]) -> bool:
    """Whether no class in ``cls``'s MRO below ``nn.Module`` defines one of ``names``."""
    for klass in cls.__mro__:
        if klass is torch.nn.Module:
            return True
        if any(name in klass.__dict__ for name in names):
            return False
    return False


class Recording:
    """The calls a traced member made: per step, the child's name and where each argument
    came from (``("in", j)`` the member's argument j, ``("step", k)`` step k's value,
    ``("const", v)``); and where its output came from (one such reference, or a tuple
    of them)."""

    __slots__ = ("steps", "output")

    def __init__(self, steps: list[tuple[str, tuple]], output: Any):
        self.steps = steps
        self.output = output


class MemberReplay:
    """One trace's recordings and replays (module docstring). ``tracer`` is the
    ``_LeafTracer`` (its leaf decisions, paths, rank tracker and fx state)."""

    def __init__(self, tracer: Any):
        self.tracer = tracer
        # (forward code, member class, the children's classes, argument count) -> the
        # recording, or None where the first member's trace was not replayable.
        self.recordings: dict[tuple, Optional[Recording]] = {}
        self.replayed = 0

    def run(self, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        """``m``'s forward in the trace, where fx would call ``forward`` (its call of
        it): a replay, a recorded run, or ``forward`` itself."""
        key = self._key(m, args, kwargs)
        if key is None:
            return forward(*args, **kwargs)
        recording = self.recordings.get(key, False)
        if recording is False:
            return self._record(key, m, forward, args, kwargs)
        if recording is None:
            return forward(*args, **kwargs)
        return self.replay(m, recording, args)

    def _key(self, m: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        """The kind of ``m``'s call (what a recording is kept by), where its trace may be
        recorded or replayed (module docstring); ``None`` where it must run."""
        tracer = self.tracer
        if not ENABLED or kwargs or tracer.known_outputs:
            return None
        cls = type(m)
        fn = getattr(cls, "forward", None)
        own = m.__dict__
        if type(fn) is not types.FunctionType or "forward" in own or "_call_impl" in own:
            return None
        code = fn.__code__
        names = code_plan(code)
        if names is None or code.co_argcount != len(args) + 1:
            return None
        proxy_type = tracer.proxy_type
        for a in args:
            if type(a) is not proxy_type:
                return None
        # What _call_impl would run besides the forward: hooks, a compiled call, a JIT
        # trace's scopes.
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return None
        if own.get("_compiled_call_impl") is not None or torch._C._get_tracing_state() is not None:
            return None
        if not _class_plain(cls, _MEMBER_OVERRIDES) or any(hasattr(cls, name) for name in names):
            return None
        if global_hooks() or capture_collecting():
            return None
        if threading.get_ident() != tracer.thread or tracer._thread_state() != tracer.thread_state:
            return None
        if not fast_context(tracer):
            return None
        children = m._modules
        kinds = []
        for name in names:
            child = children.get(name)
            if child is None or name in own:
                return None
            kind = type(child)
            if (
                "forward" in child.__dict__
                or child._forward_hooks
                or child._forward_pre_hooks
                or not _class_plain(kind, _CHILD_OVERRIDES)
                or not tracer.is_leaf_module(child, "")
            ):
                return None
            kinds.append(kind)
        return (code, cls, tuple(kinds), len(args))

    def _record(self, key: tuple, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        graph = self.tracer.graph
        before = graph._root.prev
        out = forward(*args, **kwargs)
        self.recordings[key] = self._recording(m, graph, before, args, out)
        return out

    def _recording(self, m: torch.nn.Module, graph: fx.Graph, before: fx.Node, args: tuple, out: Any):
        """The recording of the nodes made after ``before``, or None where they are not
        the child calls code_plan promises."""
        tracer = self.tracer
        names = code_plan(type(m).forward.__code__)
        assert names is not None
        paths: dict[str, str] = {}
        for name in names:
            path = tracer.path_of_module(m._modules[name])
            if path in paths:
                return None  # one child under two names: which one a call read is unknown
            paths[path] = name
        refs: dict[fx.Node, tuple] = {a.node: ("in", j) for j, a in enumerate(args)}
        if len(refs) != len(args):
            return None
        steps: list[tuple[str, tuple]] = []
        node = before.next
        while node is not graph._root:
            name = paths.get(node.target) if node.op == "call_module" else None
            if name is None or node.kwargs or node.type is not None:
                return None
            sources = []
            for a in node.args:
                if type(a) is fx.Node:
                    ref = refs.get(a)
                    if ref is None:
                        return None
                    sources.append(ref)
                elif type(a) in _CONSTANTS:
                    sources.append(("const", a))
                else:
                    return None
            refs[node] = ("step", len(steps))
            steps.append((name, tuple(sources)))
            node = node.next
        output = self._reference(out, refs)
        if output is None:
            return None
        return Recording(steps, output)

    def _reference(self, out: Any, refs: dict) -> Optional[tuple]:
        if type(out) is self.tracer.proxy_type:
            return refs.get(out.node)
        if type(out) is tuple:
            items = [self._reference(v, refs) for v in out]
            if any(v is None for v in items):
                return None
            return ("tuple", tuple(items))
        return None

    def replay(self, m: torch.nn.Module, recording: Recording, args: tuple) -> Any:
        """``m``'s trace made from ``recording``: each child call made as
        ``FastTracerMixin.call_module`` and ``_LeafTracer.create_proxy`` /
        ``call_module`` make a leaf call whose known output is the proxy."""
        tracer = self.tracer
        graph: fx.Graph = tracer.graph
        scope = tracer.scope
        stack = tracer.module_stack
        num_calls = tracer.num_calls
        name_to_scope = tracer.node_name_to_scope
        leaf_calls = tracer.leaf_calls
        note = tracer.ranks.note
        root = tracer.root
        make_proxy = tracer.proxy
        proxy_type = tracer.proxy_type  # a property: read once, not per argument
        children = m._modules
        values: list[Any] = []
        for name, sources in recording.steps:
            child = children[name]
            path = tracer.path_of_module(child)
            kind = type(child)
            call_args = tuple(args[i] if where == "in" else values[i] if where == "step" else i for where, i in sources)
            saved = scope.module_path, scope.module_type
            scope.module_path, scope.module_type = path, kind
            try:
                count = num_calls.get(path, 0)
                module_key = f"{path}@{count}" if count > 0 else path
                stack[module_key] = (path, kind)
                num_calls[path] = count + 1
                node = graph.create_node("call_module", path, None, None, None, None)
                if call_args:
                    set_arguments(node, tuple([a.node if type(a) is proxy_type else a for a in call_args]), {})
                name_to_scope[node.name] = (path, kind)
                node.meta["nn_module_stack"] = stack.copy() if type(stack) is OrderedDict else copy.copy(stack)
                proxy = make_proxy(node)
                # The module at ``path`` is ``child`` (fx's path of it): not looked up again.
                note(node, "call_module", path, call_args, {}, root, child)
                key, _ = stack.popitem(last=True)
                if key != module_key:  # pragma: no cover - as fx's own check
                    raise AssertionError(f"Unexpected key {key}, expected {module_key}")
            finally:
                scope.module_path, scope.module_type = saved
            leaf_calls[path] = leaf_calls.get(path, 0) + 1
            values.append(proxy)
        self.replayed += 1
        return self._rebuild(recording.output, args, values)

    def _rebuild(self, ref: tuple, args: tuple, values: list) -> Any:
        if ref[0] == "in":
            return args[ref[1]]
        if ref[0] == "step":
            return values[ref[1]]
        return tuple(self._rebuild(r, args, values) for r in ref[1])
