"""Plain functions that fx cannot trace, run as one opaque call inside a traced forward.

A traced forward often calls a library function whose body fx cannot go through: the
mask builders of ``transformers.masking_utils`` branch on tensor values and on cache
objects. Without this, the failure makes the calling module's class opaque (its whole
forward runs as one task, its layers unseen). Instead, when a trace fails inside such a
function, the tracer makes *the function* one opaque call and traces again: each call of
it with graph values among its arguments becomes one node (an :class:`OpaqueFunction`
target), run as written on every call.

Which function: from the failure's traceback, the outermost frame below the failing
module's ``forward`` (the innermost frame of that module) whose function its caller
reaches by name, in the caller's globals (``create_causal_mask(...)``) or as an
attribute of a module the caller imported (``masking_utils.create_causal_mask(...)``).
For the length of each trace of that model, that name is patched with a dispatcher that
records a node when a proxy is among the arguments (and calls the function otherwise, or
on another thread). Never taken:

- functions of ``torch``, of Python's standard library and of streamsched itself;
- a function whose own code assigns or deletes attributes or globals (``STORE_ATTR``,
  ``setattr``...): it may change a module's attribute, which traced code after it would
  read as it was while tracing;
- a failure that was a side effect refused during the trace (``trace_guard``).

A call is recorded only where each argument that is not a graph value is safe to bake
into the node: a plain value, a tensor constant, a module of the model, or an object held
by a traced-through module's attribute (``self.config``). An object made during the
forward (a ``DynamicCache`` built when ``use_cache`` is set) would be shared by every
call: such a call refuses, and the function is not wrapped for this model (the calling
module becomes opaque, as before). At run time a call that assigns a module attribute
all the same raises :class:`OpaqueFunctionSideEffect` instead of diverging silently.

Its outputs are learned as any leaf call's (``opaque_outputs``): a mask builder that
returns ``None`` (SDPA's causal fast path) is handed to the traced code as ``None``.

What an opaque call's items are, the trace cannot see. For one family of functions a
rule says (:func:`known_items`): an attention function of transformers' attention
interface (``AttentionInterface``: ``sdpa_attention_forward``, the flash and flex ones,
any registered one) is called ``(module, query, key, value, mask, ...)`` and returns
``(attn_output, attn_weights)``, ``attn_output`` of the query's rank and dtype (laid out
``(batch, length, heads, head_dim)`` where the query is ``(batch, heads, length,
head_dim)``). The traced code may then read ``attn_output.shape`` (GPT-2's attention
reshapes ``(*attn_output.shape[:-2], -1)``). Where the trace relied on it, the call
checks its output each time it runs (:meth:`OpaqueFunction.expect`): another rank or
dtype raises :class:`~streamsched.frontend.rank_checks.RankAssumptionError` instead of
going on in a graph made for the promised one.
"""

from __future__ import annotations

import dis
import os
import sys
import sysconfig
import threading
import types
from typing import Any, Optional

import torch
from torch import fx

from .. import _generation
from .checkpointing import ENTRY_POINTS, CheckpointDuringTrace, checkpoint_site
from .rank_checks import RankAssumptionError, real_of

__all__ = [
    "OpaqueFunction",
    "OpaqueFunctionSideEffect",
    "UnsafeOpaqueCall",
    "candidate",
    "patched",
    "current",
    "known_items",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIRS = tuple(
    os.path.realpath(p) for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p
)


class OpaqueFunctionSideEffect(RuntimeError):
    """A function run as an opaque call assigned an attribute of a module of the model."""


# The code objects running checkpoint's own body (under torch's wrappers).
_CHECKPOINT_BODIES = frozenset(getattr(f, "__wrapped__", f).__code__ for f in ENTRY_POINTS)


class UnsafeOpaqueCall(Exception):
    """A call of an opaque function passed an object that cannot be baked into a node."""

    def __init__(self, fn: Any, why: str):
        super().__init__(f"{_qualname(fn)}: {why}")
        self.fn = fn


class _Slot:
    """Stands for the ``index``-th graph value among a call's arguments."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<arg {self.index}>"


def _fill(template: Any, values: tuple) -> Any:
    if type(template) is _Slot:
        return values[template.index]
    if type(template) in (tuple, list):
        return type(template)(_fill(t, values) for t in template)
    if type(template) is dict:
        return {k: _fill(t, values) for k, t in template.items()}
    return template


class OpaqueFunction:
    """The target of a node that runs a function as written: its arguments, with the
    node's values (the graph values of the traced call, in order) put back where the
    traced call had them."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict, reason: str, modules: frozenset[int]):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.reason = reason
        self.modules = modules
        self.label = f"function {_qualname(fn)}"
        # fx formats call_function targets by __module__ and __name__.
        self.__module__ = getattr(fn, "__module__", None) or "streamsched"
        self.__name__ = getattr(fn, "__name__", "opaque_function")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        # index of an item of the output -> (rank, dtype) the trace relied on (None: not that)
        self.expected: dict[int, tuple[Optional[int], Optional[torch.dtype]]] = {}

    @property
    def costed_module(self) -> Optional[torch.nn.Module]:
        """The module of the model the call runs, where it is handed one as its first
        argument (``checkpoint(block, x)``): its cost is estimated as that module's."""
        first = self.args[0] if self.args else None
        return first if isinstance(first, torch.nn.Module) else None

    def expect(self, index: int, rank: Optional[int], dtype: Optional[torch.dtype]) -> None:
        """The trace relied on item ``index`` of the output having ``rank`` and ``dtype``
        (where not ``None``), as a rule said (:func:`known_items`): checked on every call."""
        self.expected[index] = (rank, dtype)

    def __call__(self, *values: Any) -> Any:
        args = _fill(self.args, values)
        kwargs = _fill(self.kwargs, values)
        thread = threading.get_ident()
        previous = _generation._on_setattr.get(thread)
        _generation._on_setattr[thread] = self._refuse
        try:
            out = self.fn(*args, **kwargs)
        finally:
            if previous is None:
                _generation._on_setattr.pop(thread, None)
            else:
                _generation._on_setattr[thread] = previous
        if self.expected:
            self._check(out)
        return out

    def _check(self, out: Any) -> None:
        for index, expected in self.expected.items():
            item = out[index] if type(out) in (tuple, list) and index < len(out) else None
            for kind, number in zip(("rank", "dtype"), expected):
                if number is None:
                    continue
                real = real_of(kind, item)
                if real != number:
                    raise RankAssumptionError(
                        f"{_qualname(self.fn)} (run as one opaque call of a traced forward) returned item {index} "
                        f"with {kind} {real if real is not None else type(item).__name__}, where the trace relied on "
                        f"{number} (streamsched's rule for attention functions: the query's rank and dtype). The "
                        "traced graph would not compute what the model does, so the call is refused. Name the class "
                        "of the module calling it in leaf_modules=(...) so that its forward runs as written"
                    )

    def _refuse(self, module: Any, name: str) -> None:
        if id(module) in self.modules:
            raise OpaqueFunctionSideEffect(
                f"{_qualname(self.fn)} (run as one opaque call of a traced forward) assigns "
                f"{type(module).__name__}.{name}: traced code after it would not see the new value. "
                "Decorate the module class calling it with @streamsched.branch, or name that class in "
                "leaf_modules=(...), so that its forward runs as written."
            )

    def __repr__(self) -> str:
        return f"<opaque {self.label}>"


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


# --- what a rule knows of a call's output ---------------------------------------------------


def _attention_functions() -> tuple[Any, ...]:
    """The functions registered in transformers' attention interface (none where
    transformers is not loaded)."""
    utils = sys.modules.get("transformers.modeling_utils")
    interface = getattr(utils, "AttentionInterface", None)
    table = getattr(interface, "_global_mapping", None)
    if type(table) is not dict:
        return ()
    local = getattr(getattr(utils, "ALL_ATTENTION_FUNCTIONS", None), "_local_mapping", None)
    return (*table.values(), *(local.values() if type(local) is dict else ()))


def known_items(fn: Any, args: tuple, kwargs: dict) -> dict[int, Any]:
    """Items of the output of the call ``fn(*args, **kwargs)`` whose rank and dtype are
    those of an argument, by a rule: index -> that argument. An attention function of
    transformers' attention interface ``(module, query, key, value, ...)`` returns its
    output, of the query's rank and dtype, first."""
    # (While a trace runs, the table holds the dispatcher standing for the function.)
    if any(fn is getattr(f, "__wrapped__", f) for f in _attention_functions()):
        query = args[1] if len(args) > 1 else kwargs.get("query")
        return {0: query} if isinstance(query, fx.Proxy) else {}
    return {}


# --- picking the function ------------------------------------------------------------------


def _excluded_file(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    if path.startswith(os.path.realpath(_TORCH_DIR)) or path.startswith(os.path.realpath(_PACKAGE_DIR)):
        return True
    return any(path.startswith(d + os.sep) for d in _STDLIB_DIRS) and "site-packages" not in path


_WRITES = frozenset({"STORE_ATTR", "DELETE_ATTR", "STORE_GLOBAL", "DELETE_GLOBAL"})


def _writes_state(code: types.CodeType) -> bool:
    """Whether ``code`` (or a function or class body defined in it) assigns or deletes an
    attribute or a global, or names ``setattr`` / ``delattr``."""
    for ins in dis.get_instructions(code):
        if ins.opname in _WRITES:
            return True
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in ("setattr", "delattr"):
            return True
    return any(isinstance(c, types.CodeType) and _writes_state(c) for c in code.co_consts)


def _reached(caller_globals: dict, code: types.CodeType) -> Optional[tuple[dict, str, Any]]:
    """How a caller with ``caller_globals`` reaches the function running ``code``: the
    namespace holding it, its name there, and the function."""
    name = code.co_name
    value = caller_globals.get(name)
    if isinstance(value, types.FunctionType) and value.__code__ is code:
        return caller_globals, name, value
    for key, value in caller_globals.items():
        if isinstance(value, types.FunctionType) and value.__code__ is code:
            return caller_globals, key, value
    for value in list(caller_globals.values()):
        if isinstance(value, types.ModuleType):
            attr = getattr(value, name, None)
            if isinstance(attr, types.FunctionType) and attr.__code__ is code:
                return value.__dict__, name, attr
    # A registry the caller looks the function up in: a dict it names, or a dict held by
    # an object it names (transformers' ALL_ATTENTION_FUNCTIONS keeps its functions in a
    # class-level dict).
    for value in list(caller_globals.values()):
        if isinstance(value, (types.ModuleType, type, types.FunctionType)):
            continue
        tables = [value] if type(value) is dict else []
        if type(value) is not dict and hasattr(type(value), "__dict__"):
            tables += [v for v in getattr(value, "__dict__", {}).values() if type(v) is dict]
            tables += [v for klass in type(value).__mro__ for v in vars(klass).values() if type(v) is dict]
        for table in tables:
            for key, fn in list(table.items()):
                if type(key) is str and isinstance(fn, types.FunctionType) and fn.__code__ is code:
                    return table, key, fn
    return None


def candidate(exc: BaseException, module: torch.nn.Module, skip: set[int]) -> Optional[tuple[dict, str, Any]]:
    """The function to run as one opaque call for failure ``exc`` in ``module``'s forward:
    ``(namespace, name, function)``, or ``None`` where no function below that forward may
    be taken (the module's class becomes opaque then). ``skip`` holds the ids of
    functions already refused."""
    frames: list[types.FrameType] = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    start = None
    for i, frame in enumerate(frames):
        if frame.f_locals.get("self") is module:
            start = i
    if start is None:
        return None
    for i in range(start + 1, len(frames)):
        frame = frames[i]
        code = frame.f_code
        if isinstance(exc, CheckpointDuringTrace) and code in _CHECKPOINT_BODIES:
            # Activation checkpointing (frontend.checkpointing): the checkpoint call
            # itself, as the nearest frame of the caller's own reaches it.
            caller = next((f for f in reversed(frames[start:i]) if not _excluded_file(f.f_code.co_filename)), None)
            site = checkpoint_site(caller.f_globals) if caller is not None else None
            # Refused once (a lambda made during the forward): the caller runs as written.
            return None if site is None or id(site[2]) in skip else site
        if _excluded_file(code.co_filename):
            continue
        found = _reached(frames[i - 1].f_globals, code)
        if found is None:
            continue
        fn = found[2]
        if id(fn) in skip or _writes_state(fn.__code__):
            return None  # an outer function that may not be taken: nor may any inside it
        return found
    return None


# --- patching, for the length of a trace ---------------------------------------------------

_state = threading.local()
_lock = threading.Lock()
# (id(namespace), name) -> [namespace, original, dispatcher, count]
_patches: dict[tuple[int, str], list] = {}


def current() -> Any:
    """The tracer tracing on this thread with opaque functions, or ``None``."""
    return getattr(_state, "tracer", None)


def _has_proxy(value: Any) -> bool:
    if isinstance(value, fx.Proxy):
        return True
    if type(value) in (tuple, list):
        return any(_has_proxy(v) for v in value)
    if type(value) is dict:
        return any(_has_proxy(v) for v in value.values())
    return False


def _dispatcher(fn: Any) -> Any:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        tracer = getattr(_state, "tracer", None)
        if tracer is not None and id(fn) in tracer.opaque_functions and (_has_proxy(args) or _has_proxy(kwargs)):
            return tracer.opaque_call(fn, args, kwargs)
        return fn(*args, **kwargs)

    dispatch.__wrapped__ = fn  # type: ignore[attr-defined]
    dispatch.__name__ = getattr(fn, "__name__", "dispatch")
    dispatch.__qualname__ = getattr(fn, "__qualname__", dispatch.__name__)
    return dispatch


# The code of every dispatcher (a guard on a function takes one for the function it stands in for).
DISPATCH_CODE = _dispatcher(len).__code__


class patched:
    """For the length of a trace by ``tracer`` on this thread: each ``(namespace, name,
    function)`` of ``sites`` dispatches to the tracer. Patches are counted, so that traces
    on other threads patching the same name leave the original in place when the last one
    ends."""

    def __init__(self, tracer: Any, sites: list[tuple[dict, str, Any]]):
        self.tracer = tracer
        self.sites = sites
        self.keys: list[tuple[int, str]] = []

    def __enter__(self) -> patched:
        self.previous = getattr(_state, "tracer", None)
        _state.tracer = self.tracer
        with _lock:
            for namespace, name, fn in self.sites:
                key = (id(namespace), name)
                entry = _patches.get(key)
                if entry is None:
                    if namespace.get(name) is not fn:
                        continue  # renamed since: nothing to patch
                    entry = _patches[key] = [namespace, fn, _dispatcher(fn), 0]
                    namespace[name] = entry[2]
                entry[3] += 1
                self.keys.append(key)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            for key in self.keys:
                entry = _patches[key]
                entry[3] -= 1
                if entry[3] == 0:
                    namespace, fn, dispatch = entry[0], entry[1], entry[2]
                    if namespace.get(key[1]) is dispatch:
                        namespace[key[1]] = fn
                    del _patches[key]
        self.keys = []
        _state.tracer = self.previous


def template(fn: Any, args: tuple, kwargs: dict, safe: Any) -> tuple[tuple, dict, list[Any]]:
    """The call's arguments with a :class:`_Slot` for each graph value, and the graph
    values in order. ``safe(value)`` tells whether a constant may be baked in (raises
    :class:`UnsafeOpaqueCall` where one may not)."""
    values: list[Any] = []

    def walk(value: Any) -> Any:
        if isinstance(value, fx.Proxy):
            values.append(value)
            return _Slot(len(values) - 1)
        if type(value) in (tuple, list):
            return type(value)(walk(v) for v in value)
        if type(value) is dict:
            return {k: walk(v) for k, v in value.items()}
        why = safe(value)
        if why is not None:
            raise UnsafeOpaqueCall(fn, why)
        return value

    return walk(args), walk(kwargs), values
