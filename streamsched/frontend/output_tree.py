"""A model's output taken apart into leaves and rebuilt with its own types.

fx records a traced forward's return value as a graph argument, which turns dicts into
``immutable_dict`` and drops the type of a ``ModelOutput``, an ``OrderedDict`` subclass
or a dataclass. The trace therefore returns the *leaves* of the output, flat, and keeps
an :class:`OutputTree` that rebuilds the exact container each call: the same types,
keys, field order and non-tensor values as eager.

Containers registered with ``torch.utils._pytree`` (tuple, list, dict, ``OrderedDict``,
namedtuples, Hugging Face's ``ModelOutput``) rebuild through pytree; unregistered dict,
list and tuple subclasses and dataclasses are rebuilt here, their instance attributes
copied. Anything else is a leaf.

Example::

    >>> from collections import OrderedDict
    >>> tree = OutputTree.of(OrderedDict(a=1, b=[2, 3]))
    >>> tree.leaves
    [1, 2, 3]
    >>> tree.rebuild([10, 20, 30])
    OrderedDict([('a', 10), ('b', [20, 30])])
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch.utils._pytree as pytree

__all__ = ["OutputTree"]


def _registered(value: Any) -> bool:
    return type(value) in pytree.SUPPORTED_NODES or pytree.is_namedtuple_instance(value)


def _custom_container(value: Any) -> bool:
    """An unregistered container this module knows how to rebuild."""
    if _registered(value):
        return False
    if isinstance(value, (dict, list, tuple)):
        return True
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class _Custom:
    """How to rebuild one unregistered container from its children's values."""

    def __init__(self, value: Any, children: list[Any]):
        self.cls = type(value)
        self.attrs = dict(getattr(value, "__dict__", {}))
        if isinstance(value, dict):
            self.kind = "dict"
            self.keys = list(value.keys())
            children.extend(value.values())
            if dataclasses.is_dataclass(value):
                # A dataclass dict (ModelOutput-like): its fields mirror the items.
                self.attrs = {k: v for k, v in self.attrs.items() if k not in value}
        elif isinstance(value, (list, tuple)):
            self.kind = "list" if isinstance(value, list) else "tuple"
            self.keys = list(range(len(value)))
            children.extend(value)
        else:
            self.kind = "dataclass"
            self.keys = [f.name for f in dataclasses.fields(value)]
            children.extend(getattr(value, k) for k in self.keys)
            self.attrs = {k: v for k, v in self.attrs.items() if k not in self.keys}

    def same_as(self, other: _Custom) -> bool:
        """Whether ``other`` builds the same container: class, kind, keys, and instance
        attributes (plain values by value, anything else by identity)."""
        return (
            self.cls is other.cls
            and self.kind == other.kind
            and self.keys == other.keys
            and self.attrs.keys() == other.attrs.keys()
            and all(_same_attribute(v, other.attrs[k]) for k, v in self.attrs.items())
        )

    def build(self, values: list[Any]) -> Any:
        cls = self.cls
        if self.kind == "tuple":
            out = tuple.__new__(cls, values)
        else:
            out = cls.__new__(cls)
            if self.kind == "dict":
                # The base class's own item assignment: subclasses (ModelOutput) may
                # forbid or redirect their public ones.
                setitem = OrderedDict.__setitem__ if isinstance(out, OrderedDict) else dict.__setitem__
                for k, v in zip(self.keys, values):
                    setitem(out, k, v)
            elif self.kind == "list":
                list.extend(out, values)
            else:
                for k, v in zip(self.keys, values):
                    object.__setattr__(out, k, v)
        if self.attrs:
            for k, v in self.attrs.items():
                object.__setattr__(out, k, v)
        if self.kind == "dict" and dataclasses.is_dataclass(out):
            for k, v in zip(self.keys, values):
                object.__setattr__(out, k, v)
        return out


class OutputTree:
    """The structure of one output value: :meth:`leaves` out, :meth:`rebuild` back in."""

    def __init__(self, treedef: Any, customs: list[tuple[int, _Custom, OutputTree]], n_leaves: int):
        self.treedef = treedef
        # (position in the pytree leaves, how to rebuild, the subtree of its children)
        self.customs = customs
        self.n_leaves = n_leaves
        self.leaves: list[Any] = []

    @classmethod
    def of(cls, value: Any) -> OutputTree:
        """Take ``value`` apart; its leaves are in ``.leaves``."""
        top, treedef = pytree.tree_flatten(value, is_leaf=_custom_container)
        leaves: list[Any] = []
        customs: list[tuple[int, _Custom, OutputTree]] = []
        for pos, item in enumerate(top):
            if _custom_container(item):
                children: list[Any] = []
                custom = _Custom(item, children)
                sub = OutputTree.of(children)
                customs.append((pos, custom, sub))
                leaves.extend(sub.leaves)
            else:
                leaves.append(item)
        tree = cls(treedef, customs, len(leaves))
        tree.leaves = leaves
        return tree

    def same_structure(self, other: Optional[OutputTree]) -> bool:
        """Whether ``other`` rebuilds the same output from the same leaves: the same
        containers (types, keys, named-tuple classes) at every level. A graph returns
        only the leaves, so two traces whose programs read alike may still differ here
        (a flag that picks a dict or a tuple of the same tensors: ``config.return_dict``)."""
        if other is None or self.treedef != other.treedef or len(self.customs) != len(other.customs):
            return False
        return all(
            pos == other_pos and custom.same_as(other_custom) and sub.same_structure(other_sub)
            for (pos, custom, sub), (other_pos, other_custom, other_sub) in zip(self.customs, other.customs)
        )

    @property
    def is_plain(self) -> bool:
        """Whether the output is a single leaf (no container to rebuild)."""
        return not self.customs and self.treedef.is_leaf()

    def rebuild(self, leaves: Any) -> Any:
        """The output container with ``leaves`` (in :attr:`leaves`' order) in place."""
        leaves = list(leaves)
        if not self.customs:
            return pytree.tree_unflatten(leaves, self.treedef)
        top: list[Any] = []
        it = 0
        customs = {pos: (custom, sub) for pos, custom, sub in self.customs}
        for pos in range(self.treedef.num_leaves):
            entry = customs.get(pos)
            if entry is None:
                top.append(leaves[it])
                it += 1
            else:
                custom, sub = entry
                children = sub.rebuild(leaves[it : it + sub.n_leaves])
                it += sub.n_leaves
                top.append(custom.build(list(children)))
        return pytree.tree_unflatten(top, self.treedef)

    def leaf_parents(self, root: Any = None) -> list[Any]:
        """The type of the container holding each leaf directly, in :attr:`leaves`'
        order (``root`` for a leaf that is the output itself, or an item of ``root``
        where this tree is a rebuilt container's children)."""
        top: list[Any] = []
        _spec_parents(self.treedef, root, top, root)
        customs = {pos: (custom, sub) for pos, custom, sub in self.customs}
        parents: list[Any] = []
        for pos, parent in enumerate(top):
            entry = customs.get(pos)
            if entry is None:
                parents.append(parent)
            else:
                custom, sub = entry
                parents.extend(sub.leaf_parents(custom.cls))
        return parents

    def custom_attrs(self) -> list[dict[str, Any]]:
        """The instance attributes copied into every rebuilt unregistered container."""
        out = []
        for _, custom, sub in self.customs:
            out.append(custom.attrs)
            out.extend(sub.custom_attrs())
        return out

    def rebuilder(self) -> Callable[[Any], Any]:
        """A function from what a traced graph returns to the output: the graph returns a
        plain leaf as itself (nothing to rebuild), any container as a tuple of leaves."""
        if self.is_plain:
            return _identity
        return self.rebuild


_PLAIN_ATTRIBUTES = (bool, int, float, complex, str, bytes, type(None))


def _same_attribute(a: Any, b: Any) -> bool:
    """Whether two copied instance attributes are the same: equal plain values, or the same object."""
    if a is b:
        return True
    return type(a) is type(b) and isinstance(a, _PLAIN_ATTRIBUTES) and a == b


def _identity(value: Any) -> Any:
    return value


def _spec_parents(spec: Any, parent: Any, out: list[Any], root: Any = None) -> None:
    """Append the container type of each leaf of pytree ``spec`` to ``out`` (``root``, if
    given, stands for the type of ``spec`` itself: the children list of a rebuilt
    container holds that container's items)."""
    if spec.is_leaf():
        out.append(parent)
        return
    kind = root if root is not None else spec.type
    for child in spec.children() if hasattr(spec, "children") else spec.children_specs:
        _spec_parents(child, kind, out)
