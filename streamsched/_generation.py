"""A process-wide counter that moves whenever a *tracked* module (one inside the tree of
a wrapped model, see :func:`track`) registers a submodule, parameter or buffer
(``setattr`` of one, ``register_*``; not the one it holds under that name already),
deletes an attribute (``del model.head``, ``del model.layers[0]``), edits a container's
module table directly (``del model.heads["b"]``, ``ModuleDict.pop`` / ``clear``,
``ModuleList.insert``, ``Sequential.insert``), or sets a *watched* plain attribute: ``training``
(``.train()``, ``.eval()``, ``bn.training = False``) and every flag a trace read from a
traced-through module (``drop_prob``, ``use_cache``...), whose value the trace baked in
(assigned a value other than the one it holds).

Wrappers compare it with the value they last validated against: unchanged means no
module of a wrapped model was re-wired, so the per-call check costs one integer
comparison. When it moved, the wrapper re-checks that every module its plans call is
still in place (and re-traces if not).

Modules outside every wrapped tree do not move it: constructing a module, and the
temporary containers some forwards build on every call (``self.layers[:n]`` makes a new
``ModuleList`` and registers each layer into it, as Hugging Face decoders do), would
otherwise send every wrapper through that re-check on every call. A module registered
into a tracked one becomes tracked, with its whole subtree.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Iterable

from torch import Tensor
from torch.nn.modules import container as _container
from torch.nn.modules import module as _module

_generation = 0
# Moves with the generation on every change but a module's ``training`` assigned and a
# module hook registered or removed: plans are keyed by every module's mode and hooks,
# so a wrapper that sees only those changed (``.train()`` / ``.eval()`` before every
# call, a hook held for one call) re-keys them and checks nothing else.
_changes = 0


def current() -> int:
    return _generation


def changes() -> int:
    """A counter of every generation move but ``training`` assignments and module hooks
    registered or removed."""
    return _changes


def _bump(*_args, **_kwargs) -> None:
    global _generation, _changes
    _generation += 1
    _changes += 1
    return None


def _bump_mode() -> None:
    global _generation
    _generation += 1


# Every module of every wrapped model's tree: id -> weak reference (identity, not hash:
# the check runs on every registration anywhere and must cost a dict lookup).
_tracked: dict[int, weakref.ref] = {}


def _untrack(ref: weakref.ref, key: int) -> None:
    if _tracked.get(key) is ref:
        del _tracked[key]


def track(model: _module.Module) -> None:
    """Count the re-wiring of ``model`` and of every module below it from now on."""
    for m in model.modules():
        key = id(m)
        ref = _tracked.get(key)
        if ref is None or ref() is not m:
            _tracked[key] = weakref.ref(m, lambda r, key=key: _untrack(r, key))


def tracked(module: Any) -> bool:
    ref = _tracked.get(id(module))
    return ref is not None and ref() is module


def _report_registration(module: Any, name: str) -> None:
    # ``register_buffer``, ``register_parameter`` and ``add_module`` store into the
    # module's tables without its ``__setattr__``: while a trace runs on this thread, the
    # registration is a side effect the trace would not repeat (the tracer refuses it
    # before it happens, as it does an assignment).
    if _on_setattr:
        callback = _on_setattr.get(threading.get_ident())
        if callback is not None:
            callback(module, name)


def _registered(module: Any, name: str, value: Any) -> None:
    _report_registration(module, name)
    if tracked(module) and module.__dict__.get("_modules", {}).get(name) is not value:
        _bump()
        if isinstance(value, _module.Module):
            track(value)
    return None


# Buffers given another tensor under a name they held one under (``self.last = y`` on a
# registered buffer, ``register_buffer`` again): traces read buffers on every call, so a
# wrapper that sees only such changes re-checks little (``new_signatures.revalidate``).
_buffer_replacements = 0


def buffer_replacements() -> int:
    """A counter of buffers of tracked modules given another tensor under their name."""
    return _buffer_replacements


def _registered_tensor(module: Any, name: str, value: Any) -> None:
    _report_registration(module, name)
    # A tensor assigned where it is already (``self.pos = self.pos.to(device, dtype)``
    # of one already there, on every call of CTRL's forward) changes nothing: counted,
    # every later call would re-check the model's modules and traces.
    if tracked(module) and not _already(module, name, value):
        buffers = module.__dict__.get("_buffers")
        if buffers is not None and _is_tensor(buffers.get(name)) and _is_tensor(value):
            global _buffer_replacements
            _buffer_replacements += 1
        _bump()
    return None


def _is_tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def _already(module: Any, name: str, value: Any) -> bool:
    """Whether ``value`` is the parameter or buffer ``module`` holds as ``name`` already
    (the registration hooks run before it is stored)."""
    held = module.__dict__
    return value is not None and (
        held.get("_parameters", {}).get(name) is value or held.get("_buffers", {}).get(name) is value
    )


_handles = (
    _module.register_module_module_registration_hook(_registered),
    _module.register_module_parameter_registration_hook(_registered_tensor),
    _module.register_module_buffer_registration_hook(_registered_tensor),
)

# A module hook registered on a tracked module changes what a call of it does (the trace
# runs a hooked module as a call of its own, never fused): count registrations, so the
# wrapper re-traces. Removing one (``handle.remove()``) counts too: the plan made for the
# hooked module is correct but slower than the one without the hook, and re-tracing
# restores it.
_hook_registrations = 0


def hook_registrations() -> int:
    """A counter of module hooks registered on tracked modules."""
    return _hook_registrations


def _hook_changed() -> None:
    # Not one of the changes() either: plans are keyed by the hooks modules hold
    # (``WrapperState.mode_of``), so the plans made without a hook stay valid for when
    # it is gone.
    global _hook_registrations
    _hook_registrations += 1
    _bump_mode()


def _count_removal(handle: Any) -> None:
    """Make ``handle.remove()`` (and leaving ``with handle:``) count as a hook change."""
    remove = handle.remove

    def counted_remove() -> None:
        remove()
        _hook_changed()

    try:
        handle.remove = counted_remove
    except AttributeError:  # a handle type with slots: removal goes unseen (correct, slower)
        pass


def _counting_registrations(register: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(register)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        # Registering a hook while a trace runs would happen once (the tracer refuses it,
        # before it happens: a half-done trace attempt must leave the model as it was).
        if _on_setattr:
            callback = _on_setattr.get(threading.get_ident())
            if callback is not None:
                callback(self, f"{register.__name__}()")
        handle = register(self, *args, **kwargs)
        if tracked(self):
            _hook_changed()
            _count_removal(handle)
        return handle

    wrapper._streamsched = True  # type: ignore[attr-defined]
    return wrapper


for _name in (
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_backward_hook",
):
    _register = getattr(_module.Module, _name, None)
    if _register is not None and not getattr(_register, "_streamsched", False):
        setattr(_module.Module, _name, _counting_registrations(_register))

# PyTorch has no hook for removals; wrap __delattr__ (behaviour unchanged) so that
# deleting a submodule or parameter moves the counter too.
_original_delattr = _module.Module.__delattr__


def _delattr(self, name: str) -> None:
    if tracked(self):
        _bump()
    _original_delattr(self, name)


if not getattr(_module.Module.__delattr__, "_streamsched", False):
    _delattr._streamsched = True  # type: ignore[attr-defined]
    _module.Module.__delattr__ = _delattr  # type: ignore[method-assign]


# Container edits that write the module table directly, without ``__setattr__`` or
# ``__delattr__`` (``del model.heads["b"]``, ``ModuleDict.pop`` / ``clear``,
# ``ModuleList.insert`` and ``Sequential.insert``, which shift every later module to the
# next key): wrapped (behaviour unchanged) so that they move the counter too, and a module
# inserted into a tracked container is tracked.
def _counting_edits(edit: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(edit)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = edit(self, *args, **kwargs)
        if tracked(self):
            _bump()
            for m in self._modules.values():
                if m is not None and not tracked(m):
                    track(m)
        return out

    counted._streamsched = True  # type: ignore[attr-defined]
    return counted


for _cls, _name in (
    (_container.ModuleDict, "__delitem__"),
    (_container.ModuleDict, "clear"),
    (_container.ModuleList, "insert"),
    (_container.Sequential, "insert"),
):
    if not getattr(getattr(_cls, _name), "_streamsched", False):
        setattr(_cls, _name, _counting_edits(getattr(_cls, _name)))

# Plain attributes whose assignment moves the counter. Traces add the names of the flags
# they bake in (``watch``); the set only grows, and checking it costs one set lookup.
_watched: set[str] = {"training", "forward"}
# While a trace runs on some thread, an assignment to a module attribute from that thread
# is a side effect the trace would not repeat: the tracer registers a callback here.
_on_setattr: dict[int, Callable[[Any, str], None]] = {}
_original_setattr = _module.Module.__setattr__


def watch(names: Iterable[str]) -> None:
    """Move the counter whenever any module attribute of one of these names is assigned."""
    _watched.update(names)


# Objects a traced-through module holds (a ``config``), whose plain attributes traced code
# may read and bake in: assigning any attribute of one moves the counter too. Their
# classes' ``__setattr__`` is wrapped (behaviour unchanged) the first time a trace
# watches an instance; id -> weak reference, as for tracked modules.
_watched_objects: dict[int, weakref.ref] = {}


def _unwatch(ref: weakref.ref, key: int) -> None:
    if _watched_objects.get(key) is ref:
        del _watched_objects[key]


def watch_object(obj: Any) -> bool:
    """Move the counter whenever an attribute of ``obj`` (not a module) is assigned;
    False where that cannot be seen (a built-in class, an object without weak
    references, a frozen dataclass), and the caller must not rely on it."""
    cls = type(obj)
    params = getattr(cls, "__dataclass_params__", None)
    if params is not None and params.frozen:
        # A frozen dataclass changes only through object.__setattr__, which runs no
        # __setattr__ of its class: not seen (its attributes are compared instead).
        return False
    if not getattr(cls.__setattr__, "_streamsched", False):
        original = cls.__setattr__

        def __setattr__(self: Any, name: str, value: Any) -> None:
            if _on_setattr:
                callback = _on_setattr.get(threading.get_ident())
                if callback is not None:
                    callback(self, name)
            original(self, name, value)
            key = id(self)
            ref = _watched_objects.get(key)
            if ref is not None and ref() is self:
                global _assignments
                _assignments += 1
                _bump()

        __setattr__._streamsched = True  # type: ignore[attr-defined]
        try:
            cls.__setattr__ = __setattr__  # type: ignore[method-assign]
        except (TypeError, AttributeError):  # a built-in or extension class
            return False
    key = id(obj)
    ref = _watched_objects.get(key)
    if ref is None or ref() is not obj:
        try:
            _watched_objects[key] = weakref.ref(obj, lambda r, key=key: _unwatch(r, key))
        except TypeError:  # no weak references (__slots__ without __weakref__)
            return False
    return True


# Moves with the generation on every watched assignment but ``training``: a mode switch
# (``.train()`` on every step of a training loop) need not re-read fused modules'
# configuration, an assigned plain attribute must.
_assignments = 0


def assignments() -> int:
    """A counter of watched plain-attribute assignments (``training`` excepted)."""
    return _assignments


_PLAIN = (bool, int, float, str)
_MISSING = object()


def _unchanged(module: Any, name: str, value: Any) -> bool:
    """Whether ``module`` holds ``value`` as ``name`` already (the object itself, or an
    equal plain value): NLLB-MoE's router assigns ``self.input_dtype`` on every call.
    A parameter, buffer or submodule is held in the module's tables (a watched name may be
    one here: ``scale`` a flag of another model, a parameter of this one)."""
    held = module.__dict__
    old = held.get(name, _MISSING)
    if old is _MISSING:
        for table in ("_parameters", "_buffers", "_modules"):
            entries = held.get(table)
            if entries and name in entries:
                old = entries[name]
                break
    return old is value or (type(old) is type(value) and type(value) in _PLAIN and old == value)


def _setattr(self, name: str, value: Any) -> None:
    # Only a value that changes moves the generation: ``model.eval()`` at the top of every
    # step of a model already in eval mode changes no plan's key, and must not send each
    # call through the full path (a per-module re-key over the whole tree).
    if name in _watched and tracked(self) and not _unchanged(self, name, value):
        if name == "training":
            _bump_mode()
        else:
            _bump()
            global _assignments
            _assignments += 1
    if _on_setattr:
        callback = _on_setattr.get(threading.get_ident())
        if callback is not None:
            callback(self, name)
    _original_setattr(self, name, value)


if not getattr(_module.Module.__setattr__, "_streamsched", False):
    _setattr._streamsched = True  # type: ignore[attr-defined]
    _module.Module.__setattr__ = _setattr  # type: ignore[method-assign]


# torch.func.functional_call and torch.nn.utils.stateless put the tensors they are given
# straight into the modules' ``_parameters`` / ``_buffers`` (``swap_tensor`` of
# torch.nn.utils._named_member_accessor), without ``__setattr__``, and put the originals
# back the same way. A swap on a tracked module moves the generation (the wrapper then
# re-checks what its plans read: fused stacks, CUDA graphs), and the tensor swapped in is
# remembered (weakly), so that a stack can tell a tensor standing in for a member for a
# while (read it, do not take over its storage) from a member re-assigned for good.
_swapped_in: weakref.WeakKeyDictionary[Any, dict[str, weakref.ref]] = weakref.WeakKeyDictionary()


def swapped_in(module: Any, name: str, tensor: Any) -> bool:
    """Whether ``tensor`` is what the last swap (``functional_call``) put at ``module.name``."""
    entry = _swapped_in.get(module)
    ref = entry.get(name) if entry is not None else None
    return ref is not None and ref() is tensor


def _counting_swaps(swap: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(swap)
    def swap_tensor(module: Any, name: str, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        out = swap(module, name, tensor, *args, **kwargs)
        if tracked(module):
            try:
                ref = weakref.ref(tensor)
            except TypeError:  # None, or the accessor's "missing" marker
                ref = None
            entry = _swapped_in.get(module)
            if entry is None:
                entry = _swapped_in[module] = {}
            if ref is None:
                entry.pop(name, None)
            else:
                entry[name] = ref
            _bump()
        return out

    swap_tensor._streamsched = True  # type: ignore[attr-defined]
    return swap_tensor


try:
    from torch.nn.utils import _named_member_accessor as _accessor
except ImportError:  # pragma: no cover - a torch without the accessor
    _accessor = None  # type: ignore[assignment]
if _accessor is not None and not getattr(_accessor.swap_tensor, "_streamsched", False):
    _accessor.swap_tensor = _counting_swaps(_accessor.swap_tensor)  # type: ignore[assignment]
