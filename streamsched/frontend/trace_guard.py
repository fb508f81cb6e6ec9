"""Keep a trace free of side effects on the model.

fx runs a forward's Python once, with proxies for the graph's values. Anything in that
forward which acts on *real* state instead (a tensor attribute updated in place, a
module attribute assigned, ``self.calls += 1``) would happen once, while tracing, and
never again: the wrapper would silently differ from eager. While a trace runs, this
guard refuses such an act before it happens, by raising in the forward that does it;
the tracer then makes that module opaque (its calls run as written, every call).

Tensors a forward builds are made on every call, as in eager. A tensor factory called
with plain arguments (``torch.zeros(4, 4)``, ``torch.randn(d)``, ``torch.tensor([1.0])``)
would otherwise run once, while tracing, and its result become a graph constant that
every call shares: random values drawn once, writes into it accumulating from call to
call, the same output object returned each time. :class:`GradModeGuard` records such a
call as a node instead. Any other tensor made while tracing that the graph keeps as a
constant (``torch.from_numpy``, a method of a constant) is copied on every call
(:func:`copy_fresh_constants`), and drawing random numbers outside the graph is refused.
Tensors made during the trace may be written freely: they are not the model's state.

Grad mode and autocast are thread state that fx does not record either: a forward's
``with torch.no_grad():`` (or ``enable_grad``, ``set_grad_enabled``, a ``@torch.no_grad()``
method) would switch grad mode once, while tracing, and the traced ops would then run in
the caller's mode every call (gradients where eager has none). :class:`GradModeGuard`
refuses any grad-mode switch while a trace runs; :func:`autocast_state` and
``torch.is_inference_mode_enabled`` are compared at every recorded op by the tracer
(``frontend.trace``), which refuses a forward that entered autocast or inference mode.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pickle
import random
import sys
import threading
import types
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _generation
from .binder import is_plain
from .checkpointing import CHECKPOINT_REFUSAL
from .effects import fresh_outputs, op_accesses, storage_key
from .trace_patches import PatchWhileTracing

__all__ = [
    "TraceSideEffectGuard",
    "SideEffectDuringTrace",
    "ContainerWrittenDuringTrace",
    "snapshot_containers",
    "restore_containers",
    "GradModeGuard",
    "autocast_state",
    "copy_fresh_constants",
    "FACTORIES",
    "HeldState",
    "ObjectWrittenDuringTrace",
    "holds_state",
    "object_items",
    "reachable_objects",
]

# Torch functions that make a new tensor from plain arguments: called with no graph value
# among them while tracing, each becomes a node (:class:`GradModeGuard`).
FACTORIES = frozenset(
    getattr(torch, name)
    for name in (
        "zeros",
        "ones",
        "empty",
        "empty_strided",
        "full",
        "arange",
        "range",
        "rand",
        "randn",
        "randint",
        "randperm",
        "normal",
        "eye",
        "linspace",
        "logspace",
        "tensor",
        "as_tensor",
        "scalar_tensor",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "bernoulli",
        "multinomial",
        "poisson",
    )
    if hasattr(torch, name)
)

_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


class SideEffectDuringTrace(RuntimeError):
    """A traced forward tried to change real state; raised where it tried."""


class TraceSideEffectGuard(TorchDispatchMode):
    """Active while one thread traces ``model``: refuses in-place writes to tensors that
    existed before the trace, and assignments to attributes of the model's modules."""

    def __init__(
        self,
        model: torch.nn.Module,
        trace_root: torch.nn.Module,
        modules: Optional[Sequence[torch.nn.Module]] = None,
        held: Optional[Sequence[Any]] = None,
    ):
        super().__init__()
        # ``modules``: ``list(model.modules())``, and ``held``: ``reachable_objects`` of
        # them, where the caller has them.
        modules = list(model.modules()) if modules is None else modules
        self.fresh: set[int] = set()
        self.modules = {id(m) for m in modules}
        # Objects the modules hold (a config, a tally): assigning their attributes is a
        # side effect too (their classes' __setattr__ reports to _on_setattr once watched).
        held = reachable_objects(modules) if held is None else held
        self.objects = {id(o) for o in held if _generation.watch_object(o)}
        self.trace_root = trace_root
        self.thread = threading.get_ident()
        # Tensors that existed before the trace (attributes, globals, items of held lists:
        # not graph values) that an op read to make a new tensor: the trace baked what it
        # made in as a constant (``self.table.sum()``), which holds only while they keep
        # their values. By id.
        self.baked: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        reads: list[torch.Tensor] = []
        if threading.get_ident() == self.thread:
            if _SEEDED is not None and _SEEDED in getattr(func, "tags", ()):
                raise SideEffectDuringTrace(
                    f"{func._schema.name} draws random numbers from real tensors while tracing (not graph values): "
                    "they would be drawn once and every call would reuse them"
                )
            reads, writes = op_accesses(func, args, kwargs)
            for t in writes:
                key = storage_key(t)
                if key is not None and key not in self.fresh:
                    raise SideEffectDuringTrace(
                        f"{func._schema.name} would write a real tensor of shape {tuple(t.shape)} in place while "
                        "tracing (a tensor attribute or global, not a graph value): the write would happen once, "
                        "not on every call"
                    )
        out = func(*args, **kwargs)
        if threading.get_ident() == self.thread:
            made = fresh_outputs(func, out)
            if made:
                for t in reads:
                    key = storage_key(t)
                    if key is not None and key not in self.fresh and t.device.type != "meta":
                        self.baked[id(t)] = t
            for t in made:
                key = storage_key(t)
                if key is not None:
                    self.fresh.add(key)
        return out

    def _on_setattr(self, module: Any, name: str) -> None:
        if id(module) in self.objects:
            raise SideEffectDuringTrace(
                f"the forward assigns {type(module).__name__}.{name}, an attribute of an object a module holds, while "
                "running: a Python side effect a trace would perform only once (and on graph values)"
            )
        if module is self.trace_root or id(module) not in self.modules:
            return
        if name.endswith("()"):
            what = f"the forward registers a hook on a {type(module).__name__} ({name})"
        else:
            what = f"{type(module).__name__}.forward assigns self.{name}"
        raise SideEffectDuringTrace(f"{what} while running: a Python side effect a trace would perform only once")

    def __enter__(self) -> TraceSideEffectGuard:
        _generation._on_setattr[self.thread] = self._on_setattr
        try:
            return super().__enter__()
        except BaseException:
            _generation._on_setattr.pop(self.thread, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        _generation._on_setattr.pop(self.thread, None)
        return super().__exit__(*exc)


class GradModeGuard(TorchFunctionMode):
    """Active on the tracing thread while a trace runs (mode stacks are per thread):
    refuses ``torch._C._set_grad_enabled``, which ``no_grad``, ``enable_grad`` and
    ``set_grad_enabled`` all call, before the switch happens; and, given the ``tracer``,
    records a call of a tensor factory (:data:`FACTORIES`) with no graph value among its
    arguments as a node, so that the tensor is made on every call."""

    def __init__(self, tracer: Any = None):
        super().__init__()
        self.tracer = tracer

    def __enter__(self) -> GradModeGuard:
        _RANDOM_REFUSAL.begin()
        CHECKPOINT_REFUSAL.begin()
        try:
            return super().__enter__()
        except BaseException:
            CHECKPOINT_REFUSAL.end()
            _RANDOM_REFUSAL.end()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            CHECKPOINT_REFUSAL.end()
            _RANDOM_REFUSAL.end()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is torch._C._set_grad_enabled:
            raise SideEffectDuringTrace(
                "switches grad mode (torch.no_grad / enable_grad / set_grad_enabled) while running: a trace "
                "cannot record that, and the traced ops would run in the caller's grad mode"
            )
        kwargs = kwargs or {}
        if self.tracer is not None and func in FACTORIES and not _has_proxy(args, kwargs):
            try:
                return self.tracer.create_proxy("call_function", func, args, kwargs)
            except NotImplementedError:
                # An argument a node cannot hold (``torch.tensor(numpy_array)``): made
                # now, a constant that every call gets a copy of (copy_fresh_constants).
                pass
        return func(*args, **kwargs)


# Python's own random numbers (``random.random()``, ``random.uniform(0, 1)``: LayerDrop in
# some models) drawn while tracing would be drawn once and baked into the trace as
# plain values: refused on the tracing threads, the module that draws them runs as
# written. The module's functions are patched while any trace runs.
_RANDOM_FUNCTIONS = (
    "random",
    "uniform",
    "randint",
    "randrange",
    "choice",
    "choices",
    "sample",
    "shuffle",
    "gauss",
    "normalvariate",
    "getrandbits",
    "betavariate",
    "expovariate",
)
# Setting a generator's state while tracing would happen once, not on every call: a
# forward that reseeds (``torch.manual_seed(0)`` before drawing a fixed noise pattern)
# would draw on from wherever the generator was. Refused the same way.
_SEEDING = (
    ("torch", "manual_seed"),
    ("torch", "seed"),
    ("torch", "set_rng_state"),
    ("torch.random", "manual_seed"),
    ("torch.random", "seed"),
    ("torch.random", "set_rng_state"),
    ("torch.cuda", "manual_seed"),
    ("torch.cuda", "manual_seed_all"),
    ("torch.cuda", "set_rng_state"),
    ("torch.cuda", "set_rng_state_all"),
    ("random", "seed"),
    ("random", "setstate"),
)


def _refusing(name: str, fn: Any, seeds: bool = False) -> Any:
    def draw(*args: Any, **kwargs: Any) -> Any:
        if _RANDOM_REFUSAL.tracing():
            if seeds:
                raise SideEffectDuringTrace(
                    f"{name}() sets a random number generator's state while tracing: it would be set once, not on "
                    "every call"
                )
            raise SideEffectDuringTrace(
                f"random.{name}() draws a Python random number while tracing: it would be drawn once and every "
                "call would reuse it"
            )
        return fn(*args, **kwargs)

    draw.__wrapped__ = fn  # type: ignore[attr-defined]
    return draw


def _install_random_refusals() -> dict[tuple[Any, str], Any]:
    originals: dict[tuple[Any, str], Any] = {}
    for name in _RANDOM_FUNCTIONS:
        fn = getattr(random, name, None)
        if fn is not None:
            originals[(random, name)] = fn
            setattr(random, name, _refusing(name, fn))
    for module_name, name in _SEEDING:
        namespace = sys.modules.get(module_name)
        fn = getattr(namespace, name, None)
        if fn is not None:
            originals[(namespace, name)] = fn
            setattr(namespace, name, _refusing(f"{module_name}.{name}", fn, seeds=True))
    apply = torch.autograd.Function.__dict__.get("apply")  # a classmethod (in C in newer torch)
    if apply is not None and hasattr(apply, "__get__"):
        originals[(torch.autograd.Function, "apply")] = apply
        torch.autograd.Function.apply = classmethod(_refusing_apply(apply))  # type: ignore[method-assign]
    return originals


def _refusing_apply(apply: Any) -> Any:
    """``torch.autograd.Function.apply``, refusing graph values on a tracing thread: fx
    would run the Function's ``forward`` on proxies and record its ops, and the plan
    would differentiate those ops instead of calling its ``backward`` (a straight-through
    estimator, a gradient reversal, YOSO's approximate attention gradient: silently
    other gradients). The module calling it runs as written, its ``backward`` in place."""

    def refusing(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if _RANDOM_REFUSAL.tracing() and _has_proxy(args, kwargs):
            raise SideEffectDuringTrace(
                f"{cls.__qualname__}.apply (a torch.autograd.Function) is called on traced values: a trace would "
                "record its forward's ops and differentiate them instead of calling its backward"
            )
        return apply.__get__(None, cls)(*args, **kwargs)

    refusing.__wrapped__ = apply  # type: ignore[attr-defined]
    return refusing


_RANDOM_REFUSAL = PatchWhileTracing(_install_random_refusals)


def _has_proxy(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves((args, kwargs)))


def copy_fresh_constants(graph: fx.Graph, root: torch.nn.Module, fresh: set[int]) -> None:
    """Give every call its own copy of each tensor constant of ``graph`` that was made
    while tracing (its storage in ``fresh``): the graph would otherwise hand one tensor
    to every call, in which its writes accumulate and which it may return. Constants
    the model holds (globals, attributes) stay shared, as in eager."""
    copies: dict[str, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(root, node.target, None) if "." not in node.target else None
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        if storage_key(value) not in fresh:
            continue
        copy = copies.get(node.target)
        if copy is None:
            with graph.inserting_after(node):
                copy = graph.call_function(torch.clone, (node,))
            copies[node.target] = copy
        node.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_state() -> tuple:
    """The autocast devices and dtypes in force on this thread (``()`` when none)."""
    if _any_autocast is not None and not _any_autocast():
        return ()
    state = []
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            state.append((device, torch.get_autocast_dtype(device)))
    return tuple(state)


# --- containers a module holds -----------------------------------------------------------


# nn.Module's own attributes (parameter, buffer, child and hook tables): not the model's.
_MODULE_TABLES = frozenset(torch.nn.Module().__dict__)


class ContainerWrittenDuringTrace(SideEffectDuringTrace):
    """A traced forward stored into a dict, list or set its module holds (a cache)."""


def snapshot_containers(
    model: torch.nn.Module, modules: Optional[Sequence[torch.nn.Module]] = None
) -> list[tuple[torch.nn.Module, str, Any, Any]]:
    """``(module, name, container, copy)`` for each dict, list or set a module of
    ``model`` holds as a plain attribute (not its tables): what a trace must leave as it
    found it (:func:`restore_containers`). ``modules``: ``list(model.modules())`` where
    the caller has it."""
    found = []
    for m in model.modules() if modules is None else modules:
        for name, value in m.__dict__.items():
            if name in _MODULE_TABLES:
                continue
            if _is_plain_container(value):
                found.append((m, name, value, _container_copy(value)))
    return found


def _is_plain_container(value: Any) -> bool:
    """Whether ``value`` is a list, dict or set, or an instance of a subclass of one whose
    items are all it holds (an ``OrderedDict``, a ``defaultdict``, a ``Counter``; not a
    dataclass such as a ``ModelOutput``): compared, copied and refilled by its items. A
    ``defaultdict`` read with a key it lacks inserts one, so a trace that looks up a
    traced value (``self.outputs[x.device]``) writes it."""
    kind = type(value)
    if kind is dict or kind is list or kind is set:
        return True
    return isinstance(value, (dict, list, set)) and not dataclasses.is_dataclass(value)


def _same(container: Any, copy: Any) -> bool:
    if len(container) != len(copy):
        return False
    if isinstance(container, dict):
        # (dict.__contains__ and dict.__getitem__: a defaultdict's lookup would insert.)
        return all(dict.__contains__(copy, k) and dict.__getitem__(copy, k) is v for k, v in container.items())
    if isinstance(container, list):
        return all(a is b for a, b in zip(container, copy))
    return container == copy


def restore_containers(snapshots: list[tuple[torch.nn.Module, str, Any, Any]]) -> list[tuple[torch.nn.Module, str]]:
    """Put back the contents of every snapshotted container a trace changed (a forward
    that caches a value in a dict it holds stored a proxy there: LeViT's attention
    biases, cached per device in eval), and return ``(module, name)`` of each. The next
    trace would otherwise read the proxy of another graph, and the model, called as
    written, a proxy instead of a tensor."""
    changed = []
    for module, name, container, copy in snapshots:
        if _same(container, copy):
            continue
        _refill(container, copy)
        changed.append((module, name))
    return changed


def _refill(container: Any, copy: Any) -> None:
    """Give a list, dict or set the contents ``copy`` holds (a copy made before a trace)."""
    container.clear()
    if isinstance(container, list):
        container.extend(copy)
    else:
        container.update(copy)


class ObjectWrittenDuringTrace(SideEffectDuringTrace):
    """A traced forward assigned an attribute of an object a module holds, or stored into
    a container such an object holds, where no ``__setattr__`` of its class could report
    it (a ``types.SimpleNamespace``, an object with ``__slots__``, one held by another)."""


# How deep :class:`HeldState` follows objects held by objects (``self.cfg.sub.scale``).
HELD_DEPTH = 3


def _library_object(value: Any) -> bool:
    """Whether ``value`` is an instance of a class of torch, streamsched or the standard
    library (a logger, a lock), but for the namespaces models keep options in."""
    kind = type(value)
    if kind in _NAMESPACES:
        return False
    top = kind.__module__.partition(".")[0]
    return top in ("torch", "streamsched", "builtins") or top in sys.stdlib_module_names


_NAMESPACES = (types.SimpleNamespace, argparse.Namespace)


def object_items(obj: Any) -> dict[str, Any]:
    """The attributes of ``obj`` (not a module): its instance dict's, and those its
    classes' ``__slots__`` name that are set."""
    items = dict(obj.__dict__) if isinstance(getattr(obj, "__dict__", None), dict) else {}
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__") or name in items:
                continue
            try:
                items[name] = getattr(obj, name)
            except AttributeError:  # a slot never assigned
                pass
    return items


# Plain values that hold no state (``is_plain``), the attributes modules hold most (flags,
# sizes): asked of every attribute of every module before a trace, answered first.
_ATOMS = frozenset({type(None), bool, int, float, str})


def holds_state(value: Any) -> bool:
    """Whether ``value``, held by a module or by an object a module holds, is an object
    whose attributes traced code may read or write: an instance (with an instance dict or
    ``__slots__``) of a class defined outside Python's built-ins and torch, that is no
    module, tensor, callable or plain value."""
    if is_plain(value) or callable(value) or isinstance(value, (torch.nn.Module, torch.Tensor)):
        return False
    if type(value) in (list, dict, set, tuple, frozenset) or _library_object(value):
        return False
    return isinstance(getattr(value, "__dict__", None), dict) or any(
        "__slots__" in cls.__dict__ for cls in type(value).__mro__[:-1]
    )


def reachable_objects(
    modules: Sequence[torch.nn.Module],
    depth: int = HELD_DEPTH,
    roots: Sequence[Any] = (),
    note: Optional[Callable[[Any], None]] = None,
) -> list[Any]:
    """The objects ``modules`` hold as attributes (:func:`holds_state`), and those such
    objects hold, ``depth`` levels down, each once; ``roots`` (objects held otherwise: a
    module-level namespace traced code reads) are followed as held ones. ``note``: called
    with every attribute value of the modules that is no plain atom and not in a module
    table, in module and attribute order (:class:`HeldState` notes hidden state so)."""
    seen: dict[int, Any] = {id(v): v for v in roots}
    level = list(seen.values())
    atoms = _ATOMS
    for m in modules:
        for k, v in m.__dict__.items():
            if type(v) in atoms or k in _MODULE_TABLES:
                continue
            if note is not None:
                note(v)
            if k.startswith("_streamsched") or id(v) in seen or not holds_state(v):
                continue
            seen[id(v)] = v
            level.append(v)
    for _ in range(depth - 1):
        below = []
        for obj in level:
            for v in object_items(obj).values():
                if id(v) not in seen and holds_state(v):
                    seen[id(v)] = v
                    below.append(v)
        level = below
    return list(seen.values())


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return type(a) is type(b) and type(a) in (bool, int, float, str) and a == b


class HeldState:
    """What every object a model's modules hold (:func:`reachable_objects`) holds before a
    trace: its attributes, and the contents of the lists, dicts and sets among them. A
    traced forward must leave them as they were (:meth:`changed`, checked as each traced
    forward returns, names the first change, inside the innermost forward that made it);
    :meth:`restore` puts back whatever a trace changed, so that a call run as written
    afterwards starts from the state eager would."""

    def __init__(self, model: torch.nn.Module, modules: Optional[Sequence[torch.nn.Module]] = None):
        # ``modules``: ``list(model.modules())`` where the caller has it.
        self.entries: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []
        # (id(globals), name) -> (globals, name, value, copy of its contents or None).
        self.globals: dict[tuple[int, str], tuple[dict, str, Any, Any]] = {}
        # Objects of library classes whose state is no attribute (a random.Random, a numpy
        # Generator or RandomState, an itertools.count, a deque): id -> (object, state).
        # Those the modules hold are compared as each traced forward returns; globals
        # (numpy's own generator, whose state costs 50 us to read) only as the root's does.
        self.hidden: dict[int, tuple[Any, tuple]] = {}
        self.hidden_globals: dict[int, tuple[Any, tuple]] = {}
        modules = list(model.modules()) if modules is None else list(modules)
        # The modules' attributes are walked once: the library objects with hidden state
        # they hold are noted (in module order, as a walk of their own would note them)
        # while the objects they hold are found (reachable_objects' first level).
        held = reachable_objects(modules, note=self._note_hidden)
        for obj in held:
            items = object_items(obj)
            contents = _contents(items)
            self.entries.append((obj, items, contents))
        atoms = _ATOMS  # (no hidden state: plain values)
        for owner in held:
            for k, v in object_items(owner).items():
                if type(v) not in atoms and k not in _MODULE_TABLES:
                    self._note_hidden(v)
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:  # np.random.rand() & co. draw from this one
            self._note_hidden(getattr(getattr(numpy_random, "mtrand", None), "_rand", None), self.hidden_globals)

    def _note_hidden(self, value: Any, table: Optional[dict] = None) -> None:
        table = self.hidden if table is None else table
        if id(value) in self.hidden or id(value) in self.hidden_globals or not _hidden_state(value):
            return
        state = _state_of(value)
        if state is not None:
            table[id(value)] = (value, state)

    def objects(self) -> list[Any]:
        """The objects whose attributes are snapshotted."""
        return [obj for obj, _, _ in self.entries]

    def note_globals(self, namespace: dict, names: Sequence[str]) -> None:
        """Remember what the globals ``names`` of ``namespace`` hold, before code naming
        them runs (``trace._static_code``, before the trace): a global assigned
        (``global COUNT; COUNT += 1``), a list, dict or set it holds changed, or an object
        it holds written, is a side effect as a held object's is."""
        for name in names:
            key = (id(namespace), name)
            if key in self.globals:
                continue
            value = namespace.get(name, _MISSING)
            if callable(value) or isinstance(value, types.ModuleType):
                # (A function or class: what the trace itself patches, as opaque functions.)
                continue
            copy = _data_copy(value) if _is_plain_container(value) else None
            if value is not _MISSING:
                self._note_hidden(value, self.hidden_globals)
            self.globals[key] = (namespace, name, value, copy)
            if value is not _MISSING and holds_state(value):
                known = {id(obj) for obj, _, _ in self.entries}
                for obj in reachable_objects((), roots=(value,)):
                    if id(obj) not in known:
                        items = object_items(obj)
                        contents = _contents(items)
                        self.entries.append((obj, items, contents))

    def changed(self, root: bool = False) -> Optional[str]:
        """What the first changed attribute is (``"Stats.count"``), or None; ``root``: as
        the root's forward returns (the globals' library objects compared too)."""
        for obj, state in (*self.hidden.values(), *(self.hidden_globals.values() if root else ())):
            if _state_of(obj) != state:
                kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
                return f"the state of a {kind} (a method call drew from or changed it)"
        for namespace, name, value, copy in self.globals.values():
            now = namespace.get(name, _MISSING)
            if not _same_value(now, value):
                return f"the global {name} (of {namespace.get('__name__', '?')})"
            if copy is not None and not _same(now, copy):
                return f"the {type(now).__name__} in the global {name} (of {namespace.get('__name__', '?')})"
        for obj, items, contents in self.entries:
            now = object_items(obj)
            if now.keys() != items.keys():
                name = next(iter(now.keys() ^ items.keys()))
                return f"{type(obj).__name__}.{name}"
            for k, v in now.items():
                if not _same_value(v, items[k]) and not (callable(v) and callable(items[k])):
                    return f"{type(obj).__name__}.{k}"
            for k, copy in contents.items():
                if not _same(now[k], copy):
                    return f"{type(obj).__name__}.{k} (a {type(now[k]).__name__} it holds)"
        return None

    def refuse_changes(self, root: bool = False) -> None:
        """Raise :class:`ObjectWrittenDuringTrace` where :meth:`changed` finds a change."""
        if not self.entries and not self.globals and not self.hidden and not (root and self.hidden_globals):
            return
        what = self.changed(root)
        if what is not None:
            verb, held = (
                ("changes", "")
                if what.startswith("the ")
                else ("assigns", ", an attribute of an object a module holds,")
            )
            raise ObjectWrittenDuringTrace(
                f"the forward {verb} {what}{held} while traced: a Python side effect a trace would perform only "
                "once (and on graph values)"
            )

    def restore(self) -> None:
        """Put back every attribute, global and container content a trace changed, and the
        state of each library object whose state it changed where that object can be set
        to a state (:func:`_set_state`)."""
        for obj, state in (*self.hidden.values(), *self.hidden_globals.values()):
            if _state_of(obj) != state and not _set_state(obj, state):
                warnings.warn(
                    f"streamsched: tracing changed the state of a {type(obj).__qualname__} the model holds (a method "
                    "call drew from or advanced it) and cannot put it back: it is one step ahead of eager. The module "
                    "calling it runs as written from now on",
                    stacklevel=2,
                )
        for namespace, name, value, copy in self.globals.values():
            now = namespace.get(name, _MISSING)
            if now is not value:
                if value is _MISSING:
                    namespace.pop(name, None)
                else:
                    namespace[name] = value
            if copy is not None and not _same(value, copy):
                _refill(value, copy)
        for obj, items, contents in self.entries:
            now = object_items(obj)
            for k in now.keys() - items.keys():
                try:
                    object.__delattr__(obj, k)
                except (AttributeError, TypeError):
                    pass
            for k, v in items.items():
                if now.get(k, _MISSING) is not v and not callable(v):
                    try:
                        object.__setattr__(obj, k, v)
                    except (AttributeError, TypeError):  # a frozen or extension class
                        pass
            for k, copy in contents.items():
                container = items[k]
                if not _same(container, copy):  # (contents: data only, see _contents)
                    _refill(container, copy)


_MISSING = object()
# A list, dict or set in a global longer than this is compared by identity only.
_MAX_COPIED = 10_000


# A library object whose pickled state is longer than this is not watched.
_MAX_PICKLED = 1 << 16


def _hidden_state(value: Any) -> bool:
    """Whether ``value`` is an instance of a library class whose state traced code may
    change through its methods (not a tensor, module, plain value, container, class or
    function: those are handled by the trace itself or compared otherwise)."""
    if value is None or is_plain(value) or callable(value) or isinstance(value, (torch.Tensor, torch.nn.Module)):
        return False
    kind = type(value)
    if kind in (list, dict, set, tuple, frozenset, str, bytes) or isinstance(value, types.ModuleType):
        return False
    if _is_plain_container(value):
        return False  # (its items are compared and put back: HeldState's contents)
    module = kind.__module__.partition(".")[0]
    return module not in ("torch", "streamsched") and (_library_object(value) or not holds_state(value))


def _state_of(obj: Any) -> Optional[tuple]:
    """A comparable copy of ``obj``'s state: a deque's items, a numpy RandomState's or
    random.Random's state, a numpy Generator's bit generator's, else its pickled bytes
    (where it pickles the same twice and is short); None where none can be had."""
    try:
        if isinstance(obj, collections.deque):
            return ("deque", list(obj))
        if hasattr(obj, "get_state") and hasattr(obj, "set_state"):  # a numpy RandomState
            name, key, pos, has_gauss, cached = obj.get_state()
            return ("RandomState", name, key.tobytes(), str(key.dtype), pos, has_gauss, cached)
        bit_generator = getattr(obj, "bit_generator", None)
        if bit_generator is not None:  # a numpy Generator
            return ("Generator", pickle.dumps(bit_generator.state, protocol=4))
        if hasattr(obj, "getstate") and hasattr(obj, "setstate"):  # a random.Random
            return ("Random", obj.getstate())
        if _size_of(obj) > _MAX_PICKLED:  # (pickling a large array would copy it whole to find out)
            return None
        state = pickle.dumps(obj, protocol=4)
        if len(state) > _MAX_PICKLED or pickle.dumps(obj, protocol=4) != state:
            return None
        return ("pickled", state)
    except Exception:  # noqa: BLE001 - anything whose state cannot be read is not watched
        return None


def _size_of(obj: Any) -> int:
    """The bytes ``obj`` holds as far as it tells: its own size, buffer included (a numpy
    array that owns its data, a ``bytearray``), or its ``nbytes`` (a view)."""
    nbytes = getattr(obj, "nbytes", None)
    return max(sys.getsizeof(obj, 0), nbytes if type(nbytes) is int else 0)


def _set_state(obj: Any, state: tuple) -> bool:
    """Give ``obj`` back the state :func:`_state_of` read; False where no way is known (an
    ``itertools.count``)."""
    try:
        kind = state[0]
        if kind == "deque":
            obj.clear()
            obj.extend(state[1])
        elif kind == "RandomState":
            numpy = sys.modules["numpy"]
            _, name, key, dtype, pos, has_gauss, cached = state
            obj.set_state((name, numpy.frombuffer(key, dtype=dtype).copy(), pos, has_gauss, cached))
        elif kind == "Generator":
            obj.bit_generator.state = pickle.loads(state[1])
        elif kind == "Random":
            obj.setstate(state[1])
        else:
            reduced = pickle.loads(state[1]).__reduce_ex__(2)
            if len(reduced) < 3 or reduced[2] is None or not hasattr(obj, "__setstate__"):
                return False
            obj.__setstate__(reduced[2])
    except Exception:  # noqa: BLE001 - a state that cannot be set back
        return False
    return True


def _data_copy(value: Any) -> Any:
    """A copy of a list, dict or set of data; None for one that holds functions or classes
    (a registry, which opaque functions patch while a trace runs) or is too long."""
    if len(value) > _MAX_COPIED:
        return None
    for item in value.values() if isinstance(value, dict) else value:
        if callable(item):
            return None
    return _container_copy(value)


def _contents(items: dict[str, Any]) -> dict[str, Any]:
    """Copies of the lists, dicts and sets of data among an object's attributes."""
    out = {}
    for k, v in items.items():
        if _is_plain_container(v):
            copy = _data_copy(v)
            if copy is not None:
                out[k] = copy
    return out


def _container_copy(value: Any) -> Any:
    """A plain copy of a list, dict or set (of a subclass of one too: its items)."""
    return dict(value) if isinstance(value, dict) else list(value) if isinstance(value, list) else set(value)
