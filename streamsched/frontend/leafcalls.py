"""Leaf-module calls: what a plan's coverage counts, and how the calls are counted.

A *leaf-module call* is a call, through ``nn.Module.__call__``, of a module with no
child modules (``nn.Linear``, ``nn.ReLU``, a user module holding only parameters) or of
a module whose class is in ``leaf_modules`` (or registered as untraceable by a loaded
library, as timm's notrace modules are), or of a subclass of a ``torch.nn`` leaf module
defined elsewhere (timm's ``BatchNormAct2d``), which the trace keeps whole as its base;
the calls such a module makes inside are not counted on their own. A module call that
reaches no such module (``nn.MultiheadAttention`` uses its ``out_proj``'s weights
without calling it) counts as one leaf call itself.

Coverage (``Plan.coverage``) is the share of a forward's leaf calls that run as tasks of
the plan. They are counted where they happen, once per plan:

- calls the trace went through (a childless module whose forward was traced into the
  graph's operations) are counted while tracing (``Traced.inlined_leaf_calls``);
- calls that are nodes of the graph, or are made *inside* a node (an opaque module's
  body, a ``@streamsched.branch``'s), are counted by the recording call, which runs
  every node once: a forward pre-hook sits on every leaf module of the model for the
  length of that call only (:class:`LeafCallCounter`), and each firing is charged to the
  node that was running (``node_meta.leaf_calls``);
- under eager dispatch, the first call of each call structure is counted the same way,
  each firing charged to a branch body or to the forward around it.

Nothing is installed on the calls that run a cached plan.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional

import torch
from torch import fx
from torch.utils.hooks import RemovableHandle

from ..branch import is_branch_module
from . import node_meta
from .hooks import COUNTING_HOOK, global_hooks
from .nodes import children_of, has_children, submodule
from .opaque_functions import OpaqueFunction
from .trace import Traced, _extends_torch_leaf, _registered_leaf_types, is_compiled_module

__all__ = [
    "LEAF_CALLS_META",
    "LeafCallCounter",
    "branch_scope",
    "counting_dispatch",
    "in_branch",
    "is_leaf_unit",
    "leaf_module_types",
    "leaf_units",
    "opaque_leaf_calls",
    "recording_counter",
    "store_counts",
    "traced_coverage",
]

# node.meta key: leaf calls the recording call counted while the node ran.
LEAF_CALLS_META = node_meta.LEAF_CALLS


def leaf_module_types(leaf_types: Iterable[Any]) -> tuple[type, ...]:
    """The module classes among ``leaf_types`` (``config.leaf_modules`` also holds
    functions), with the classes a loaded library registers as untraceable."""
    return tuple(t for t in leaf_types if isinstance(t, type)) + _registered_leaf_types()


def is_leaf_unit(module: torch.nn.Module, types: tuple[type, ...]) -> bool:
    """Whether a call of ``module`` is a leaf call: it has no child module, its class is
    a leaf class, or it subclasses a ``torch.nn`` leaf (timm's ``BatchNormAct2d``, a
    ``BatchNorm2d`` holding its activation): the trace keeps such a call whole, as its
    base, and the children it calls inside are part of it."""
    return (bool(types) and isinstance(module, types)) or not has_children(module) or _extends_torch_leaf(type(module))


def _opaque_to_hooks(module: torch.nn.Module) -> bool:
    """Modules a hook must not be put in: TorchScript modules (their hook tables are
    fixed when scripted) and ``torch.compile``'d ones (dynamo guards on hooks: adding one
    would recompile the user's module). Such a call counts as one leaf call."""
    return isinstance(module, torch.jit.ScriptModule) or is_compiled_module(module)


def leaf_units(model: torch.nn.Module, types: tuple[type, ...]) -> list[torch.nn.Module]:
    """The model's leaf modules (its own submodules, not the model), each once: the
    modules whose calls are counted. The walk stops at a leaf module (the calls inside
    it are part of its call) and at modules a hook cannot go in."""
    found: dict[int, torch.nn.Module] = {}
    stack = [c for c in model.children()]
    seen: set[int] = {id(model)}
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if _opaque_to_hooks(module):
            continue
        if is_leaf_unit(module, types):
            found[id(module)] = module
        else:
            stack.extend(children_of(module))
    return list(found.values())


class LeafCallCounter:
    """A forward pre-hook on each of ``modules`` while the counter is entered: every call
    of one appends ``tag(module)`` to :attr:`hits` (a ``None`` tag is not counted).

    The hooks go straight into the modules' hook tables (as ``register_forward_pre_hook``
    does, minus the wrapper's registration counting: they come and go within one call of
    the wrapper and change nothing a plan depends on). :meth:`paused` lifts them for a
    while (a re-trace must not see hooked modules).
    """

    def __init__(self, modules: list[torch.nn.Module], tag: Callable[[torch.nn.Module], Optional[Hashable]]):
        self.modules = modules
        self.tag = tag
        self.hits: list[Hashable] = []
        # What the caller is running, for a tag to read (the recording call: a node name).
        self.where: Optional[Hashable] = None
        # One key, unique among hook ids (the counter PyTorch's own handles draw from),
        # for the hook in every table.
        self._key = RemovableHandle(OrderedDict()).id
        self._installed: list[torch.nn.Module] = []

    def _install(self) -> None:
        hits, tag_of = self.hits, self.tag

        def hook(module: torch.nn.Module, args: Any) -> None:
            tag = tag_of(module)
            if tag is not None:
                hits.append(tag)  # list.append: safe from the lanes' threads too

        # has_hooks() overlooks it: a trace or a plan made during the counted call (a
        # nested wrapper's first call) sees the modules as they are.
        setattr(hook, COUNTING_HOOK, True)
        key = self._key
        for module in self.modules:
            module._forward_pre_hooks[key] = hook
        self._installed = self.modules

    def _remove(self) -> None:
        key = self._key
        for module in self._installed:
            module._forward_pre_hooks.pop(key, None)
        self._installed = []

    def call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """``module(*args, **kwargs)`` while the counter is entered. Where the counting
        hook is the only hook in play, the hook's work is done here and ``forward`` called
        as ``nn.Module.__call__`` would call it without hooks (its hook path, taken
        because of the counting hook alone, cost more than most leaf calls themselves);
        any other call goes through ``__call__``."""
        pre = module._forward_pre_hooks
        if (
            len(pre) == 1
            and self._key in pre
            and _plain_call(type(module))
            and getattr(module, "_compiled_call_impl", None) is None
            and not (module._forward_hooks or module._backward_hooks or getattr(module, "_backward_pre_hooks", None))
            and not global_hooks()
            and torch._C._get_tracing_state() is None
        ):
            tag = self.tag(module)
            if tag is not None:
                self.hits.append(tag)
            return module.forward(*args, **kwargs)
        return module(*args, **kwargs)

    def __enter__(self) -> LeafCallCounter:
        self._install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._remove()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._remove()
        try:
            yield
        finally:
            self._install()


_PLAIN_CALLS: dict[type, bool] = {}


def _plain_call(kind: type) -> bool:
    """Whether calling a ``kind`` instance is ``nn.Module``'s own ``__call__`` (no class
    of the way overrides it or the implementation it calls)."""
    plain = _PLAIN_CALLS.get(kind)
    if plain is None:
        module = torch.nn.Module
        plain = _PLAIN_CALLS[kind] = (
            kind.__call__ is module.__call__
            and getattr(kind, "_wrapped_call_impl", None) is getattr(module, "_wrapped_call_impl", None)
            and kind._call_impl is module._call_impl
        )
    return plain


def traced_coverage(traced: Traced) -> tuple[int, int]:
    """``(scheduled, total)`` leaf calls of the most recent recording call of ``traced``.

    A leaf call is scheduled when it is a task of the plan itself (fusion makes members
    of a group out of such tasks), or runs inside a task the user declared one (a
    ``@streamsched.branch`` module or function, a ``leaf_modules`` function, a
    ``torch.compile``'d module). It is not when it runs inside another module call that
    runs as one task: a class that could not be traced (``Plan.opaque``), a module with
    hooks, a ``torch.nn`` container such as ``nn.TransformerEncoderLayer``.
    """
    types = leaf_module_types(traced.leaf_types)
    scheduled = total = traced.inlined_leaf_calls
    for node in traced.graph.nodes:
        inside = node_meta.leaf_calls(node)
        if node.op == "call_module":
            module = submodule(traced.root, node.target)
            calls = max(inside, 1)
            total += calls
            # A leaf module's own call fires its hook once; a call that reaches no leaf
            # module is a leaf call itself.
            if inside == 0 or is_leaf_unit(module, types) or is_branch_module(module) or is_compiled_module(module):
                scheduled += calls
        elif inside:
            total += inside
            # An opaque function (one the trace could not go through) runs its module
            # calls as written; a branch or leaf_modules function was declared a task.
            if not isinstance(node.target, OpaqueFunction):
                scheduled += inside
    return scheduled, total


def opaque_leaf_calls(traced: Traced) -> dict[str, int]:
    """The leaf calls made inside each opaque module call of the most recent recording
    call of ``traced``, by module path (the calls a nested plan of it may schedule)."""
    opaque = traced.opaque_paths()
    out: dict[str, int] = {}
    for node in traced.graph.nodes:
        if node.op == "call_module" and str(node.target) in opaque:
            path = str(node.target)
            out[path] = out.get(path, 0) + node_meta.leaf_calls(node)
    return out


def recording_counter(traced: Traced) -> LeafCallCounter:
    """The counter for a recording call of ``traced``: each leaf call made on the
    recording thread is charged to the node running (the caller sets ``where`` to its
    name)."""
    thread = threading.get_ident()

    def tag(module: torch.nn.Module) -> Optional[Hashable]:
        if threading.get_ident() != thread:
            return None  # another thread calling the same modules meanwhile
        return counter.where

    counter = LeafCallCounter(leaf_units(traced.model, leaf_module_types(traced.leaf_types)), tag)
    return counter


def store_counts(counter: LeafCallCounter, nodes: list[fx.Node]) -> None:
    """Write each node's count (hits are tagged by node name) into its ``meta``."""
    counts: dict[Hashable, int] = {}
    for name in counter.hits:
        counts[name] = counts.get(name, 0) + 1
    for node in nodes:
        node_meta.set_leaf_calls(node, counts.get(node.name, 0))


# --- eager dispatch --------------------------------------------------------------------

_branch_depth = threading.local()
# How many eager-dispatch counters are entered: branch bodies mark themselves only then.
_counting = 0
_counting_lock = threading.Lock()


def in_branch() -> bool:
    """Whether this thread is running a branch body (while an eager-dispatch count runs)."""
    return getattr(_branch_depth, "depth", 0) > 0


@contextlib.contextmanager
def _marked() -> Iterator[None]:
    _branch_depth.depth = getattr(_branch_depth, "depth", 0) + 1
    try:
        yield
    finally:
        _branch_depth.depth -= 1


def branch_scope() -> Any:
    """What a branch body runs in: marks the thread while an eager-dispatch call is
    counted, nothing otherwise (the common case pays one global read)."""
    return _marked() if _counting else contextlib.nullcontext()


@contextlib.contextmanager
def counting_dispatch(
    model: torch.nn.Module, leaf_types: Iterable[Any], nested_site: Optional[Callable[[], Optional[str]]] = None
) -> Iterator[LeafCallCounter]:
    """Count the leaf calls of one eager-dispatch call of ``model``: hits are ``True``
    inside a branch body, the module path of the nested child being called where
    ``nested_site()`` names one (its calls may be scheduled by the child's own plan),
    ``False`` in the forward around them (a module class decorated with
    ``@streamsched.branch`` is a task of traced plans only: eager dispatch launches
    branch functions and methods, and runs such a module inline, unseen)."""
    global _counting

    def tag(module: torch.nn.Module) -> Hashable:
        return in_branch() or (nested_site() if nested_site is not None else None) or False

    counter = LeafCallCounter(leaf_units(model, leaf_module_types(leaf_types)), tag)
    with _counting_lock:
        _counting += 1
    try:
        with counter:
            yield counter
    finally:
        with _counting_lock:
            _counting -= 1
