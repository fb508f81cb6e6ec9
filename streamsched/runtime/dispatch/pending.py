"""Pending values: what a launched branch call returns, standing for the branch's result.

:class:`PendingValue` is used like the result itself and waits for the branch the first
time it is used (through its launch, :meth:`~.launch._Launch.result`); :func:`resolve`
replaces every pending value inside a structure by its result.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Callable, Iterator, Optional

import torch

from .launch import _Launch
from .values import _map


def _resolve_leaf(value: Any) -> Any:
    return value._ss_resolve() if type(value) is PendingValue else value


def resolve(value: Any) -> Any:
    """``value`` with every pending value in it (also inside lists, tuples, dicts) replaced
    by the branch result it stands for, waiting for the branches as needed."""
    return _map(value, _resolve_leaf)


# --- the pending value ---------------------------------------------------------------------

_METADATA = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "size", "dim", "numel", "requires_grad"}
)
_LAZY_INDEX = (int, str, slice, type(None), type(Ellipsis))


def _lazy_key(key: Any) -> bool:
    kind = type(key)
    if kind is tuple:
        return all(type(k) in _LAZY_INDEX for k in key)
    return kind in _LAZY_INDEX


class PendingValue:
    """Stands for a launched branch's result until it is first used.

    Any use (a torch function, an attribute, an operator, ``bool()``, ``len()``...) waits
    for the branch (CPU) or makes the current stream wait for it (CUDA) and then acts on
    the result; a branch's exception is raised there. Indexing with constants
    (``out[0]``, ``out["logits"]``, ``out[:, :4]``) gives another pending value.

    What a pending value cannot imitate: ``type(v)``, ``isinstance(v, torch.Tensor)``
    and identity (``v is None``) see the pending value itself. ``streamsched.runtime.dispatch.resolve(v)``
    gives the result.
    """

    __slots__ = ("_ss_launch", "_ss_parent", "_ss_key", "_ss_cached", "__weakref__")

    def __init__(self, launch: Optional[_Launch], parent: Optional[PendingValue] = None, key: Any = None):
        object.__setattr__(self, "_ss_launch", launch)
        object.__setattr__(self, "_ss_parent", parent)
        object.__setattr__(self, "_ss_key", key)
        object.__setattr__(self, "_ss_cached", _UNSET)

    # --- internals (the _ss_ prefix keeps them out of the forwarded namespace) ---

    def _ss_root(self) -> _Launch:
        node = self
        while node._ss_launch is None:
            node = node._ss_parent
        return node._ss_launch

    def _ss_resolve(self) -> Any:
        launch = self._ss_launch
        if launch is not None:
            return launch.result()
        value = self._ss_parent._ss_resolve()  # the parent's waits, for this stream
        cached = self._ss_cached
        if cached is _UNSET:
            cached = value[self._ss_key]
            object.__setattr__(self, "_ss_cached", cached)
        return cached

    def _ss_peek(self) -> tuple[bool, Any]:
        launch = self._ss_launch
        if launch is not None:
            return launch.peek()
        known, parent = self._ss_parent._ss_peek()
        return (True, parent[self._ss_key]) if known else (False, None)

    def _ss_length(self) -> Optional[int]:
        """The result's length when it is known without waiting for the branch."""
        known, raw = self._ss_peek()
        if known and isinstance(raw, (tuple, list)):
            return len(raw)
        if self._ss_launch is not None and not known:
            return self._ss_launch.expected_len
        return None

    # --- the protocols that make it usable as the value ---

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        return func(*resolve(args), **(resolve(kwargs) if kwargs else {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_ss_"):
            raise AttributeError(name)
        if name in _METADATA:
            # Shapes and dtypes need no synchronisation: keep the stream free to overlap.
            known, raw = self._ss_peek()
            if known and isinstance(raw, torch.Tensor):
                return getattr(raw, name)
        return getattr(self._ss_resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ss_resolve(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._ss_resolve(), name)

    def __getitem__(self, key: Any) -> Any:
        if _lazy_key(key):
            return PendingValue(None, self, key)
        return self._ss_resolve()[resolve(key)]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._ss_resolve()[resolve(key)] = resolve(value)

    def __delitem__(self, key: Any) -> None:
        del self._ss_resolve()[resolve(key)]

    def __len__(self) -> int:
        length = self._ss_length()
        return length if length is not None else len(self._ss_resolve())

    def __iter__(self) -> Iterator[Any]:
        length = self._ss_length()
        if length is not None:
            return iter([PendingValue(None, self, i) for i in range(length)])
        return iter(self._ss_resolve())

    def __reversed__(self) -> Iterator[Any]:
        return reversed(self._ss_resolve())

    def __contains__(self, item: Any) -> bool:
        return resolve(item) in self._ss_resolve()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ss_resolve()(*args, **kwargs)

    def __bool__(self) -> bool:
        return bool(self._ss_resolve())

    def __float__(self) -> float:
        return float(self._ss_resolve())

    def __int__(self) -> int:
        return int(self._ss_resolve())

    def __index__(self) -> int:
        return operator.index(self._ss_resolve())

    def __complex__(self) -> complex:
        return complex(self._ss_resolve())

    def __round__(self, ndigits: Optional[int] = None) -> Any:
        return round(self._ss_resolve(), ndigits)

    def __hash__(self) -> int:
        return hash(self._ss_resolve())

    def __repr__(self) -> str:
        return repr(self._ss_resolve())

    def __str__(self) -> str:
        return str(self._ss_resolve())

    def __format__(self, spec: str) -> str:
        return format(self._ss_resolve(), spec)

    def __dir__(self) -> list[str]:
        return dir(self._ss_resolve())

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        # numpy is optional (neither torch nor streamsched requires it), and only numpy calls
        # __array__: it is imported by then.
        import numpy

        return numpy.asarray(self._ss_resolve(), *args, **kwargs)

    def __copy__(self) -> Any:
        return copy.copy(self._ss_resolve())

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self._ss_resolve(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._ss_resolve().__reduce_ex__(protocol)


_UNSET = object()


def _forward_binary(op: Callable[[Any, Any], Any]) -> Callable[[PendingValue, Any], Any]:
    def method(self: PendingValue, other: Any) -> Any:
        return op(self._ss_resolve(), _resolve_leaf(other))

    return method


def _forward_reflected(op: Callable[[Any, Any], Any]) -> Callable[[PendingValue, Any], Any]:
    def method(self: PendingValue, other: Any) -> Any:
        return op(_resolve_leaf(other), self._ss_resolve())

    return method


def _forward_unary(op: Callable[[Any], Any]) -> Callable[[PendingValue], Any]:
    def method(self: PendingValue) -> Any:
        return op(self._ss_resolve())

    return method


_BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "matmul": operator.matmul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "divmod": divmod,
    "pow": operator.pow,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
    "and": operator.and_,
    "xor": operator.xor,
    "or": operator.or_,
}
_IN_PLACE = {
    "iadd": operator.iadd,
    "isub": operator.isub,
    "imul": operator.imul,
    "imatmul": operator.imatmul,
    "itruediv": operator.itruediv,
    "ifloordiv": operator.ifloordiv,
    "imod": operator.imod,
    "ipow": operator.ipow,
    "ilshift": operator.ilshift,
    "irshift": operator.irshift,
    "iand": operator.iand,
    "ixor": operator.ixor,
    "ior": operator.ior,
}
_COMPARE = {
    "lt": operator.lt,
    "le": operator.le,
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "ge": operator.ge,
}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs, "invert": operator.invert}

for _name, _op in {**_BINARY, **_COMPARE, **_IN_PLACE}.items():
    setattr(PendingValue, f"__{_name}__", _forward_binary(_op))
for _name, _op in _BINARY.items():
    setattr(PendingValue, f"__r{_name}__", _forward_reflected(_op))
for _name, _op in _UNARY.items():
    setattr(PendingValue, f"__{_name}__", _forward_unary(_op))
del _name, _op
