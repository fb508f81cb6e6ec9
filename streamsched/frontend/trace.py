"""Front end: trace a model into an ``fx.Graph`` of submodule calls.

Leaves (nodes the scheduler treats as one opaque unit of work) are ``torch.nn``
built-in modules, module classes and functions decorated with ``@streamsched.branch``,
and any types the user names in ``leaf_modules``. Everything else is traced through.

Arguments are split in two: every tensor leaf of the call's arguments (also inside
lists, tuples and dicts) becomes a graph input; every other value (``None``, flags,
sizes) is *specialised*: baked into the trace, as ``torch.compile`` does. A call with
other static values gets its own trace. This is what makes ``if y is None:`` in a
forward trace correctly.

A trace has no side effects on the model: buffers are graph values (an in-place update
such as ``num_batches_tracked.add_(1)`` is a node of the program, run every call), and a
forward that would write a real tensor in place, or assign a module attribute, while it
is traced fails that module's trace instead of changing the model once.

When tracing fails inside a submodule, that submodule's class becomes opaque (its calls
run as tasks, exactly as eager) and the rest is traced again; the trace lists which
modules became opaque and why. Only a failure in the root's own ``forward`` raises
:class:`~streamsched.errors.TraceError`, naming the module, the file and line, and the
way out (``@streamsched.branch``, ``leaf_modules=`` or ``strict=False``).
"""

from __future__ import annotations

import dis
import functools
import inspect
import linecache
import operator
import os
import sys
import threading
import traceback
import types
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx

from .. import _generation
from ..branch import _BRANCH_ATTR, BranchCall, is_branch_module
from ..errors import TraceError
from . import made_modules, node_meta, opaque_functions
from .binder import CallBinder, CallSpec, is_plain
from .fx_fast import FastTracerMixin
from .held_reads import stale_held_read
from .hooks import capture_collecting, capture_hooks, captures_below, has_hooks
from .made_modules import made_module_refusal
from .member_replay import MemberReplay
from .nodes import AUGMENTED_OPERATORS, has_children, modules_of, named_modules_of, submodule, submodule_resolver
from .opaque_functions import OpaqueFunction, UnsafeOpaqueCall
from .opaque_outputs import (
    OutputCheck,
    Skeleton,
    leaf_label,
    learn,
    learned,
    learned_with_guesses,
    mark_structure_read,
    skeleton_of,
)
from .output_tree import OutputTree
from .rank_checks import rely_on
from .ranks import RankTracker
from .state_queries import QueryRecorder
from .trace_guard import (
    _MODULE_TABLES,
    ContainerWrittenDuringTrace,
    GradModeGuard,
    HeldState,
    SideEffectDuringTrace,
    TraceSideEffectGuard,
    autocast_state,
    copy_fresh_constants,
    holds_state,
    object_items,
    reachable_objects,
    restore_containers,
    snapshot_containers,
)

__all__ = ["Traced", "trace_model", "is_compiled_module", "dtype_probes", "dtypes_same"]


class CaptureInsideLeaf(SideEffectDuringTrace):
    """A module run as one call holds modules whose outputs the forward collects while
    tracing (transformers' output capturing): the calling module runs as written, where
    the hooks fire in the collecting context."""


_TORCH_DIR = os.path.dirname(torch.__file__)
# The whole package (a side effect is refused from _generation's __setattr__, outside
# frontend/): no frame of it is the user's.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class _TraceRoot(torch.nn.Module):
    """A stand-in root that shares the model's submodules, parameters and buffers.

    Tracing it gives node targets with exactly the model's own paths ("towers.0.fc1"),
    while its ``forward`` takes only the tensor leaves of one call.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_streamsched_model"] = model

    def __getattr__(self, name: str) -> Any:
        # The model's own plain attributes (a tensor held as ``self.scale``, not a
        # parameter or buffer): a ``get_attr`` of the trace reads the model's current
        # value on every call, as eager does.
        try:
            return super().__getattr__(name)
        except AttributeError:
            held = self.__dict__["_streamsched_model"].__dict__
            if name in held:
                return held[name]
            raise


# Tensor factories called with a traced size (``torch.zeros(x.shape[0], d)``): Python's
# argument parser rejects a proxy where an int belongs before ``__torch_function__`` can
# see it, so fx fails on them. Patched in ``torch`` while tracing (fx's autowrap: with a
# proxy among the arguments the call becomes a node; without, the original runs).
_FACTORIES = tuple(
    getattr(torch, name)
    for name in ("zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "eye", "linspace", "tensor")
    if hasattr(torch, name)
)


_FX_PATCHING = threading.RLock()
"""Held by a thread while fx traces on it (see :meth:`_LeafTracer.trace`)."""


class _LeafTracer(FastTracerMixin, fx.Tracer):
    """fx's tracer with streamsched's leaves, safe beside other threads.

    While tracing, fx patches ``nn.Module.__call__`` and ``__getattr__`` process-wide.
    Without the thread check below, a module called by *another* thread during that
    time (another model serving requests, another caller of this wrapper) would be
    recorded into this trace or fail; with it, such calls run as if no tracing happened.

    Buffers are proxied (``proxy_buffer_attributes``), so in-place buffer updates are
    nodes of the graph. The innermost traced-through module a failure passed through is
    noted on the exception (``_streamsched_failed_in``), for the opaque fallback.
    """

    def __init__(
        self,
        leaf_types: tuple[type, ...],
        model: torch.nn.Module,
        leaf_functions: tuple[Any, ...] = (),
        opaque_types: frozenset[type] = frozenset(),
        known_outputs: Optional[dict[tuple[str, int], Skeleton]] = None,
        function_sites: Sequence[tuple[dict, str, Any]] = (),
        ranks: Optional[Sequence[int]] = None,
        dtypes: Optional[Sequence[torch.dtype]] = None,
    ):
        super().__init__(autowrap_functions=tuple(leaf_functions) + _FACTORIES)
        self._fast_setup()
        # Functions run as one opaque call each (frontend.opaque_functions): where their
        # callers name them, and by id.
        self.function_sites = list(function_sites)
        self.opaque_functions = {id(fn): fn for _, _, fn in self.function_sites}
        # Ranks of the values (frontend.ranks): what a traced shape's length is.
        self.ranks = RankTracker(ranks, dtypes)
        self.leaf_types = leaf_types
        self.opaque_types = opaque_types
        # What leaf calls returned on a real call where a proxy misled the traced code
        # (frontend.opaque_outputs): (path, index among that path's calls) -> skeleton.
        self.known_outputs = known_outputs or {}
        self.leaf_calls: dict[str, int] = {}
        self.inlined_leaf_calls = 0
        self.model = model
        self.thread = threading.get_ident()
        self.thread_state = self._thread_state()
        self.proxy_buffer_attributes = True
        # Modules whose forward was traced through (the root included): their plain
        # attributes are baked into the trace.
        self.traced_through: dict[int, torch.nn.Module] = {id(model): model}
        # What the objects the modules hold held before the trace (trace_guard.HeldState).
        self.held_state: Optional[HeldState] = None
        self._decided: Optional[tuple[torch.nn.Module, bool]] = None
        # Modules constructed on this thread while the trace runs (made_modules.recording).
        self.constructed: dict[int, torch.nn.Module] = {}
        # The modules made during the trace and traced through: each must be gone once
        # the trace ends (made_modules.kept_after_trace).
        self.made_through: list[weakref.ref] = []
        self.members = MemberReplay(self)
        # Leaf functions are patched wherever a traced forward's module names them; the
        # root's forward is called directly, so its module is searched too.
        model_module = sys.modules.get(type(model).__module__)
        self._autowrap_search = [*self._autowrap_search, torch]
        if leaf_functions and model_module is not None:
            self._autowrap_search.append(model_module)

    def trace(self, root: Any, concrete_args: Optional[dict[str, Any]] = None) -> fx.Graph:
        # One fx trace at a time across threads (nested on one thread is fine): fx patches
        # nn.Module.__call__ and __getattr__ process-wide and puts back what it found on
        # entry, so two traces on two threads ending in another order than they began
        # left the first one's patch installed for good (every later module call went
        # through a finished trace's wrapper, and one on its thread was recorded into it).
        # Modules the forward constructs meanwhile (on this thread) may be traced through
        # (frontend.made_modules); any other that is not installed is refused.
        with _FX_PATCHING, opaque_functions.patched(self, self.function_sites), made_modules.recording() as made:
            self.constructed = made
            try:
                graph = super().trace(root, concrete_args)
            finally:
                self.constructed = {}
                made.clear()
        kept = made_modules.kept_after_trace(self.made_through)
        if kept is not None:
            raise TraceError(kept)
        return graph

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        # fx has collected the tensors the root's modules hold as attributes, by path;
        # the model's own (``self.scale``) are the model's, not the trace root's: by
        # name, a ``get_attr`` read every call (not a constant that a re-assignment
        # leaves stale).
        for name, value in self.model.__dict__.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                self.tensor_attrs.setdefault(value, name)
        return super().create_args_for_root(root_fn, is_module, concrete_args)

    def opaque_call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        """A call of an opaque function with graph values among its arguments: one node
        (``frontend.opaque_functions``), whose value is learned as a leaf call's."""
        t_args, t_kwargs, values = opaque_functions.template(fn, args, kwargs, self._bakeable)
        modules = frozenset(id(m) for m in self.model.modules())
        target = OpaqueFunction(fn, t_args, t_kwargs, "", modules)
        proxy = self.create_proxy("call_function", target, tuple(values), {})
        # What a rule knows of its items (attention functions: the query's rank and dtype).
        for index, like in opaque_functions.known_items(fn, args, kwargs).items():
            # (Not the dtype under autocast: the function computes in autocast's.)
            self.ranks.promise(proxy.node, index, like.node, target, dtype=not autocast_state())
        return self._known_structure(target.label, proxy)

    def _bakeable(self, value: Any) -> Optional[str]:
        """Why ``value``, a constant argument of an opaque function's call, may not be
        baked into its node (``None`` where it may)."""
        if is_plain(value) or isinstance(value, torch.Tensor):
            return None
        if isinstance(value, torch.nn.Module):
            if any(value is m for m in self.model.modules()):
                return None
            return f"a {type(value).__name__} module that is not part of the model"
        for module in self.traced_through.values():
            if any(value is v for v in module.__dict__.values()):
                return None  # held by a module (self.config): the same object every call
        return (
            f"a {type(value).__name__} made while the forward runs (not held by the model): "
            "baked into the trace, every call would share it"
        )

    def call_module(self, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        if m is not self.model and not self._installed(m):
            # Made by the forward as it runs (``loss_fct = CrossEntropyLoss()``): traced
            # through, as a function of its constructor's arguments (frontend.made_modules).
            refusal = made_module_refusal(m, self.constructed)
            if refusal is not None:
                raise TraceError(refusal)
            self.made_through.append(weakref.ref(m))
            return forward(*args, **kwargs)
        leaf = self.is_leaf_module(m, "")
        # fx's call_module asks again, for the same module, right away: one decision.
        self._decided = (m, leaf)
        if not leaf:
            self.traced_through[id(m)] = m
            if m is not self.model and not has_children(m):
                # A leaf-module call the trace goes through: its operations are the
                # plan's (``frontend.leafcalls``).
                self.inlined_leaf_calls += 1
        try:
            if leaf and m is not self.model and capture_collecting() and captures_below(m):
                raise CaptureInsideLeaf(
                    f"{type(m).__name__} holds modules whose outputs the forward collects (output capturing: "
                    "output_attentions / output_hidden_states); run as one call, they would hand over nothing"
                )
            if not leaf and m is not self.model:
                # A member whose forward only calls its leaf children: the first of its
                # kind is traced and recorded, later ones made from the recording
                # (frontend.member_replay).
                forward = self._member_forward(m, forward)
            out = super().call_module(m, forward, args, kwargs)
            if not leaf and self.held_state is not None:
                # A write to an object the modules hold, made by this forward or below it
                # (the innermost traced forward it passed through reports it first).
                self.held_state.refuse_changes()
            if leaf and m is not self.model:
                out = self._known_structure(self.path_of_module(m), out)
                # A leaf's capture hooks hand its output to the enclosing forward: fire
                # them here, on the proxy (frontend.hooks); at run time they are no-ops.
                hooks = capture_hooks(m)
                if hooks and isinstance(out, fx.Proxy):
                    # They take an item where the output is a tuple, and a bare proxy is
                    # none: the recording call learns what the leaf returns (misleads).
                    mark_structure_read(out.node)
                for hook in hooks:
                    hook(m, args, out)
            return out
        except Exception as exc:
            if not leaf and getattr(exc, "_streamsched_failed_in", None) is None:
                try:
                    exc._streamsched_failed_in = m  # type: ignore[attr-defined]
                except AttributeError:  # pragma: no cover - exceptions with __slots__
                    pass
            raise

    def _member_forward(self, m: torch.nn.Module, forward: Any) -> Any:
        members = self.members

        def run(*args: Any, **kwargs: Any) -> Any:
            # Decided where fx would run the forward: m's scope and module stack are set.
            return members.run(m, forward, args, kwargs)

        return run

    def _known_structure(self, label: str, out: Any) -> Any:
        """A leaf call's value as the traced code sees it: the proxy, or, where a real
        call showed what it returns (``None`` in a tuple, say), that structure, read
        through an :class:`OutputCheck` node. ``label`` names the leaf
        (``opaque_outputs.leaf_label``)."""
        index = self.leaf_calls.get(label, 0)
        self.leaf_calls[label] = index + 1
        skeleton = self.known_outputs.get((label, index))
        if skeleton is None:
            return out
        checked = self.create_proxy("call_function", OutputCheck(skeleton, label), (out,), {})
        return skeleton.rebuild(checked)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    @property
    def proxy_type(self) -> type:
        """The class of the proxies :meth:`proxy` makes."""
        return _Proxy

    def create_proxy(self, kind: str, target: Any, args: tuple, kwargs: dict, *rest: Any, **more: Any) -> fx.Proxy:
        # Autocast and inference mode are thread state fx does not record: an op recorded
        # inside a forward's own ``torch.autocast`` / ``inference_mode`` block would run
        # without it every call.
        own_thread = threading.get_ident() == self.thread
        if own_thread and self._thread_state() != self.thread_state:
            raise SideEffectDuringTrace(
                "enters torch.autocast or torch.inference_mode while running: a trace cannot record that, "
                "and the traced ops would run without it"
            )
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **more)
        if own_thread:
            self.ranks.note(proxy.node, kind, target, args, kwargs, self.root)
        if own_thread and kind == "call_function" and isinstance(target, BranchCall):
            # A @streamsched.branch function is a leaf call too: what it returns may be learned.
            label = leaf_label(proxy.node)
            assert label is not None
            return self._known_structure(label, proxy)
        return proxy

    @staticmethod
    def _thread_state() -> tuple:
        return autocast_state(), torch.is_inference_mode_enabled()

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        decided = self._decided
        if decided is not None:
            self._decided = None
            if decided[0] is m:
                return decided[1]
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        if self.opaque_types and type(m) in self.opaque_types:
            return True
        if is_branch_module(m):
            return True
        # A hooked module must run through its own __call__ at run time, where its hooks
        # fire on real tensors every call (traced through, they would fire once, here).
        if m is not self.model and has_hooks(m):
            return True
        # fx cannot trace a compiled module; its compiled code runs as one opaque task.
        if _is_compiled_module(m):
            return True
        if _extends_torch_leaf(type(m)):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def path_of_module(self, mod: torch.nn.Module) -> str:
        if mod is self.model:
            return ""
        return super().path_of_module(mod)

    def _installed(self, m: torch.nn.Module) -> bool:
        """Whether ``m`` is one of the model's modules (fx can name it). Asked of every
        module call the trace meets: fx's own table of paths, where it has one, answers
        with one lookup."""
        if self.submodule_paths:
            return m is self.model or m in self.submodule_paths
        try:
            self.path_of_module(m)
        except NameError:
            return False
        return True


class _Proxy(fx.Proxy):
    """fx's proxy, with item assignment (``x[:, :k] = 0``) recorded as an
    ``operator.setitem`` node: an in-place write the effect analysis orders; and with
    ``len`` and iteration of a traced shape whose length the ranks tell
    (``(*x.shape[:-1], -1, d)``: ``frontend.ranks``)."""

    def __len__(self) -> int:
        return _proxy_len(self)

    def __iter__(self) -> Any:
        return _proxy_iter(self, inspect.currentframe())

    # ``isinstance(y, torch.Tensor)`` asks ``y.__class__`` once ``type(y)`` says no.
    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: PLE0237
        return _class_seen(self, sys._getframe(1))

    def __getattr__(self, name: str) -> Any:
        _refuse_numpy(name, sys._getframe(1))
        if name == "ndim":
            rank = _known_rank(self)
            if rank is not None:
                return rank
        elif name == "dtype" and isinstance(self.tracer, _LeafTracer):
            # Fixed by an explicit cast (``x.to(torch.float32)``), or following from the
            # inputs' dtypes (the trace's key) and the parameters' (checked every call).
            dtype = self.tracer.ranks.dtype_of(self.node)
            if dtype is not None:
                _rely(self, "dtype", dtype)
                return dtype
        if not hasattr(torch.Tensor, name):
            return _foreign_attribute(self, name)
        return _Attribute(self, name)

    def __setitem__(self, index: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, index, value), {})

    # Assigning an attribute of a traced value (``outputs.pooler_output = proj(...)`` on
    # the ModelOutput an opaque submodule returned) would land on this proxy object
    # only: the traced code would read the new value back, but the object returned at
    # run time would keep its old attribute. fx has no node for it, so it cannot be
    # traced (the module doing it runs as written).
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PROXY_OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
            return
        raise SideEffectDuringTrace(
            f"assigns attribute '{name}' of a value computed in forward (a module output's field?): "
            "the trace cannot record that"
        )

    def __delattr__(self, name: str) -> None:
        raise SideEffectDuringTrace(
            f"deletes attribute '{name}' of a value computed in forward: the trace cannot record that"
        )


# What fx's Proxy sets on itself.
_PROXY_OWN_ATTRIBUTES = frozenset({"tracer", "node"})


class _Attribute(fx.proxy.Attribute):
    """fx's lazy attribute proxy (``x.shape``), with the same ``len`` and iteration; and
    ``x.dim()`` of a value of known rank answered with the rank."""

    def __len__(self) -> int:
        return _proxy_len(self)

    def __iter__(self) -> Any:
        return _proxy_iter(self, inspect.currentframe())

    def __getattr__(self, name: str) -> Any:
        _refuse_numpy(name, sys._getframe(1))
        return super().__getattr__(name)

    # ``isinstance(x.shape, torch.Size)``: see ``_Proxy.__class__``.
    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: PLE0237
        return _attribute_class_seen(self, sys._getframe(1))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.attr in ("dim", "ndimension") and not args and not kwargs:
            rank = _known_rank(self.root)
            if rank is not None:
                return rank
        return super().__call__(*args, **kwargs)


def _asked_by_model_code(tracer: Any, caller: Any) -> bool:
    """Whether a traced value's ``__class__`` is asked by an ``isinstance(...)`` written
    in the model's code, the frame ``caller`` running it, while ``tracer`` (the value's)
    traces on this thread.

    Only such a call may be told the class of what the value stands for: torch's C
    argument parser asks ``__class__`` too (a tensor check), and takes an object it is
    told is a tensor for one (``torch.pow(y, 3.0)`` read a proxy as a tensor's memory and
    crashed the process). The call ``caller`` is running must be the builtin
    ``isinstance`` by its name (``_isinstance_sites``); anything else sees the proxy."""
    if caller is None or not isinstance(tracer, _LeafTracer) or threading.get_ident() != tracer.thread:
        return False
    # ``nn.Parameter``'s instance check (Python: ``isinstance``, then ``type``'s own
    # check through ``super()``) asks for the ``isinstance`` that called it.
    in_parameter_check = caller.f_code.co_name == "__instancecheck__" and (
        caller.f_globals.get("__name__") == "torch.nn.parameter"
    )
    if not in_parameter_check and caller.f_lasti not in _isinstance_sites(caller.f_code):
        return False
    return _model_code(caller)


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


@functools.lru_cache(maxsize=4096)
def _isinstance_sites(code: types.CodeType) -> frozenset[int]:
    """The offsets of the calls in ``code`` whose callable is the builtin ``isinstance``,
    loaded by its name: from each such load, the stack is followed (straight-line code
    only) to the call that consumes it."""
    sites = set()
    instructions = list(dis.get_instructions(code))
    for i, load in enumerate(instructions):
        if load.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or load.argval != "isinstance":
            continue
        depth = 0  # values pushed above the callable since
        later = instructions[i + 1 :]
        for k, ins in enumerate(later):
            if ins.is_jump_target or ins.opcode in _JUMPS:
                break
            # A call is PRECALL then CALL (3.11) or CALL alone (3.12): asked where it starts.
            starts = ins.opname == "PRECALL" or (ins.opname == "CALL" and (k == 0 or later[k - 1].opname != "PRECALL"))
            if starts and depth == ins.arg:
                sites.update(c.offset for c in later[k : k + 2] if c.opname in ("PRECALL", "CALL"))
                break
            depth += dis.stack_effect(ins.opcode, ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None)
            if depth < 0:
                break
    return frozenset(sites)


def _model_code(caller: Any) -> bool:
    """Whether the frame ``caller`` is the model's code: any but torch's, streamsched's
    (which handle traced values as such) and Python's own library (``dataclasses``
    asking whether a value is a class, for one), asking through ``nn.Parameter``'s
    instance check and ``torch.is_tensor``, which ask for their caller."""
    while caller is not None:
        module = caller.f_globals.get("__name__", "")
        if module == "torch.nn.parameter" or (module == "torch" and caller.f_code.co_name == "is_tensor"):
            caller = caller.f_back
            continue
        top = module.partition(".")[0]
        return top not in _NOT_MODEL_CODE and top not in sys.stdlib_module_names
    return False


_NOT_MODEL_CODE = frozenset({"torch", "streamsched", ""})


def _class_seen(proxy: _Proxy, caller: Any) -> type:
    """The class ``isinstance`` sees for ``proxy`` in the frame ``caller``.

    To fx a traced value is a ``Proxy``, no tensor: ``isinstance(y, torch.Tensor)`` and
    ``torch.is_tensor(y)`` are False while tracing, where the code as written takes the
    other path, and the plan computes something else, silently. An ``isinstance`` in the
    model's code (``_asked_by_model_code``) sees the class of the value it stands for: a
    parameter's or buffer's own, ``int`` for a size read from a shape, and
    ``torch.Tensor`` for any other value, relied on (``rank_checks``: the recording call
    checks the value's class, and a call whose value is of another, a tuple an opaque
    call returned, say, runs as written). ``type(y)`` cannot be answered so:
    ``type(y) is torch.Tensor`` stays False while tracing."""
    tracer = proxy.tracer
    if not _asked_by_model_code(tracer, caller):
        return type(proxy)
    node = proxy.node
    if node.op == "get_attr":
        held = _held_tensor(tracer, node.target)
        if held is not None:
            return type(held)
    # A size read from a shape is an int on every call; anything else is taken for a
    # tensor, and the recording call checks it.
    seen = int if node in tracer.ranks.sizes else torch.Tensor
    rely_on(node, "class", seen)
    return seen


def _attribute_class_seen(attribute: _Attribute, caller: Any) -> type:
    """The class ``isinstance`` sees for ``attribute`` (``x.shape``, ``x.device``,
    ``x.T``) in the frame ``caller``: in the model's code, the class a tensor's attribute
    of that name has (``torch.Tensor`` for a name a tensor lacks: an opaque value's
    field), relied on (the attribute read at once, as a node, and its class checked by
    the recording call, as in ``_class_seen``)."""
    tracer = attribute.tracer
    if not _asked_by_model_code(tracer, caller):
        return type(attribute)
    seen = _TENSOR_ATTRIBUTE_CLASSES.get(attribute.attr, torch.Tensor)
    rely_on(attribute.node, "class", seen)
    return seen


def _tensor_attribute_classes() -> dict[str, type]:
    """The class of each public data attribute of a tensor (``shape``: ``torch.Size``,
    ``device``: ``torch.device``, ``T``: ``torch.Tensor``, ``is_cuda``: ``bool``...);
    not the methods, nor those that may be ``None`` (``grad``, ``grad_fn``). Made at
    import: while tracing, torch's factories make traced values."""
    sample = torch.zeros(1, 1)
    classes = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in dir(torch.Tensor):
            if name.startswith("_"):
                continue
            try:
                value = getattr(sample, name)
            except Exception:  # noqa: BLE001 - an attribute a CPU tensor cannot give
                continue
            if value is not None and not callable(value):
                classes[name] = type(value)
    return classes


_TENSOR_ATTRIBUTE_CLASSES = _tensor_attribute_classes()


def _held_tensor(tracer: _LeafTracer, target: str) -> Optional[torch.Tensor]:
    """The parameter, buffer or tensor attribute at ``target``, read from the modules'
    own tables (attribute access on a module answers with a proxy while tracing)."""
    value = tracer.ranks.attribute(tracer.root, target)
    return value if isinstance(value, torch.Tensor) else None


def _foreign_attribute(proxy: _Proxy, name: str) -> Any:
    """``proxy.name`` where a tensor has no ``name``.

    fx answers every attribute of a traced value with a lazy proxy, so ``hasattr(x,
    "jax")`` holds and ``getattr(x, "jax", None)`` is not None while tracing, where the
    code as written takes the other path: the trace would compute something else,
    silently. A value the ranks know for a tensor (its rank relied on, checked on the
    recording call) answers as a tensor does, with an ``AttributeError``. Of any other
    value the attribute is read at once, as a node of the graph: the recording call reads
    it from the real value, and one that lacks it fails that call, which then runs as
    written (``new_signatures``)."""
    tracer = proxy.tracer
    ours = isinstance(tracer, _LeafTracer)
    held = _held_tensor(tracer, proxy.node.target) if ours and proxy.node.op == "get_attr" else None
    if held is not None:
        # A parameter's or buffer's own attribute: absent as it is absent from the
        # tensor; ``_is_param`` (which ``nn.Parameter``'s instance check reads, and
        # torch alone sets) as it is; any other read on every call, as a node.
        if not hasattr(held, name):
            raise AttributeError(f"'{type(held).__name__}' object has no attribute '{name}'")
        if name == "_is_param":
            return held._is_param
    else:
        rank = tracer.ranks.rank_of(proxy.node) if ours else None
        if rank is not None:
            _rely(proxy, "rank", rank)
            raise AttributeError(f"'Tensor' object has no attribute '{name}'")
        if (node_meta.relied(proxy.node) or {}).get("class") is torch.Tensor:  # taken for one: ``_class_seen``
            raise AttributeError(f"'Tensor' object has no attribute '{name}'")
    attribute = _Attribute(proxy, name)
    attribute.node  # noqa: B018 - made now, not where the value is first used (never, after hasattr)
    return attribute


class NumpyOnTracedValue(TypeError):
    """numpy was given a traced value (see :func:`_refuse_numpy`)."""


def _refuse_numpy(name: str, caller: Any) -> None:
    """numpy's functions that have a method of the same name (``np.prod``, ``np.sum``,
    ``np.round``, ``np.clip``...) call that method of whatever they are given when it is
    not an array: ``np.prod(x.shape[1:])`` would be recorded as ``.prod()`` of the shape,
    which a ``torch.Size`` (or an ``int``, a ``float``) does not have at run time, where
    eager computes the product. numpy reading an attribute of a traced value is refused
    like any code the trace cannot follow: the module doing it runs as written."""
    module = caller.f_globals.get("__name__", "") if caller is not None else ""
    if module == "numpy" or module.startswith("numpy."):
        raise NumpyOnTracedValue(
            f"numpy's {caller.f_code.co_name}() reads '.{name}' of a traced value: numpy computes on the value "
            "itself (a shape's product, a number's rounding), which the trace cannot record"
        )


def _known_rank(proxy: Any) -> Optional[int]:
    """The rank of a traced tensor where the ranks tell it (``frontend.ranks``): the
    trace holds only for calls whose inputs have the ranks it was made for, and the
    ranks tracked follow from those alone, so the number may be baked into the trace."""
    if not isinstance(proxy, fx.Proxy) or not isinstance(proxy.tracer, _LeafTracer):
        return None
    rank = proxy.tracer.ranks.rank_of(proxy.node)
    if rank is not None:
        _rely(proxy, "rank", rank)
    return rank


def _rely(proxy: fx.Proxy, kind: str, number: Any) -> None:
    """The trace used ``proxy``'s rank, length or dtype: checked on the recording call
    (``frontend.rank_checks``), and what it rests on on every call."""
    rely_on(proxy.node, kind, number)
    proxy.tracer.ranks.relied(proxy.node, kind)


def _proxy_len(proxy: fx.Proxy) -> int:
    n = proxy.tracer.ranks.length(proxy.node) if isinstance(proxy.tracer, _LeafTracer) else None
    if n is None:
        return fx.Proxy.__len__(proxy)
    _rely(proxy, "length", n)
    return n


def _proxy_iter(proxy: fx.Proxy, frame: Any) -> Any:
    n = proxy.tracer.ranks.length(proxy.node) if isinstance(proxy.tracer, _LeafTracer) else None
    if n is not None:
        _rely(proxy, "length", n)
        return iter([proxy[i] for i in range(n)])
    # fx's own rule, read in the frame calling ``__iter__`` (fx reads the frame calling
    # its own): ``a, b = proxy`` unpacks, anything else fails.
    caller = frame.f_back if frame is not None else None
    if caller is not None:
        offset = caller.f_lasti
        for ins in dis.get_instructions(caller.f_code):
            if ins.offset == offset:
                if ins.opname == "UNPACK_SEQUENCE":
                    return iter([proxy[i] for i in range(ins.argval)])
                break
    return proxy.tracer.iter(proxy)


# ``x += 1`` on a tensor writes it in place (the caller's tensor too, when x is an
# argument); fx's proxy has no in-place operators, so Python would record an
# out-of-place ``add`` and the write would be lost. Record ``operator.iadd`` & co.: at
# run time they act exactly as the statement does (in place for tensors, rebinding for
# numbers).
def _inplace_operator(op: Any) -> Any:
    def method(self: _Proxy, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


for _op in AUGMENTED_OPERATORS:
    setattr(_Proxy, f"__{_op.__name__}__", _inplace_operator(_op))

# Proxies whose arguments fx_fast converts itself (each becomes its node, as in fx).
_LeafTracer.fast_proxy_types = (fx.Proxy, fx.proxy.Attribute, _Proxy, _Attribute)


@dataclass
class Traced:
    """One trace of a model for one call structure.

    ``root`` resolves ``get_attr`` and ``call_module`` targets (it shares the model's
    submodules); ``input_names`` name the graph's placeholders in order. The graph
    returns the output's leaves as a flat tuple; ``output_tree`` rebuilds the model's own
    output container from them. ``opaque`` names the module classes made opaque because
    tracing them failed, with the reason.
    """

    graph: fx.Graph
    root: torch.nn.Module
    model: torch.nn.Module
    spec: CallSpec
    input_names: list[str]
    module_ids: dict[str, int] = field(default_factory=dict)
    structure: tuple = ()
    output_tree: Optional[OutputTree] = None
    opaque: dict[str, str] = field(default_factory=dict)
    opaque_functions: dict[str, str] = field(default_factory=dict)
    """Functions run as one opaque call each because tracing them failed: name -> reason."""
    flags: tuple = ()
    leaf_types: tuple = ()
    """The ``leaf_types`` it was traced with (a re-trace uses them again)."""
    known_outputs: dict = field(default_factory=dict, compare=False, repr=False)
    """What the trace took each opaque call it knew of to return: ``(label, index) ->
    skeleton``, learned for its call structure or guessed from another's
    (``opaque_outputs.learned_with_guesses``)."""
    inlined_leaf_calls: int = 0
    """Calls of childless modules the trace went through (their operations are graph
    nodes): leaf-module calls for ``Plan.coverage`` (``frontend.leafcalls``)."""
    ranks: Optional[tuple[int, ...]] = None
    """The ranks of the graph inputs the trace was made for (``frontend.ranks``)."""
    dtypes: Optional[tuple[torch.dtype, ...]] = None
    """The dtypes of the graph inputs the trace was made for (``frontend.ranks``)."""
    dtype_guards: tuple = ()
    """(module, name, dtype) of each parameter or buffer whose dtype the trace relied on
    (a dtype computed from it answered ``x.dtype``, a rank rested on it), and (module,
    name, rank) of each tensor attribute whose rank it relied on: the trace holds only
    while each still has that dtype or rank (:meth:`dtypes_hold`, asked on every call)."""
    baked: tuple = ()
    """The tensors that existed before the trace from which it computed constants (a
    module's plain tensor attribute's ``.sum()``): guarded by version and place
    (``dtype_guards``), and never taken into a fused stack (``FusionContext.views_held``)."""
    in_place: tuple = ()
    """``(module, inplace)`` of each module the graph calls that has an ``inplace`` flag
    (``ReLU``, ``Dropout``, ...): the recording call saw which of them write their input,
    and the plan's effects rest on it (:meth:`in_place_unchanged`)."""
    traced_program: Optional[tuple] = None
    """``(graph, program text)`` of the graph as traced, held before the recording call
    added checks of what leaf calls returned (``opaque_outputs.check_recorded_structures``):
    :meth:`same_program` compares a re-trace with the program as traced."""
    resolver: Optional[tuple] = field(default=None, compare=False, repr=False)
    """``(generation, resolver)``: the module paths the trace resolved
    (:func:`~streamsched.frontend.nodes.submodule_resolver` of ``root``) and the
    generation they were resolved at, for the call that traced it to go on with (taken
    by its recording call, see ``new_signatures.compile_signature``)."""

    @functools.cached_property
    def runs_models_code(self) -> bool:
        """Whether a call of the graph runs Python of the model's beyond torch's own: a
        module of a class defined outside torch (an opaque or hooked module), a module
        holding hooks, or a function from outside torch (a ``@streamsched.branch``). Such
        code may assign an attribute the trace baked in, during the call (a hook counting
        calls), where a traced call would read the value as it was before the call."""
        library_classes: set[type] = set()  # (each class's origin read once: 1,000 alike members)
        for node in self.graph.nodes:
            if node.op == "call_module":
                try:
                    # (Inside the recording call's ``resolving_submodules``: a lookup.)
                    module = submodule(self.root, node.target)
                except AttributeError:
                    return True
                cls = type(module)
                if cls not in library_classes:
                    if _models_code(cls):
                        return True
                    library_classes.add(cls)
                if has_hooks(module):
                    return True
            elif node.op == "call_function" and _models_code(node.target):
                return True
        return False

    def hold_traced_program(self) -> None:
        """Hold the program text of the graph as it is now (before checks are added)."""
        if self.traced_program is None or self.traced_program[0] is not self.graph:
            self.traced_program = (self.graph, self.graph.python_code("self").src)

    def program_text(self) -> str:
        """The program as traced (without the checks the recording call added)."""
        held = self.traced_program
        if held is not None and held[0] is self.graph:
            return held[1]
        return self.graph.python_code("self").src

    def dtypes_hold(self) -> bool:
        """Whether every parameter or buffer whose dtype the trace relied on still has
        it (a submodule cast on its own after tracing: ``model.encoder.half()``), and
        every tensor attribute whose rank it relied on that rank."""
        for owner, name, expected in self.dtype_guards:
            if type(expected) is GlobalValue:
                if not expected.holds(owner):
                    return False
                continue
            tensor = _guarded_table(owner, name).get(name)
            if not isinstance(tensor, torch.Tensor) or not _holds(tensor, expected):
                return False
        return True

    def relearn(self, node: fx.Node, value: Any) -> None:
        """The recording call found leaf call ``node`` returning ``value``, which the
        traced code read as a tensor (``frontend.opaque_outputs``): learn its structure
        and trace again, replacing this trace's graph and everything derived from it in
        place. Raises :class:`TraceError` where ``value`` has no structure a trace can
        stand in for."""
        skeleton = skeleton_of(value)
        label = leaf_label(node)
        assert label is not None, node
        if skeleton is None:
            raise TraceError(
                f"'{label}' (an opaque call) returned a {type(value).__name__} holding a None or a constant where the "
                "traced code reads a tensor: the trace took a branch eager does not. Make the module reading it a "
                "@streamsched.branch or list its class in leaf_modules=, so that it runs as written."
            )
        index = 0  # which call of that module, in trace order (as the tracer counts them)
        for n in self.graph.nodes:
            if n is node:
                break
            index += leaf_label(n) == label
        key = _learned_key(self.model, self.spec, self.ranks, self.dtypes)
        before = self.known_outputs.get((label, index))  # what this trace took it for, guessed or learned
        learn(self.model, key, label, index, skeleton)
        fresh = trace_model(
            self.model, self.root._streamsched_binder, self.spec, self.leaf_types, self.ranks, self.dtypes
        )
        # The same program is progress where the call had a structure learned before: the
        # program text does not show what a check of it expects (a None learned earlier
        # is a tensor now, and nothing reads it: only the check changed).
        if self.same_program(fresh) and (before is None or before.shape == skeleton.shape):
            raise TraceError(f"'{label}': learning what it returns ({skeleton.shape}) did not change the trace")
        self.graph, self.root, self.input_names = fresh.graph, fresh.root, fresh.input_names
        self.module_ids, self.structure, self.output_tree = fresh.module_ids, fresh.structure, fresh.output_tree
        self.opaque, self.flags, self.in_place = fresh.opaque, fresh.flags, fresh.in_place
        self.opaque_functions = fresh.opaque_functions
        self.known_outputs = fresh.known_outputs
        self.inlined_leaf_calls = fresh.inlined_leaf_calls
        self.dtype_guards = fresh.dtype_guards
        self.baked = fresh.baked
        self.__dict__.pop("runs_models_code", None)  # (a property of the graph replaced)
        self.root.__dict__["_streamsched_traced"] = weakref.ref(self)

    def modules_unchanged(self) -> bool:
        """Whether the model still has exactly the modules it had when traced (same
        objects at the same paths): an added, removed or replaced module means the
        forward may take another path, so the trace is stale."""
        for path, ident in self.module_ids.items():
            try:
                mod = self.model.get_submodule(path) if path else self.model
            except AttributeError:
                return False
            if id(mod) != ident:
                return False
        return _structure(self.model) == self.structure

    def in_place_unchanged(self) -> bool:
        """Whether every module the graph calls still writes its input in place exactly
        when it did on the recording call: one made in place since (``act.inplace =
        True``) would write a value the plan hands out as a view of a fused kernel's
        output, or shares with another reader, unordered."""
        return all(m.inplace is flag for m, flag in self.in_place)

    def flags_unchanged(self) -> bool:
        """Whether every traced-through module still has the plain attribute values it had
        when traced (``drop_prob``, ``use_cache``, ``window = (1, 2)``, ...), and every
        object those modules hold (a ``config``) the plain attributes it had. A changed one
        *may* have been baked into the trace: :meth:`same_program` tells."""
        return all(_flag_values(module) == values for module, values in self.flags)

    def changed_flags(self) -> list[str]:
        """``Class.name`` of each plain attribute :meth:`flags_unchanged` finds changed."""
        changed = []
        for owner, values in self.flags:
            now = dict(_flag_values(owner))
            for name, value in values:
                if name not in now or now[name] != value:
                    changed.append(f"{type(owner).__name__}.{name}")
        return changed

    def same_program(self, other: Traced) -> bool:
        """Whether ``other`` (a re-trace) records exactly this trace's program, and
        rebuilds the same output from it: the graph returns the output's leaves, and the
        container they go back into (``output_tree``) is not in the program text."""
        if self.program_text() != other.program_text():
            return False
        if self.output_tree is None or other.output_tree is None:
            return self.output_tree is other.output_tree
        return self.output_tree.same_structure(other.output_tree)

    def opaque_paths(self) -> dict[str, str]:
        """Each module call that runs opaque because its class could not be traced: path -> reason."""
        out: dict[str, str] = {}
        if not self.opaque:
            return out
        for node in self.graph.nodes:
            if node.op == "call_module":
                mod = self.root.get_submodule(node.target)
                reason = self.opaque.get(_type_name(type(mod)))
                if reason is not None:
                    out[str(node.target)] = reason
        return out


_FLAG_TYPES = (bool, int, float, str, type(None))


def _flag_values(owner: Any) -> tuple:
    """The plain attributes of a module (what a traced ``if self.x:`` or ``self.window[0]``
    can read: scalars, and tuples and other plain values, ``binder.is_plain``), or of an
    object a module holds (``self.config.x``, its ``__slots__`` too); ``training`` excluded
    (every module's flag is part of the plan key). An object it holds
    (``trace_guard.holds_state``: ``self.config``, ``self.config.sub``) stands as itself,
    compared by identity: replaced (a frozen dataclass by ``dataclasses.replace``), it may
    hold other values."""
    items = owner.__dict__ if isinstance(owner, torch.nn.Module) else object_items(owner)
    values = []
    for k, v in items.items():
        if k == "training" or k[:2] == "__":
            continue
        kind = type(v)
        if kind in _FLAG_TYPES or (kind not in _NOT_FLAG_TYPES and is_plain(v)):
            values.append((k, v))
        elif (k == "forward" and not getattr(v, "enters_wrapper", False)) or (
            kind not in _NOT_FLAG_TYPES and not k.startswith("_streamsched") and (holds_state(v) or kind in _CALLABLES)
        ):
            # (A partial or bound method the forward calls, or an instance's own forward,
            # which nn.Module.__call__ runs instead of its class's: replaced or deleted,
            # the module computes otherwise.)
            values.append((k, _Same(v)))
    return tuple(values)


class _Same:
    """An object a flag tuple holds: equal to another only when it wraps the same object."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: Any) -> bool:
        return type(other) is _Same and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class _Cell:
    """A closure's cell as a guard reads a namespace (``get``)."""

    __slots__ = ("cell",)

    def __init__(self, cell: Any):
        self.cell = cell

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:
            return default


class _Attributes:
    """An object's attributes as a guard reads a namespace (``get``), its ``__slots__``
    included: where assigning them cannot be seen, :class:`GlobalValue` guards compare
    them on every call."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self.obj, name, default)


_CALLABLES = (functools.partial, types.MethodType)


# Where code that cannot assign a model's attributes comes from: torch, and the
# operators and builtins traced code calls.
_LIBRARY_PREFIXES = ("torch", "_operator", "operator", "builtins", "math")


def _models_code(target: Any) -> bool:
    """Whether ``target`` (a class or a function) is defined outside torch and the
    standard operators (``frontend.trace.Traced.runs_models_code``)."""
    origin = getattr(target, "__module__", None)
    if not isinstance(origin, str):
        return False  # a builtin method or operator
    return not any(origin == p or origin.startswith(p + ".") for p in _LIBRARY_PREFIXES)


def _in_place_flags(graph: fx.Graph, resolve: Callable[[str], Any]) -> tuple:
    """``(module, inplace)`` of each module ``graph`` calls that has a bool ``inplace``
    flag, each once; its name is watched (setting it moves the generation)."""
    seen: dict[int, tuple] = {}
    plain_lookup: dict[type, bool] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            m = resolve(node.target)
            cls = type(m)
            plain = plain_lookup.get(cls)
            if plain is None:
                plain = plain_lookup[cls] = _instance_attribute_only(cls, "inplace")
            # (Where only the instance can hold the name, its __dict__ answers: a getattr
            # that misses raises and catches an AttributeError in nn.Module.__getattr__,
            # which for thousands of Linears was most of this walk.)
            flag = m.__dict__.get("inplace") if plain else getattr(m, "inplace", None)
            if isinstance(flag, bool) and id(m) not in seen:
                seen[id(m)] = (m, flag)
    if seen:
        _generation.watch(("inplace",))
    return tuple(seen.values())


def _instance_attribute_only(cls: type, name: str) -> bool:
    """Whether ``getattr(m, name)`` of a ``cls`` instance finds a bool only in the
    instance's ``__dict__``: no class attribute or property of that name, and torch's own
    attribute lookup (``nn.Module.__getattr__`` finds parameters, buffers and modules,
    none of them a bool)."""
    return (
        not hasattr(cls, name)
        and cls.__getattr__ is torch.nn.Module.__getattr__  # type: ignore[attr-defined]
        and cls.__getattribute__ is object.__getattribute__
    )


# What a module's __dict__ mostly holds besides flags (its registries and hook tables):
# answered without asking is_plain.
_NOT_FLAG_TYPES = frozenset({dict, OrderedDict, list, set})


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def is_compiled_module(m: Any) -> bool:
    """Whether ``m`` is a ``torch.compile`` wrapper (``OptimizedModule``). Imports nothing:
    a compiled module exists only once ``torch._dynamo`` is loaded."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(m, optimized)


_TORCH_CONTAINERS = (
    torch.nn.Module,
    torch.nn.Sequential,
    torch.nn.ModuleList,
    torch.nn.ModuleDict,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)


@functools.cache
def _extends_torch_leaf(cls: type) -> bool:
    """Whether ``cls``, defined outside ``torch.nn``, subclasses a ``torch.nn`` module that
    fx keeps as a leaf (``BatchNorm2d``, ``Linear``, ``LayerNorm``...; not a container).
    Such a subclass (timm's ``BatchNormAct2d``) is a leaf as its base is: one module call,
    which fusion batches across members with ``vmap`` over the member's own code. Traced
    through, its base's forward becomes functional calls no group can batch, and whether
    that forward traces at all hangs on checks like ``input.dim()``.

    Not ``nn.Embedding`` subclasses: transformers' learned positional embeddings (BART's,
    Whisper's) are ``nn.Embedding`` subclasses whose forward computes positions from the
    input's shape; traced, their value's rank is known (``frontend.ranks``) and the code
    reading its shape traces, where a leaf's value has no rank and makes its caller
    opaque."""
    if cls.__module__.startswith(("torch.nn", "torch.ao.nn")) or issubclass(cls, torch.nn.Embedding):
        return False
    for base in cls.__mro__[1:]:
        if base.__module__.startswith(("torch.nn", "torch.ao.nn")):
            return base not in _TORCH_CONTAINERS
    return False


def _is_compiled_module(m: torch.nn.Module) -> bool:
    # Asked of every module call while tracing: a lookup, not an import statement.
    return is_compiled_module(m)


def _placeholder_names(binder: CallBinder, spec: CallSpec) -> list[str]:
    # Name each graph input after the forward parameter it came from.
    names = []
    leaves = [None] * spec.treedef.num_leaves
    for pos in spec.tensor_positions:
        leaves[pos] = pos
    per_arg = pytree.tree_unflatten(leaves, spec.treedef)
    for pname, sub in per_arg.items():
        positions = [p for p in pytree.tree_leaves(sub) if p is not None]
        if len(positions) == 1 and isinstance(sub, int):
            names.append(pname)
        else:
            names.extend(f"{pname}_{k}" for k in range(len(positions)))
    return names


def _make_forward(n_inputs: int, names: list[str]):
    # fx reads the arity of the traced forward from its code object, so the function is
    # generated with one named parameter per graph input.
    safe = [f"{''.join(c if c.isalnum() else '_' for c in n)}_{i}" for i, n in enumerate(names)]
    src = (
        f"def forward(self, {', '.join(safe)}):\n"
        f"    return _call_model(self, ({', '.join(safe)}{',' if safe else ''}))\n"
    )
    namespace: dict[str, Any] = {"_call_model": _call_model}
    exec(compile(src, "<streamsched-trace-root>", "exec"), namespace)
    return namespace["forward"]


def _call_model(root: _TraceRoot, inputs: tuple) -> Any:
    binder: CallBinder = root._streamsched_binder
    spec: CallSpec = root._streamsched_spec
    leaves: list[Any] = [None] * spec.treedef.num_leaves
    for pos, value in spec.static_leaves:
        leaves[pos] = value
    for pos, value in zip(spec.tensor_positions, inputs):
        leaves[pos] = value
    args, kwargs = binder.rebuild(leaves, spec)
    model = root._streamsched_model
    held = _containers_held((*args, *kwargs.values()))
    out = type(model).forward(model, *args, **kwargs)
    _refuse_changed_containers(model, held)
    held_state = root.__dict__.get("_streamsched_held_state")
    if held_state is not None:
        held_state.refuse_changes(root=True)
    # The graph returns the output's leaves; the container is rebuilt per call, with the
    # model's own types (fx would turn dicts into immutable_dict and drop dataclasses).
    tree = OutputTree.of(out)
    for custom in tree.custom_attrs():
        if any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves(custom)):
            raise TypeError(
                f"the output's {type(out).__name__} keeps graph values in instance attributes outside its fields; "
                "it cannot be rebuilt from the traced values"
            )
    root.__dict__["_streamsched_output_tree"] = tree
    return tree.leaves[0] if tree.is_plain else tuple(tree.leaves)


def _containers_held(values: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Every list and dict among ``values`` (the arguments handed to the traced forward,
    and the containers inside them), each with a copy of what it holds."""
    held: list[tuple[Any, Any]] = []
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            held.append((value, list(value)))
            stack.extend(value)
        elif isinstance(value, dict):
            held.append((value, dict(value)))
            stack.extend(value.values())
        elif isinstance(value, tuple):
            stack.extend(value)
    return held


def _refuse_changed_containers(model: torch.nn.Module, held: list[tuple[Any, Any]]) -> None:
    """Raise :class:`SideEffectDuringTrace` if the forward changed a list or dict it was
    passed (an append to a cache of past outputs, a key stored). The traced forward is
    handed containers rebuilt from the call's leaves: the change would happen once, while
    tracing, to a container the caller never sees, and the graph would read what it held
    then on every call. Such a forward runs as written, where the caller's own containers
    change as in eager."""
    for container, before in held:
        if isinstance(container, list):
            same = len(container) == len(before) and all(a is b for a, b in zip(container, before))
        else:
            same = container.keys() == before.keys() and all(container[k] is v for k, v in before.items())
        if not same:
            raise SideEffectDuringTrace(
                f"{type(model).__name__}.forward changes a {type(container).__name__} it was passed as an "
                "argument: a Python side effect a trace would perform only once, on a copy the caller never sees"
            )


_MAX_OPAQUE_RETRIES = 64


def trace_model(
    model: torch.nn.Module,
    binder: CallBinder,
    spec: CallSpec,
    leaf_types: tuple[Any, ...] = (),
    ranks: Optional[Sequence[int]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
) -> Traced:
    """Trace ``model`` for calls shaped like ``spec``.

    ``leaf_types`` holds module types and functions to keep opaque. When tracing fails
    inside a plain function a traced forward calls by name, that function becomes one
    opaque call (``frontend.opaque_functions``); otherwise, when it fails inside a
    submodule, that submodule's class is made opaque; either way the trace is retried.
    Raises :class:`TraceError` (naming module, file and line) when the model's own
    ``forward`` does something ``torch.fx`` cannot record. ``ranks`` are the ranks of the
    call's tensors, in order, where known: a traced shape of known rank then has a length
    (``frontend.ranks``), and the trace holds only for calls with those ranks. ``dtypes``
    likewise: the dtypes of the call's tensors, from which (with the parameters') those of
    its values follow; the trace holds only for calls with those dtypes (and while
    :meth:`Traced.dtypes_hold`).
    """
    module_types = tuple(t for t in leaf_types if isinstance(t, type)) + _registered_leaf_types()
    functions = tuple(f for f in leaf_types if not isinstance(f, type)) + _registered_leaf_functions()
    ranks = tuple(ranks) if ranks is not None else None
    dtypes = tuple(dtypes) if dtypes is not None else None
    # Classes made opaque: class -> reason; functions run as one opaque call: id ->
    # (namespace, name, function, reason); and functions refused (a call of one passed
    # an object a node cannot hold): id -> function. Started from what the retries of
    # this model's earlier traces found (``_RetriesFound``).
    hint_key = (module_types, functions, _generation.current())
    opaque, sites, refused = _RETRIES_FOUND.start(model, hint_key)
    key = _learned_key(model, spec, ranks, dtypes)
    own = learned(model, key)
    known = learned_with_guesses(model, key)
    guessed = len(known) > len(own)
    try:
        while True:
            try:
                traced = _trace_once(
                    model, binder, spec, module_types, functions, opaque, known, sites, set(refused), ranks, dtypes
                )
                traced.leaf_types = tuple(leaf_types)
                traced.known_outputs = known
                return traced
            except _OpaqueRetry as retry:
                _retry_once_more(retry, opaque, sites, refused)
            except Exception:
                if not guessed:
                    raise
                # What another call structure's opaque call returned may be what failed
                # (code reading a tensor where the guess gave a tuple): the trace is
                # made again with no guess.
                known, guessed = own, False
    finally:
        _RETRIES_FOUND.keep(model, hint_key, opaque, sites, refused)


def _retry_once_more(retry: _OpaqueRetry, opaque: dict, sites: dict, refused: dict) -> None:
    """Note what ``retry`` asks for (a class made opaque, a function site taken or
    refused) for the next attempt, or raise its error where that was tried already."""
    if len(opaque) + len(sites) + len(refused) >= _MAX_OPAQUE_RETRIES:
        raise retry.error from retry.error.__cause__
    if retry.refuse is not None:
        if id(retry.refuse) in refused:
            raise retry.error from retry.error.__cause__
        refused[id(retry.refuse)] = retry.refuse
        sites.pop(id(retry.refuse), None)
    elif retry.site is not None:
        namespace, name, fn = retry.site
        if id(fn) in sites:  # taken already, and the trace failed there again
            raise retry.error from retry.error.__cause__
        sites[id(fn)] = (namespace, name, fn, retry.reason)
    else:
        if retry.cls in opaque:
            raise retry.error from retry.error.__cause__
        opaque[retry.cls] = retry.reason


class _RetriesFound:
    """What the retries of a model's traces found, for its next trace to start from.

    Each call structure (a mask passed or not, grad or not, other ranks) is traced on its
    own, and each trace met the same untraceable spots one attempt at a time: a language
    model's trace failed in its mask builder, then found the builder unsafe as an opaque
    call, then made its decoder opaque, four traces of the whole model for every call
    structure. A later trace of the model starts with those classes opaque and those
    functions taken or refused, and retries only what is new to it. Each answer only
    keeps more of the model as written (an opaque class runs its module as written, a
    refused function fails the trace into its caller), which is exact; an opaque function
    site is still checked on every call it makes (``opaque_functions``). Kept per model
    (weakly), for one set of leaf types and one generation of the model's modules
    (``_generation``): a submodule registered or swapped, or a flag a trace read set
    anew, starts afresh."""

    def __init__(self) -> None:
        self._found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def start(self, model: torch.nn.Module, key: Hashable) -> tuple[dict, dict, dict]:
        """Copies of what earlier traces of ``model`` found under ``key``: (opaque
        classes, function sites, refused functions); empty ones where none did."""
        with self._lock:
            found = self._found.get(model)
        if found is None or found[0] != key:
            return {}, {}, {}
        return dict(found[1]), dict(found[2]), dict(found[3])

    def keep(self, model: torch.nn.Module, key: Hashable, opaque: dict, sites: dict, refused: dict) -> None:
        if not (opaque or sites or refused):
            return
        with self._lock:
            self._found[model] = (key, dict(opaque), dict(sites), dict(refused))


_RETRIES_FOUND = _RetriesFound()


def _learned_key(
    model: torch.nn.Module,
    spec: CallSpec,
    ranks: Optional[tuple[int, ...]] = None,
    dtypes: Optional[tuple[torch.dtype, ...]] = None,
) -> Hashable:
    """What a learned opaque output holds for: one call structure (with its ranks and
    dtypes), in one train/eval state of every module and one autocast state (what a
    trace is made for)."""
    return (spec.key, ranks, dtypes, tuple([m.training for m in modules_of(model)]), autocast_state())


class _OpaqueRetry(Exception):
    def __init__(
        self,
        cls: Optional[type],
        reason: str,
        error: TraceError,
        site: Optional[tuple[dict, str, Any]] = None,
        refuse: Any = None,
    ):
        super().__init__(reason)
        self.cls = cls
        self.reason = reason
        self.error = error
        self.site = site
        self.refuse = refuse


def _trace_once(
    model: torch.nn.Module,
    binder: CallBinder,
    spec: CallSpec,
    module_types: tuple[type, ...],
    functions: tuple[Any, ...],
    opaque: dict[type, str],
    known: dict[tuple[str, int], Skeleton],
    sites: Optional[dict[int, tuple[dict, str, Any, str]]] = None,
    refused: frozenset[int] | set[int] = frozenset(),
    ranks: Optional[tuple[int, ...]] = None,
    dtypes: Optional[tuple[torch.dtype, ...]] = None,
) -> Traced:
    sites = sites or {}
    names = _placeholder_names(binder, spec)
    root_cls = type(
        f"{type(model).__name__}Trace",
        (_TraceRoot,),
        {"forward": _make_forward(len(names), names)},
    )
    root = root_cls(model)
    root.__dict__["_streamsched_binder"] = binder
    root.__dict__["_streamsched_spec"] = spec
    function_sites = [(namespace, name, fn) for namespace, name, fn, _ in sites.values()]
    tracer = _LeafTracer(module_types, model, functions, frozenset(opaque), known, function_sites, ranks, dtypes)
    # The model's modules, walked once for the snapshots taken before the trace runs.
    modules = modules_of(model)
    containers = snapshot_containers(model, modules)
    held_state = tracer.held_state = root.__dict__["_streamsched_held_state"] = HeldState(model, modules)
    # The objects the modules hold (before the globals' objects are noted too).
    held = held_state.objects()
    try:
        try:
            # The globals the code the trace may run names (data only), noted before it runs.
            for code, namespace in _static_code(modules, held).items():
                held_state.note_globals(namespace, _global_names(code))
            guard = TraceSideEffectGuard(model, root, modules, held)
            with guard, GradModeGuard(tracer), QueryRecorder() as queries:
                graph = tracer.trace(root)
        finally:
            tracer.held_state = root.__dict__["_streamsched_held_state"] = None  # (even if a restore raises)
            written = restore_containers(containers)
            held_state.restore()
        if written:
            # A forward stored into a container its module holds (a cache): that module
            # runs as written, where its cache holds what eager's would.
            module, name = written[0]
            exc = ContainerWrittenDuringTrace(
                f"stores into {type(module).__name__}.{name} (a {type(getattr(module, name)).__name__} it holds) "
                "while traced: the trace would leave a proxy there"
            )
            exc._streamsched_failed_in = module  # type: ignore[attr-defined]
            raise exc
        copy_fresh_constants(graph, root, guard.fresh)
        baked = tuple(guard.baked.values())
        fresh = guard.fresh
    except TraceError:
        raise
    except Exception as exc:  # fx raises many types; all mean "cannot trace"
        error = TraceError(_describe_trace_failure(model, tracer, exc))
        error.__cause__ = exc
        reason = f"{type(exc).__name__}: {_first_line(exc)}"
        if isinstance(exc, UnsafeOpaqueCall):
            raise _OpaqueRetry(None, reason, error, refuse=exc.fn) from None
        failed = getattr(exc, "_streamsched_failed_in", None)
        if not isinstance(exc, SideEffectDuringTrace):
            # A plain function below the failing forward: it alone runs as written.
            site = opaque_functions.candidate(exc, failed if failed is not None else model, {*refused, *sites})
            if site is not None:
                raise _OpaqueRetry(None, reason, error, site=site) from None
        if failed is not None and failed is not model:
            raise _OpaqueRetry(type(failed), reason, error) from None
        raise error from exc

    module_ids: dict[str, int] = {}
    resolve = submodule_resolver(root)
    stale = stale_held_read(graph, root, resolve, fresh, baked)
    if stale is not None:
        raise TraceError(f"streamsched cannot trace {type(model).__name__}.forward: {stale}")
    for node in graph.nodes:
        if node.op == "call_module":
            module_ids[node.target] = id(resolve(node.target))
        elif node.op == "call_function" and getattr(node.target, "owner", None) is not None:
            module_ids[node.target.owner_path] = id(node.target.owner)
    in_place = _in_place_flags(graph, resolve)
    modules = tuple(tracer.traced_through.values())
    flags = tuple((m, _flag_values(m)) for m in modules)
    _generation.watch(k for _, values in flags for k, _ in values)
    state_flags, state_guards = _python_state(modules)
    state_guards += _baked_guards(baked, modules)
    state_guards += _query_guards(queries.queries)
    flags += state_flags
    traced = Traced(
        graph,
        root,
        model,
        spec,
        names,
        module_ids,
        _structure(model),
        output_tree=root.__dict__.get("_streamsched_output_tree"),
        opaque={_type_name(cls): reason for cls, reason in opaque.items()},
        opaque_functions=_used_functions(graph, sites),
        flags=flags,
        in_place=in_place,
        inlined_leaf_calls=tracer.inlined_leaf_calls,
        ranks=ranks,
        dtypes=dtypes,
        dtype_guards=_assumptions(tracer.ranks.assumed) + state_guards,
        baked=baked,
    )
    traced.resolver = (_generation.current(), resolve)
    # The recording call re-traces through this where a leaf call misled the trace.
    root.__dict__["_streamsched_traced"] = weakref.ref(traced)
    return traced


_VERSION = ("_version", "_version")  # (a getter of one name returns no tuple)


class _TorchSettings:
    """The owner of the guards of the global torch settings a trace asked for
    (``state_queries``): its getters ask torch, not the owner."""

    __slots__ = ()


_TORCH_SETTINGS = _TorchSettings()


class _Ask:
    """A guard's getter that asks torch for a setting again (``(value,)``)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def __call__(self, owner: Any) -> tuple:
        return (self.fn(),)


def _query_guards(queries: dict[str, tuple[Callable[[], Any], Any]]) -> tuple:
    """A guard for each global torch setting the traced code asked for
    (``state_queries``): the trace holds while torch still answers the same."""
    return tuple(
        (_TORCH_SETTINGS, name, GlobalValue(name, (value,), getter=_Ask(fn), types=(type(value),)))
        for name, (fn, value) in queries.items()
    )


def _baked_guards(baked: Sequence[torch.Tensor], modules: Sequence[torch.nn.Module]) -> tuple:
    """Guards for the tensors the trace computed with as real tensors (``baked``: a
    module's plain tensor attribute, an item of a list it holds, a global), whose results
    it baked in as constants: each keeps its version (an in-place update, an optimizer
    step on the weight a view of it shows, moves it), and a module attribute holding one
    keeps holding it (a reassignment moves nothing the wrapper watches)."""
    guards: list[tuple] = []
    for t in baked:
        if t.is_inference():  # (no version counter)
            continue
        version = t._version
        guard = GlobalValue(_VERSION, (version, version), getter=operator.attrgetter(*_VERSION), types=(int, int))
        guards.append((t, _VERSION, guard))
    ids = {id(t) for t in baked}
    for m in modules:
        for k, v in m.__dict__.items():
            if id(v) in ids and isinstance(v, torch.Tensor):
                guards.append((m.__dict__, k, GlobalValue(k, v, same=True)))
    return tuple(guards)


def _guarded_table(owner: torch.nn.Module, name: str) -> dict:
    """Where ``owner`` holds its tensor attribute ``name``: its ``_parameters``, its
    ``_buffers`` or (a plain tensor attribute) its ``__dict__``."""
    if name in owner._parameters:
        return owner._parameters
    if name in owner._buffers:
        return owner._buffers
    return owner.__dict__


def _holds(tensor: torch.Tensor, expected: Any) -> bool:
    """A guard's expectation: a dtype, or a rank (an int)."""
    if type(expected) is int:
        return tensor.dim() == expected
    return tensor.dtype is expected


def dtype_probes(traces: Sequence[Traced]) -> tuple:
    """(table, name, expected) for each parameter or buffer whose dtype ``traces`` relied
    on (``expected``: that dtype) and each tensor attribute whose rank they relied on
    (that rank, an int), ``table`` being where its owner holds it now
    (:func:`_guarded_table`): what :func:`dtypes_same` compares on every call. The tensor
    is looked up in the table each time: a cast changes a parameter's dtype in place, and
    one put straight into the table (``torch.func.functional_call`` does so, moving no
    generation) is another tensor there; a re-registered one moves the generation, and
    the probes are made again."""
    probes: dict[tuple[int, str, Any], tuple] = {}
    for traced in traces:
        for owner, name, expected in traced.dtype_guards:
            if type(expected) is GlobalValue:
                where = (
                    id(owner.obj)
                    if type(owner) is _Attributes
                    else id(owner.cell)
                    if type(owner) is _Cell
                    else id(owner)
                )
                value = expected.value
                if expected.same or type(value) in _CONTAINERS or not _hashable(value):
                    value = id(value)
                probes[(where, name, value)] = (owner, name, expected)
                continue
            table = _guarded_table(owner, name)
            if isinstance(table.get(name), torch.Tensor):
                probes[(id(table), name, expected)] = (table, name, expected)
    return tuple(probes.values())


def dtypes_same(probes: tuple) -> bool:
    """Whether the tensor each probe (:func:`dtype_probes`) names still has its dtype
    (or rank)."""
    for table, name, expected in probes:
        if type(expected) is GlobalValue:
            if not expected.holds(table):
                return False
            continue
        tensor = table.get(name)
        if tensor is None:
            return False
        if type(expected) is int:
            if tensor.dim() != expected:
                return False
        elif tensor.dtype is not expected:
            return False
    return True


class GlobalValue:
    """What a trace expects of a module-level global that a traced forward read: the
    value it had (a flag, a number, a string, a tuple of such), which the trace baked in.
    A guard ``(globals, name, GlobalValue)`` holds while the name still has it.

    One guard may stand for several names of one owner (:func:`_grouped`): ``getter``
    (an ``operator.attrgetter`` or ``itemgetter`` of them all) reads them at once, and
    ``value`` is the tuple of their values, ``types`` of their types."""

    __slots__ = ("name", "value", "same", "getter", "types", "functions")

    def __init__(self, name: Any, value: Any, same: bool = False, getter: Any = None, types: tuple = ()):
        self.name = name
        self.value = value
        # An object (held by an object whose assignments go unseen): compared by identity.
        self.same = same
        self.getter = getter
        self.types = types
        # Whether ``value`` (a getter's tuple) holds functions (:class:`_Function`, held
        # as the functions themselves: compared by identity first, at C speed).
        self.functions = False

    def holds(self, namespace: Any) -> bool:
        getter = self.getter
        if getter is not None:
            try:
                now = getter(namespace)
            except (AttributeError, KeyError):
                return False
            if now == self.value and tuple(map(type, now)) == self.types:
                return True
            # A function a trace on some thread patched a dispatcher in for is itself.
            return self.functions and tuple(map(_unpatched, now)) == self.value
        now = namespace.get(self.name, GlobalValue)
        if self.same:
            return now is self.value
        return type(now) is _type_of(self.value) and self.value == now


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _grouped(guards: list[tuple]) -> tuple:
    """``guards`` with the value guards of each owner (an object's attributes, a dict's
    items) made one, read by one ``attrgetter`` or ``itemgetter`` call: a model's
    configuration classes hold dozens of constants, compared on every call."""
    by_owner: dict[int, tuple[Any, list[tuple[str, Any]]]] = {}
    out = []
    for owner, name, expected in guards:
        if expected.same or type(owner) is _Cell:
            out.append((owner, name, expected))
            continue
        target, key = owner, (id(owner), False)
        if type(owner) is _Attributes:
            # Read from the instance's (or class's) own dict where it holds the name: no
            # __getattribute__ of its class runs (a transformers config has one).
            own = getattr(owner.obj, "__dict__", None)
            inside = isinstance(own, (dict, types.MappingProxyType)) and name in own
            target, key = (own if inside else owner.obj), (id(owner.obj), inside)
        entry = by_owner.get(key)
        if entry is None:
            entry = by_owner[key] = (target, [])
        entry[1].append((name, expected.value))
    for target, items in by_owner.values():
        names = [n for n, _ in items]
        if len(names) == 1:
            names = names * 2  # a getter of one name returns no tuple
            items = items * 2
        make = operator.itemgetter if type(target) in (dict, types.MappingProxyType) else operator.attrgetter
        values = tuple(v for _, v in items)
        kinds = tuple(map(_type_of, values))
        functions = any(type(v) is _Function for v in values)
        if functions:
            values = tuple(v.fn if type(v) is _Function else v for v in values)
        guard = GlobalValue(tuple(names), values, getter=make(*names), types=kinds)
        guard.functions = functions
        out.append((target, guard.name, guard))
    return tuple(out)


def _python_state(modules: Sequence[torch.nn.Module]) -> tuple[tuple, tuple]:
    """What a trace read of Python state besides the traced-through modules' own plain
    attributes (their flags), as (flags, guards): ``flags`` for the objects they hold,
    three levels down, whose assignments move the generation (``_generation.watch_object``);
    ``guards`` (``(namespace, name, GlobalValue)``, compared on every call) for

    - module-level globals read by name by traced code (:func:`_static_code`) holding a
      plain value, or a list, dict, set or tuple of plain values, tensors and such
      containers (compared by a copy, :func:`_guarded_value`);
    - the tensors held objects and globals hold, by identity (the graph holds them as
      constants: replaced, the plan would read the old one);
    - the attributes of held objects whose assignments cannot be seen (a
      ``types.SimpleNamespace``; ``__slots__`` without weak references), and the such
      containers any held object or traced-through module holds
      (``self.scales[1] = 2.0``, ``self.cfg["bias"][0] = b`` assign nothing);
    - class attributes of the modules' own classes (``self.SCALE``
      reads the class's, ``Model.SCALE = 2`` assigns no instance's).

    Attributes are guarded only where traced code names them (:func:`_names_read`): an
    attribute written by a branch that runs as written and never read by traced code
    would re-trace every call. A ``_`` name only where the code spells it
    (:func:`_read_name`: transformers' classes hold dozens of ``_`` constants)."""
    held = reachable_objects(modules)
    codes = _static_code(modules, held)
    read = _names_read(codes)
    guards, global_objects = _global_guards(codes)
    closure_guards, closure_objects = _closure_guards(modules)
    guards += closure_guards
    if global_objects or closure_objects:  # (else the same walk as the one above)
        held = reachable_objects(modules, roots=global_objects + closure_objects)
    watched = [_generation.watch_object(o) for o in held]
    flags = tuple((o, _flag_values(o)) for o, w in zip(held, watched) if w)
    guards += _held_object_guards(held, watched, read)
    guards += _module_container_guards(modules, read)
    guards += _class_attribute_guards(modules, read)
    return flags, _grouped(guards)


def _global_guards(codes: dict[types.CodeType, dict]) -> tuple[list[tuple], list[Any]]:
    """Guards for the module-level globals ``codes`` read by name (a plain value, a list,
    dict or set of plain values, a tensor by identity), and the objects globals hold
    (:func:`holds_state`: followed as held objects)."""
    guards: list[tuple] = []
    objects: list[Any] = []
    seen: set[tuple[int, str]] = set()
    for code, namespace in codes.items():
        for name in _global_names(code):
            if (id(namespace), name) in seen:
                continue
            seen.add((id(namespace), name))
            value = namespace.get(name, GlobalValue)
            expected = _guarded_value(value)
            if expected is not _UNGUARDED:
                guards.append((namespace, name, GlobalValue(name, expected)))
            elif _is_function(value):  # a helper called by name: the same function
                guards.append((namespace, name, GlobalValue(name, _Function(value))))
            elif isinstance(value, torch.Tensor):  # baked in as a constant: the same tensor
                guards.append((namespace, name, GlobalValue(name, value, same=True)))
            elif value is not GlobalValue and holds_state(value):
                objects.append(value)
    return guards, objects


def _closure_guards(modules: Sequence[torch.nn.Module]) -> tuple[list[tuple], list[Any]]:
    """Guards for the variables of the function that made a module's class, which its
    forward reads (its closure), and the objects they hold (followed as held objects)."""
    guards: list[tuple] = []
    objects: list[Any] = []
    seen: set[int] = set()
    for m in modules:
        fn = getattr(type(m), "forward", None)
        cells = getattr(fn, "__closure__", None) or ()
        # A decorator's wrapper (``functools.wraps``) holds the function it wraps and its
        # options in its cells, fixed when the class was made: no function of it is guarded.
        wrapper = hasattr(fn, "__wrapped__")
        for name, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), cells):
            if id(cell) in seen:  # (the forward of a class many modules share)
                continue
            seen.add(id(cell))
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            expected = _guarded_value(value)
            if expected is not _UNGUARDED:
                guards.append((_Cell(cell), name, GlobalValue(name, expected)))
            elif _is_function(value):
                if not wrapper:
                    guards.append((_Cell(cell), name, GlobalValue(name, _Function(value))))
            elif holds_state(value):
                objects.append(value)
    return guards, objects


def _held_object_guards(held: Sequence[Any], watched: Sequence[bool], read: Optional[frozenset[str]]) -> list[tuple]:
    """Guards for what held objects hold under names traced code reads: tensors and, where
    the object is not watched (its assignments go unseen), objects, by identity; plain
    values where it is not watched; lists, dicts, sets and tuples of plain values, tensors
    and such containers (a watched object's under the names :func:`_read_name` allows;
    its plain attributes are its flags)."""
    guards: list[tuple] = []
    for o, w in zip(held, watched):
        attributes = _Attributes(o)
        for k, v in object_items(o).items():
            if k[:2] == "__" or (read is not None and k not in read):
                continue
            if (not w and holds_state(v)) or isinstance(v, torch.Tensor):
                # (A tensor is baked into the graph as a constant: it must stay the same one.)
                guards.append((attributes, k, GlobalValue(k, v, same=True)))
                continue
            if w and (not _is_container(v) or is_plain(v) or not _read_name(k, read)):
                continue  # (a watched object's plain attributes are its flags)
            expected = _Function(v) if _is_function(v) else _guarded_value(v)
            if expected is _UNGUARDED:
                continue
            guards.append((attributes, k, GlobalValue(k, expected)))
    return guards


def _module_container_guards(modules: Sequence[torch.nn.Module], read: Optional[frozenset[str]]) -> list[tuple]:
    """Guards for the lists, dicts, sets and tuples (of plain values, tensors and such
    containers) modules hold under names traced code reads (``self.scales[1] = 2.0``
    assigns nothing; a tuple of tensors is no flag), ``_``-prefixed ones too but for the
    tables every module has (a plain tuple is a flag already)."""
    guards: list[tuple] = []
    tables = _MODULE_TABLES  # (asked first: most of a module's attributes are its tables)
    for m in modules:
        for k, v in m.__dict__.items():
            if (
                k not in tables
                and _is_container(v)
                and _read_name(k, read)
                and not k.startswith("_streamsched")
                and not is_plain(v)
            ):
                expected = _guarded_value(v)
                if expected is not _UNGUARDED:
                    guards.append((m.__dict__, k, GlobalValue(k, expected)))
    return guards


def _read_name(name: str, read: Optional[frozenset[str]]) -> bool:
    """Whether traced code may read attribute ``name`` (:func:`_names_read`): a ``_``
    name only where the code names it (``self._scale``; where it reads names it does not
    spell, the ``_`` names a library's classes hold by the dozen are taken as its
    bookkeeping), never a ``__`` one."""
    if name[:1] == "_":
        return name[:2] != "__" and read is not None and name in read
    return read is None or name in read


def _class_attribute_guards(modules: Sequence[torch.nn.Module], read: Optional[frozenset[str]]) -> list[tuple]:
    """Guards for the public class attributes (defined outside the libraries) that traced
    code reads and some instance does not shadow, read as the instances read them:
    through each module's own class, so that assigning one on that class or on any base
    it inherits it from is seen (``Sub.SCALE = 2`` shadows ``Base.SCALE``)."""
    guards: list[tuple] = []
    # A class attribute every instance found shadows with its own is never read through it.
    shadowed: dict[type, set[str]] = {}
    for o in modules:
        names = set(o.__dict__)
        cls = type(o)
        shadowed[cls] = shadowed[cls] & names if cls in shadowed else names
    for cls, hidden in shadowed.items():
        names: dict[str, None] = {}
        for base in cls.__mro__:
            if base.__module__.partition(".")[0] in _LIBRARY_PACKAGES or base.__module__ == "builtins":
                continue
            for k in base.__dict__:
                if _read_name(k, read) and k not in hidden:
                    names.setdefault(k, None)
        for k in names:
            # The value the class resolves the name to, read from the defining class's
            # dict (no descriptor runs: only plain values are guarded, and those have none).
            value = next(base.__dict__[k] for base in cls.__mro__ if k in base.__dict__)
            expected = _guarded_value(value)
            if expected is _UNGUARDED and read is not None and isinstance(value, (staticmethod, *_FUNCTIONS)):
                # A method or function the code names (``self.ACT(y)``, ``self.helper(y)``):
                # the same one, as the guard reads it (the class's own dict holds the
                # staticmethod, a base's is read through the class: its function).
                expected = _Function(value if k in cls.__dict__ else getattr(cls, k))
            if expected is not _UNGUARDED:
                guards.append((_Attributes(cls), k, GlobalValue(k, expected)))
    return guards


_CONTAINERS = (list, dict, set, tuple, frozenset, OrderedDict)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType)
_UNGUARDED = object()


def _is_container(value: Any) -> bool:
    """Whether ``value`` is a container :func:`_guarded_value` copies: a list, dict, set,
    tuple, frozenset or ``OrderedDict``, or a named tuple."""
    kind = type(value)
    return kind in _CONTAINERS or (issubclass(kind, tuple) and isinstance(getattr(kind, "_fields", None), tuple))


# A list, dict, set or tuple holding more than this many items (all its levels counted) is
# not compared on every call.
_MAX_GUARDED_ITEMS = 64
# How deep containers nested in containers are followed (``self.cfg["bias"][0]``).
_MAX_GUARDED_DEPTH = 4


class _ItemsOf:
    """What a guard expects of a list, dict, set or tuple holding tensors or containers
    beside plain values, at every level: the same tensors (the graph holds the ones the
    trace read as constants: an item replaced, ``self.biases[0] = b`` or
    ``self.cfg["bias"][0] = b`` assigns nothing a module sees, would leave the plan reading
    the old one), the same kinds of containers holding what these expect, and equal plain
    values. Equal to a container of its ``kind`` holding them."""

    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: Any):
        self.kind = kind
        self.items = items

    def __eq__(self, other: Any) -> bool:
        if type(other) is not self.kind or len(other) != len(self.items):
            return False
        if self.kind in (set, frozenset):
            # Tensors by identity (a set holds each once), plain values by equality.
            held = {id(v) for v in other if isinstance(v, torch.Tensor)}
            return all(id(v) in held if isinstance(v, torch.Tensor) else v in other for v in self.items)
        if self.kind in (dict, OrderedDict):
            pairs = []
            for k, v in self.items.items():
                if k not in other:
                    return False
                pairs.append((v, other[k]))
        else:
            pairs = zip(self.items, other)
        for expected, now in pairs:
            if isinstance(expected, torch.Tensor) or isinstance(now, torch.Tensor):
                if now is not expected:
                    return False
            elif type(expected) in (_ItemsOf, _Function):
                if not expected == now:
                    return False
            elif type(now) is not type(expected) or now != expected:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


class _Function:
    """What a guard expects of a name holding a function (a helper a forward calls by
    name, ``ACT = torch.tanh``, a namespace's ``act``): that very function, the
    dispatcher a trace on some thread patches in for it counting as it
    (``opaque_functions``). Traced code calling it was traced through it, or baked it
    into a node: another one put there (``module.act = relu``, ``mock.patch``) must
    re-trace."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any):
        self.fn = getattr(fn, "__wrapped__", fn) if _is_dispatcher(fn) else fn

    def __eq__(self, other: Any) -> bool:
        if other is self.fn:
            return True
        return _is_dispatcher(other) and other.__wrapped__ is self.fn

    __hash__ = None  # type: ignore[assignment]


def _is_dispatcher(fn: Any) -> bool:
    return getattr(fn, "__code__", None) is opaque_functions.DISPATCH_CODE


def _unpatched(value: Any) -> Any:
    return value.__wrapped__ if _is_dispatcher(value) else value


def _is_function(value: Any) -> bool:
    """A function a name may hold and code call: Python's, a built-in (``torch.tanh``), a
    ``functools.partial``, a bound method; not a class or a module of the model (those
    are followed otherwise)."""
    if isinstance(value, _FUNCTIONS):
        return True
    return type(value) in _CALLABLES


def _type_of(value: Any) -> type:
    """The type a guarded value's owner must hold: a container's for :class:`_ItemsOf`, a
    function's for :class:`_Function`."""
    kind = type(value)
    if kind is _ItemsOf:
        return value.kind
    return type(value.fn) if kind is _Function else kind


def _guarded_value(value: Any) -> Any:
    """What a guard expects of ``value`` on every call: the value itself where it is plain
    (not a class or function: a helper the code calls by name), a copy of a list, dict,
    set or tuple of plain values, an :class:`_ItemsOf` of one holding tensors or other
    such containers (``self.pairs = [(w, b)]``); ``_UNGUARDED`` where it is none of these."""
    kind = type(value)
    if kind in _FLAG_TYPES:
        return value
    if _is_container(value):
        budget = [_MAX_GUARDED_ITEMS]
        expected = _guarded_items(value, budget, _MAX_GUARDED_DEPTH)
        return expected
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)) or not is_plain(value):
        return _UNGUARDED
    return value


# What makes a container's copy hold more than plain values: the copy of a list of lists
# made with list() would share the inner lists it compares with.
_HELD = (_ItemsOf, list, dict, set, OrderedDict, _Function)


def _guarded_items(value: Any, budget: list, depth: int) -> Any:
    """:func:`_guarded_value` of a container, its items counted against ``budget``; a
    container nested in it is copied as well (an :class:`_ItemsOf` holds the copies)."""
    kind = type(value)
    budget[0] -= len(value)
    if budget[0] < 0 or depth <= 0:
        return _UNGUARDED
    deep = kind not in _CONTAINERS  # (a named tuple: rebuilt from its items by no call)
    if kind in (dict, OrderedDict):
        items: Any = {}
        for k, v in value.items():
            if not is_plain(k) or isinstance(k, type) or callable(k):
                return _UNGUARDED
            items[k] = expected = _guarded_item(v, budget, depth)
            if expected is _UNGUARDED:
                return _UNGUARDED
            deep = deep or type(expected) in _HELD or isinstance(expected, torch.Tensor)
    else:
        items = []
        for v in value:
            if kind in (set, frozenset):
                if isinstance(v, torch.Tensor):
                    deep = True  # (compared by identity)
                elif not is_plain(v) or isinstance(v, type) or callable(v):
                    return _UNGUARDED
                items.append(v)
                continue
            expected = _guarded_item(v, budget, depth)
            if expected is _UNGUARDED:
                return _UNGUARDED
            items.append(expected)
            deep = deep or type(expected) in _HELD or isinstance(expected, torch.Tensor)
    if deep or (kind is tuple and not is_plain(value)):
        return _ItemsOf(kind, items)
    return kind(value)


def _guarded_item(value: Any, budget: list, depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value  # (a graph constant: compared by identity)
    if _is_container(value):
        return _guarded_items(value, budget, depth - 1)
    if _is_function(value):
        return _Function(value)  # (``self.acts[0](y)``: the same function)
    if not is_plain(value) or isinstance(value, type) or callable(value):
        return _UNGUARDED
    return value


def _static_code(modules: Sequence[Any], objects: Sequence[Any]) -> dict[types.CodeType, dict]:
    """The code traced code may run, with its globals, outside torch, the standard library
    and streamsched: each module's ``forward`` and, three calls deep, the functions that
    code names: a method of the modules' or objects' classes (``self.helper()``,
    ``self.config.scale_for()``), a global function, a function of a module it imported
    (``utils.helper``), the methods of a class it names. A superset of what a trace runs,
    read from the code objects alone (cached per code object and class)."""
    classes = tuple({type(o): None for o in (*modules, *objects)})
    codes: dict[types.CodeType, dict] = {}
    for cls in classes:
        found = _function_code(getattr(cls, "forward", None)) if issubclass(cls, torch.nn.Module) else None
        if found is not None:
            codes.setdefault(*found)
    frontier = list(codes.items())
    for _ in range(_CODE_DEPTH):
        found_now = []
        for code, namespace in frontier:
            named = _named_code(code, namespace)
            for cls in classes:
                named += _methods_named(code, cls)
            for callee, callee_namespace in named:
                if callee not in codes:
                    codes[callee] = callee_namespace
                    found_now.append((callee, callee_namespace))
        frontier = found_now
    return codes


@functools.lru_cache(maxsize=8192)
def _methods_named(code: types.CodeType, cls: type) -> tuple[tuple[types.CodeType, dict], ...]:
    """The functions of ``cls`` (outside the libraries) whose names ``code`` holds (a
    tuple: the cache hands the same one to every caller)."""
    out = []
    for name in _code_names(code):
        for base in cls.__mro__:
            if name in base.__dict__:
                found = _function_code(base.__dict__[name])
                if found is not None:
                    out.append(found)
                break
    return tuple(out)


# How many calls deep :func:`_static_code` follows the functions code names.
_CODE_DEPTH = 3


def _function_code(value: Any) -> Optional[tuple[types.CodeType, dict]]:
    fn = value.__func__ if isinstance(value, (staticmethod, classmethod, types.MethodType)) else value
    if isinstance(fn, property):
        fn = fn.fget
    if getattr(fn, _BRANCH_ATTR, False):
        # A @streamsched.branch function is one opaque task: its body runs on every call,
        # so nothing it reads is baked into a plan (guarded, a list it appends to would
        # fail its guard on every call and re-trace the model each time).
        return None
    fn = getattr(fn, "__wrapped__", fn)  # functools.wraps, lru_cache
    if isinstance(fn, types.FunctionType) and not _library_namespace(fn.__globals__):
        return fn.__code__, fn.__globals__
    return None


def _named_code(code: types.CodeType, namespace: dict) -> list[tuple[types.CodeType, dict]]:
    """The functions ``code`` names through ``namespace``: globals holding functions (or
    classes, whose functions count), and functions of modules it names."""
    names = _code_names(code)
    out = []
    for name in _global_names(code):
        value = namespace.get(name)
        if value is None:
            continue
        if isinstance(value, types.ModuleType):
            if _library_namespace(vars(value)):
                continue
            for attr in names:
                found = _function_code(vars(value).get(attr))
                if found is not None:
                    out.append(found)
        elif isinstance(value, type):
            if value.__module__.partition(".")[0] not in _LIBRARY_PACKAGES:
                out.extend(_methods_named(code, value))
        else:
            found = _function_code(value)
            if found is not None:
                out.append(found)
    return out


# Names in traced code that read attributes without naming them.
_DYNAMIC_READS = frozenset({"vars", "__dict__", "asdict", "astuple", "__getattribute__"})


def _names_read(codes: dict[types.CodeType, dict]) -> Optional[frozenset[str]]:
    """The attribute names ``codes`` may read: those they load (``x.name``) and the
    strings among their constants (``getattr(x, "name")``); None (every name) where they
    read attributes without naming them (``vars(x)``, ``x.__dict__``, ``getattr`` of a
    name they compute: ``getattr(self, "scale_" + kind)``)."""
    names: set[str] = set()
    for code in codes:
        if _computed_getattr(code):
            return None
        names.update(_code_names(code))
    return None if names & _DYNAMIC_READS else frozenset(names)


_CALLS = frozenset({"CALL", "PRECALL", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX", "CALL_KW"})


@functools.lru_cache(maxsize=4096)
def _computed_getattr(code: types.CodeType) -> bool:
    """Whether ``code`` (or code it defines) calls ``getattr`` (or ``hasattr``) with a name
    that is not a string constant: which attributes it reads then cannot be told from the
    code. Read from the bytecode, following the stack depth from the function's load to
    its call: the instructions between the first argument's end (the last time one value
    is on the stack) and the second's (the last time two are) must be one string
    constant; anything else (a jump among them, an instruction whose stack effect is
    unknown) counts as computed."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and _computed_getattr(const):
            return True
    if "getattr" not in code.co_names and "hasattr" not in code.co_names:
        return False
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or ins.argval not in ("getattr", "hasattr"):
            continue
        depth, ends = 0, {1: -1, 2: -1}
        for j in range(i + 1, len(instructions)):
            nxt = instructions[j]
            if nxt.opname.startswith(("JUMP", "POP_JUMP", "FOR_ITER", "SEND", "RETURN")):
                return True
            try:
                arg = nxt.arg if nxt.opcode >= dis.HAVE_ARGUMENT else None
                depth += dis.stack_effect(nxt.opcode, arg, jump=False)
            except ValueError:
                return True
            if depth < 0:
                break
            if depth in ends:
                ends[depth] = j
        else:
            return True
        second = instructions[ends[1] + 1 : ends[2] + 1] if ends[1] >= 0 else []
        if not (len(second) == 1 and second[0].opname == "LOAD_CONST" and isinstance(second[0].argval, str)):
            return True
    return False


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> frozenset[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, str):
            names.add(const)
        elif isinstance(const, tuple):
            names.update(c for c in const if isinstance(c, str))
        elif isinstance(const, types.CodeType):
            names.update(_code_names(const))
    return frozenset(names)


_LIBRARY_PACKAGES = frozenset({"torch", "streamsched", "functorch", "typing_extensions", "numpy"})


def _library_namespace(namespace: dict) -> bool:
    """Whether globals ``namespace`` belong to a module of torch, the standard library or
    streamsched (whose globals no model switches)."""
    name = namespace.get("__name__")
    if not isinstance(name, str):
        return True
    top = name.partition(".")[0]
    return top in _LIBRARY_PACKAGES or top in sys.stdlib_module_names


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(n for n in names if isinstance(n, str)))


def _assumptions(assumed: set) -> tuple:
    """What the trace relied on beyond its key (``RankTracker.sources``): the parameters
    whose dtypes must hold, returned; what a rule said of an opaque call's items, handed
    to that call, which checks it each time it runs."""
    guards = []
    for source in assumed:
        if source[0] in ("param", "param_rank", "param_dim"):
            guards.append(source[1:])
        else:
            _, target, index, rank, dtype = source
            target.expect(index, rank, dtype)
    return tuple(guards)


def _used_functions(graph: fx.Graph, sites: dict[int, tuple[dict, str, Any, str]]) -> dict[str, str]:
    """The opaque functions the graph calls, by name, with why each is opaque."""
    out: dict[str, str] = {}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, OpaqueFunction):
            site = sites.get(id(node.target.fn))
            if site is not None:
                out[node.target.label[len("function ") :]] = site[3]
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _registered_leaf_types() -> tuple[type, ...]:
    """Module classes a loaded library registers as untraceable (timm's notrace modules)."""
    fx_registry = sys.modules.get("timm.layers._fx")
    if fx_registry is None:
        return ()
    try:
        return tuple(t for t in fx_registry.get_notrace_modules() if isinstance(t, type))
    except Exception:  # noqa: BLE001 - a registry of another version: ignore it
        return ()


def _registered_leaf_functions() -> tuple[Any, ...]:
    """Functions a loaded library registers as untraceable (timm's notrace functions)."""
    fx_registry = sys.modules.get("timm.layers._fx")
    if fx_registry is None:
        return ()
    try:
        return tuple(fx_registry.get_notrace_functions())
    except Exception:  # noqa: BLE001
        return ()


def _structure(model: torch.nn.Module) -> tuple:
    return tuple([(name, id(m)) for name, m in named_modules_of(model, remove_duplicate=False)])


def _user_frame(exc: BaseException) -> Optional[traceback.FrameSummary]:
    """The innermost frame of the traceback that belongs to user code."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [
        f
        for f in frames
        if not f.filename.startswith(_TORCH_DIR)
        and not f.filename.startswith(_OWN_DIR)
        and not f.filename.startswith("<")
    ]
    return user[-1] if user else None


def _frame_module(exc: BaseException, summary: traceback.FrameSummary) -> Optional[torch.nn.Module]:
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == summary.filename and tb.tb_lineno == summary.lineno:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                return owner
        tb = tb.tb_next
    return None


def _generator_forward(model: torch.nn.Module) -> Optional[str]:
    """``file:line`` of the model's ``forward`` where it is a generator function."""
    forward = inspect.unwrap(getattr(type(model), "forward", None))
    if not inspect.isgeneratorfunction(forward):
        return None
    code = forward.__code__
    return f"{code.co_filename}:{code.co_firstlineno}"


def _describe_trace_failure(model: torch.nn.Module, tracer: _LeafTracer, exc: BaseException) -> str:
    reason = _first_line(exc)
    where = ""
    who = f"{type(model).__name__}.forward"
    frame = _user_frame(exc)
    if frame is not None:
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        where = f"\n  at {frame.filename}:{frame.lineno} in {frame.name}: {line}"
        owner = _frame_module(exc, frame)
        if owner is not None:
            try:
                path = tracer.path_of_module(owner)
            except NameError:
                path = None
            label = f"module '{path}'" if path else "the root module"
            if owner is model:
                label = "the root module"
            who = f"{type(owner).__name__}.{frame.name} ({label})"
    generator = _generator_forward(model) if "generator" in reason else None
    if generator is not None:
        # fx meets the generator object as the forward's output: say what it is.
        who = f"{type(model).__name__}.forward (the root module)"
        reason = (
            f"{reason} (its forward is a generator function, at {generator}: it yields its outputs, and fx "
            "traces a forward that returns them; return a list or tuple instead)"
        )
    own = ""
    innermost = traceback.extract_tb(exc.__traceback__)[-1:]
    if frame is not None and innermost and innermost[0] == frame:
        # Raised by a line of the model's own code, not by fx refusing a proxy: it may be
        # an error eager raises just the same.
        own = (
            f"\n  (raised by the model's own code while traced: if {type(model).__name__} raises it when "
            "called directly too, the error is the model's, not a limit of tracing)"
        )
    if "(the root module)" in who or "(" not in who:
        # The model's own forward: making it one opaque task would leave nothing to schedule.
        fix = (
            "How to fix: move the code that does this into a function or method decorated with "
            "@streamsched.branch (its body then runs as one opaque task and may hold any Python; the "
            "rest of the forward is traced and scheduled around it)."
        )
    else:
        fix = (
            "How to fix: decorate the function or module class that does this with "
            "@streamsched.branch (its body then runs as one opaque task and may hold any "
            "Python) or name its class in leaf_modules=(...)."
        )
    return (
        f"streamsched cannot trace {who} of {type(model).__name__}: "
        f"{type(exc).__name__}: {reason}{where}{own}\n"
        f"{fix} With strict=False (the default) "
        "the model's own forward runs and only its @streamsched.branch calls are scheduled."
    )
