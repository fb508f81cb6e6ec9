"""The shortcut for calls whose signature is settled to run the model as written.

Two kinds of call run the model as written whatever their sizes, once decided:

- a call that passes a non-tensor object (a KV cache, a config, a dataclass batch), under
  every executor and every tensor signature (``module.py``, ``_new_signature``): the
  object would be baked into a trace. Its nested children (``nesting.py``) must have gone
  quiet first (none of them scheduled);
- a call of positional tensors whose call structure (the signature without its sizes)
  has nothing to run side by side or batch, once its trial decided the model as written
  for every size (``planning.signatures``: a *uniform* structure). Greedy decoding without
  a cache grows the input every call: every call has a new size.

All such a call needs is the forward itself. Binding, the plan key (every tensor's
shape, dtype, device and grad flag, the modules' modes, autocast) and the LRU lookups
would cost a model of a few tens of microseconds a sixth of its time (a decoding step
with a KV cache is such a call), and none of them can change the verdict.

What can change it is checked on every call, by a function made for the settled call's
layout: the type of each positional argument and each keyword's name and type (a
``None`` where the cache was is another structure, planned as usual); for a tensor
layout also each tensor's dtype, device, grad flag and number of dimensions, grad mode
and autocast (the structure's key less its sizes); and, by the caller, the global
generation (a module re-wired, a mode switched or a hook registered anywhere in the
model) and, for object calls, the nested children's retry falling due.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from .frontend.trace_guard import autocast_state

__all__ = ["SettledCalls", "tensor_meta"]

_MISSING = object()

# A settled tensor layout has no retry to count down to.
_NEVER = 1 << 62

# Sizes a layout settled size by size remembers (the full path's own table of settled
# signatures holds every one).
MAX_SETTLED_SIZES = 256


def tensor_meta(t: torch.Tensor) -> tuple:
    """What a uniform structure's key holds of a tensor: all but its sizes."""
    return (t.dtype, t.device, t.requires_grad, t.dim())


class SettledCalls:
    """The settled call's layout check, the generation it settled at, what ``sm.plan``
    reports, the nested children to count calls for (object calls), and how many calls may
    take the shortcut before their retry."""

    __slots__ = ("generation", "admits", "left", "schedule", "nested", "sizes")

    def __init__(
        self,
        generation: int,
        args: tuple,
        kwargs: dict,
        schedule: Any,
        nested: Any = None,
        left: Optional[int] = None,
        tensors: bool = False,
        sizes: Optional[dict] = None,
    ):
        """``tensors``: a tensor layout (every positional argument a plain tensor, checked
        with its metadata); otherwise an object layout, checked by types alone. ``sizes``:
        for a tensor layout settled size by size, ``{(each tensor's shape, ...): what sm.plan
        reports}`` (more are added as they settle); ``None``: every size."""
        self.generation = generation
        if tensors:
            check = _tensor_layout_check(tuple(tensor_meta(a) for a in args), torch.is_grad_enabled(), autocast_state())
        else:
            check = _object_layout_check(tuple(type(a) for a in args), tuple((k, type(v)) for k, v in kwargs.items()))
        # ``admits(args, kwargs, sizes)``: whether a call has the settled call's layout
        # (and, for a tensor layout with ``sizes``, one of its shapes).
        self.admits: Callable[[tuple, dict, Optional[dict]], bool] = check
        self.left = _NEVER if left is None else left
        self.schedule = schedule
        self.nested = nested
        self.sizes = sizes

    def add_size(self, shapes: tuple, schedule: Any) -> None:
        """Another size of the layout settled to run as written (up to a bound: the table
        is per layout, and a workload of ever new sizes must not grow it for ever)."""
        sizes = self.sizes
        if sizes is not None and len(sizes) < MAX_SETTLED_SIZES:
            sizes[shapes] = schedule


def _compiled_check(tests: list[str], names: dict[str, Any]) -> Callable[[tuple, dict, Optional[dict]], bool]:
    # One expression, no loop: it runs before anything else on every such call, whose
    # whole budget is a microsecond or two. Made once per layout (the callers cache it).
    source = "def check(args, kwargs, sizes):\n    return " + " and ".join(tests) + "\n"
    exec(compile(source, "<streamsched settled layout>", "exec"), names)
    return names["check"]


@functools.lru_cache(maxsize=256)
def _object_layout_check(arg_types: tuple, kw_types: tuple) -> Callable[[tuple, dict, Optional[dict]], bool]:
    """``check(args, kwargs, sizes)``: the same number of positional arguments and keywords,
    each positional argument of its type, each keyword present with its type (``sizes`` is
    not read: an object call runs as written at every size)."""
    names: dict[str, Any] = {"_MISSING": _MISSING}
    tests = [f"len(args) == {len(arg_types)}", f"len(kwargs) == {len(kw_types)}"]
    for i, t in enumerate(arg_types):
        names[f"_A{i}"] = t
        tests.append(f"type(args[{i}]) is _A{i}")
    for i, (name, t) in enumerate(kw_types):
        names[f"_K{i}"] = t
        tests.append(f"type(kwargs.get({name!r}, _MISSING)) is _K{i}")
    return _compiled_check(tests, names)


@functools.lru_cache(maxsize=256)
def _tensor_layout_check(metas: tuple, grad: bool, autocast: tuple) -> Callable[[tuple, dict, Optional[dict]], bool]:
    """``check(args, kwargs, sizes)``: no keywords, as many positional arguments, each a
    plain tensor with the settled one's dtype, device, grad flag and number of dimensions,
    the grad mode and autocast state of the settled call (a structure's key holds both),
    and, unless ``sizes`` is ``None``, the tensors' shapes among its keys."""
    names: dict[str, Any] = {
        "_Tensor": torch.Tensor,
        "_grad": torch.is_grad_enabled,
        "_autocast": autocast_state,
        "_AC": autocast,
    }
    tests = ["not kwargs", f"len(args) == {len(metas)}"]
    for i, (dtype, device, requires_grad, ndim) in enumerate(metas):
        names[f"_D{i}"], names[f"_V{i}"] = dtype, device
        tests.append(
            f"type(args[{i}]) is _Tensor and args[{i}].dtype is _D{i} and args[{i}].device == _V{i} "
            f"and args[{i}].requires_grad is {requires_grad} and args[{i}].dim() == {ndim}"
        )
    tests.append(f"_grad() is {grad}")
    tests.append("_autocast() == _AC")
    shapes = "(" + "".join(f"args[{i}].shape, " for i in range(len(metas))) + ")"
    tests.append(f"(sizes is None or {shapes} in sizes)")
    return _compiled_check(tests, names)
