"""Binding a call's arguments fast: the full bind once per call shape, then a lookup.

:class:`CallBinder` binds a call to ``forward``'s signature
and flattens it (``inspect`` and pytree); the wrapper does that on every call, so its
common cases take a shortcut here.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

__all__ = ["CallBinder", "CallSpec", "ShapeCachedBinder"]


@dataclass(frozen=True)
class CallSpec:
    """How one call's arguments split into graph inputs (tensors) and static values."""

    treedef: Any
    tensor_positions: tuple[int, ...]
    static_leaves: tuple[tuple[int, Any], ...]
    # How many arguments the caller passed positionally: a forward rebuilt from the spec
    # gets the same ones positionally (a decorated ``forward(*args, **kwargs)``, as
    # transformers' checkpointing layer, treats the two differently).
    positional: int

    @functools.cached_property
    def key(self) -> Hashable:
        # Plain values key by value; any other object by its type only, so that no cache
        # keyed by this holds a caller's object alive (such calls are never traced: see
        # ``has_objects``).
        static = tuple((i, value_key(v) if is_plain(v) else ("object", _type_of(v))) for i, v in self.static_leaves)
        return (str(self.treedef), self.tensor_positions, _hashable(static), self.positional)

    @functools.cached_property
    def has_objects(self) -> Optional[str]:
        """The type name of the first static argument that is not a plain value (None,
        numbers, strings, enums, dtypes, devices, sizes, classes, functions, and tuples of
        them), or None. A trace would bake such an object in (a cache it updates, a config
        it reads), and a later call passes another one: these calls run as written."""
        for _, v in self.static_leaves:
            if not is_plain(v):
                return _type_of(v).__qualname__
        return None


class ObjectOf:
    """Stands for an object argument in a spec kept after the call: its type, not the
    object (``frontend.binder`` keeps specs per call shape)."""

    __slots__ = ("type",)

    def __init__(self, kind: type):
        self.type = kind

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectOf) and other.type is self.type

    def __hash__(self) -> int:
        return hash(self.type)


def _type_of(value: Any) -> type:
    return value.type if isinstance(value, ObjectOf) else type(value)


_PLAIN_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    type(Ellipsis),
    range,
)


def is_plain(value: Any) -> bool:
    """Whether ``value`` is a plain value a trace may specialise on (see ``CallSpec``)."""
    if isinstance(value, _PLAIN_TYPES):
        return True
    if type(value) in (tuple, frozenset):
        return all(is_plain(v) for v in value)
    if type(value) is slice:
        return is_plain(value.start) and is_plain(value.stop) and is_plain(value.step)
    return False


def value_key(value: Any) -> Any:
    """A plain value as a key of the traces and plans made for it: with its type, a float
    by its bits. ``1``, ``1.0`` and ``True`` are equal in Python, as are ``0.0`` and
    ``-0.0``, and a trace made with one is no trace of another: ``x * 1`` keeps an integer
    tensor's dtype where ``x * 1.0`` makes it float, ``t is True`` tells them apart, and
    ``y / t`` gives ``inf`` for one zero and ``-inf`` for the other."""
    kind = type(value)
    if kind is float:
        return (kind, value.hex())
    if kind is tuple or kind is frozenset:
        return (kind, kind(value_key(v) for v in value))
    return (kind, value)


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
        return value
    except TypeError:
        # An unhashable static value (a list of ints, say): its repr stands for it.
        return ("repr", repr(value))


class CallBinder:
    """Binds ``forward(*args, **kwargs)`` calls to a flat list of leaves, fast.

    The common call (positional tensors only, as many as ``forward`` has required
    positional parameters, no defaults to fill) skips ``inspect`` and pytree entirely.
    """

    def __init__(self, model: torch.nn.Module):
        self.signature = inspect.signature(type(model).forward)
        params = list(self.signature.parameters.values())[1:]  # drop self
        self.signature = self.signature.replace(parameters=params)
        self._simple_arity = None
        if all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params):
            self._simple_arity = len(params)
        self._simple_specs: dict[int, CallSpec] = {}

    def bind(self, args: tuple, kwargs: dict) -> tuple[list[Any], CallSpec]:
        """Return (leaves, spec) for one call; raises TypeError like Python on bad arguments."""
        if (
            not kwargs
            and self._simple_arity == len(args)
            and all(type(a) is torch.Tensor or isinstance(a, torch.Tensor) for a in args)
        ):
            spec = self._simple_specs.get(len(args))
            if spec is None:
                leaves, spec = self._bind_general(args, kwargs)
                self._simple_specs[len(args)] = spec
            return list(args), spec
        return self._bind_general(args, kwargs)

    def _bind_general(self, args: tuple, kwargs: dict) -> tuple[list[Any], CallSpec]:
        # Only the arguments the caller gave (no defaults filled in): the forward is later
        # called with exactly those, so decorators that read or add keyword arguments
        # (transformers' output capturing adds ``use_cache``) see what eager gives them.
        bound = self.signature.bind(*args, **kwargs)
        leaves, treedef = pytree.tree_flatten(dict(bound.arguments))
        tensor_positions = tuple(i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor))
        static = tuple((i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor))
        return leaves, CallSpec(treedef, tensor_positions, static, len(args))

    def bind_error(self, exc: TypeError, kwargs: dict) -> str:
        """What a call that does not fit ``forward`` got wrong, as eager would say it.

        ``inspect.Signature.bind`` reports a missing argument before an unexpected keyword,
        so a misspelt keyword (``scal=`` for ``scale=``) read "missing a required argument:
        'scale'" where eager says "got an unexpected keyword argument 'scal'": name the
        unexpected keywords, with the closest parameter, after its message."""
        params = self.signature.parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return str(exc)
        names = [n for n, p in params.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY]
        unexpected = [k for k in kwargs if k not in names]
        if not unexpected or "unexpected keyword" in str(exc):
            return str(exc)
        parts = []
        for key in unexpected:
            close = difflib.get_close_matches(key, names, n=1)
            parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return f"{exc}; got an unexpected keyword argument {', '.join(parts)}"

    def rebuild(self, leaves: Sequence[Any], spec: CallSpec) -> tuple[tuple, dict]:
        """Inverse of :meth:`bind`: positional and keyword arguments for ``forward``, split
        as the caller split them (``spec.positional``): the signature read may be the one a
        decorator's ``functools.wraps`` shows, while the function called takes
        ``*args, **kwargs`` and tells the two apart.
        """
        given = pytree.tree_unflatten(list(leaves), spec.treedef)
        params = self.signature.parameters.values()
        positional = spec.positional
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for p in params:
            if p.name not in given:
                continue
            value = given[p.name]
            if p.kind is p.POSITIONAL_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and len(args) < positional):
                args.append(value)
            elif p.kind is p.VAR_POSITIONAL:
                args.extend(value)
            elif p.kind is p.VAR_KEYWORD:
                kwargs.update(value)
            else:
                kwargs[p.name] = value
        return tuple(args), kwargs


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
                # (A float by its bits: 0.0 and -0.0 are calls of different specs.)
                tag = (kind, v.hex() if kind is float else v)
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
