"""Binding a call's arguments fast: the full bind once per call shape, then a lookup.

:class:`~streamsched.frontend.trace.CallBinder` binds a call to ``forward``'s signature
and flattens it (``inspect`` and pytree); the wrapper does that on every call, so its
common cases take a shortcut here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

from .trace import CallBinder, ObjectOf, is_plain

__all__ = ["ShapeCachedBinder"]

_LEAF_SCALARS = (bool, int, float, str)


class _Slot:
    """Stands for one argument in a bind made to learn where each leaf comes from."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class ShapeCachedBinder:
    """``CallBinder.bind`` with a fast path for the calls its own does not take: keyword
    arguments, parameters with defaults (``forward(x, mask=None)``), scalar flags.

    The full bind (``inspect`` and pytree, some 15 us) runs once per call *shape*: how
    many positional arguments, which keywords in which order, and for each value whether
    it is a tensor, ``None`` or which scalar; the spec depends on nothing else. A second
    bind with a placeholder for each argument tells which argument (or default) each leaf
    is; checked against the full bind's leaves, that is reused by later calls of the shape.
    Calls with any other kind of value (lists, dicts, objects) take the full bind.
    """

    _MAX_SHAPES = 64

    _MAX_KINDS = 256

    def __init__(self, binder: CallBinder):
        self.binder = binder
        self.shapes: dict[tuple, Any] = {}
        # Each argument type's tag (_tag_of), for the types whose tag depends on the type
        # alone: the tag loop is on every call's path.
        self.kinds: dict[type, Any] = {}

    def bind(self, args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
        binder = self.binder
        if not kwargs and binder._simple_arity == len(args):
            return binder.bind(args, kwargs)  # positional tensors only: its own fast path
        values = args + tuple(kwargs.values()) if kwargs else args
        tags: list[Any] = []
        kinds = self.kinds
        for v in values:
            kind = type(v)
            tag = kinds.get(kind)
            if tag is None:
                tag = _tag_of(v)
                if tag is _FULL:
                    return binder.bind(args, kwargs)
                if kind not in _BY_VALUE and len(kinds) < self._MAX_KINDS:
                    kinds[kind] = tag
            if tag is _SCALAR:
                tag = (kind, v)
            tags.append(tag)
        shape = (len(args), tuple(kwargs), tuple(tags))
        entry = self.shapes.get(shape)
        if entry is None:
            leaves, spec = binder.bind(args, kwargs)
            if len(self.shapes) < self._MAX_SHAPES:
                self.shapes[shape] = self._learn(args, kwargs, values, leaves, spec)
            return leaves, spec
        if entry is False:
            return binder.bind(args, kwargs)
        spec, picks, consts = entry
        pool = values + consts if consts else values
        return [pool[i] for i in picks], spec

    def _learn(self, args: tuple, kwargs: dict, values: tuple, leaves: list[Any], spec: Any) -> Any:
        """``(spec, picks, consts)`` for this call shape (leaf ``k`` is ``(values + consts)[picks[k]]``),
        or False where that would not give exactly the full bind's leaves."""
        n = len(args)
        slot_args = tuple(None if v is None else _Slot(i) for i, v in enumerate(args))
        slot_kwargs = {k: (None if v is None else _Slot(n + j)) for j, (k, v) in enumerate(kwargs.items())}
        try:
            slot_leaves, _ = self.binder.bind(slot_args, slot_kwargs)
        except Exception:  # noqa: BLE001 - no shortcut then
            return False
        picks: list[int] = []
        consts: list[Any] = []
        for leaf in slot_leaves:
            if type(leaf) is _Slot:
                picks.append(leaf.index)
            else:  # a default the bind filled in: the same object on every call
                picks.append(len(values) + len(consts))
                consts.append(leaf)
        pool = values + tuple(consts)
        if len(picks) != len(leaves) or any(pool[i] is not leaf for i, leaf in zip(picks, leaves)):
            return False
        if spec.has_objects is not None:
            # The spec outlives this call: it must not hold the caller's objects.
            static = tuple((i, v if is_plain(v) else ObjectOf(type(v))) for i, v in spec.static_leaves)
            spec = dataclasses.replace(spec, static_leaves=static)
            if spec.has_objects is None or spec.key is None:  # computed now, from the types alone
                return False
        return spec, picks, tuple(consts)


# Tags: what a call shape records of each argument value.
_SCALAR = "scalar"  # a bool, int, float or str: the value itself, (type, value)
_FULL = "full"  # a container pytree flattens: no shortcut, the full bind
# Types whose tag depends on the value (the contents of a frozenset or slice may or may
# not be plain): never cached by type.
_BY_VALUE = (frozenset, slice)


def _tag_of(value: object) -> Any:
    if isinstance(value, torch.Tensor):
        return 0
    if value is None:
        return 1
    if type(value) in _LEAF_SCALARS:
        return _SCALAR
    if _is_object_leaf(value):
        # An object the call passes whole (a KV cache, a config): its type shapes the
        # call, never its identity (nothing here keeps it alive).
        return ("object", type(value))
    return _FULL


def _is_object_leaf(value: object) -> bool:
    """A value pytree keeps whole (not a container it flattens) that is not plain."""
    kind = type(value)
    return not (kind in pytree.SUPPORTED_NODES or isinstance(value, (list, tuple, dict)) or is_plain(value))
