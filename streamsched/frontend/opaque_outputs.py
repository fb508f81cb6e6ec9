"""What opaque calls return: learned on the recording call, replayed by later traces.

A leaf call (a ``torch.nn`` built-in, a ``leaf_modules`` class, an opaque class, a
``@streamsched.branch`` module) is one node whose value the trace never sees: fx hands the
traced code a proxy, and the code goes on as if it were a tensor. Where eager's value is
``None``, the traced code can take a branch eager never takes: XLNet's
relative attention returns ``(h, None)``, and ``if output_g is not None:`` is true of a
proxy, so the trace fed the ``None`` to a Linear.

The recording call (:func:`~streamsched.frontend.meta.run_and_record`) runs every leaf
call for real and asks :func:`misleads` of its value: a ``None`` anywhere in a tuple,
list or plain dict, or alone (the trace may have decided ``is None`` on the proxy, even
where nothing reads the value), or a ``None`` the graph reads other than as part of the
model's output (:func:`consistent`; a ``ModelOutput`` field, say). Then the call's
:class:`Skeleton` (its structure: ``None`` where it is ``None``, holes for tensors and
numbers, which stay values) is learned for that model, call structure, train/eval and autocast state, module path and
call index, and the model is traced again: the tracer hands the traced code the real
structure (``(proxy, None)``), so it branches as eager does. The new graph reads the
leaf's value through an :class:`OutputCheck` node that fails loudly on any later call
whose value has another structure (a ``None`` elsewhere), rather than run a branch eager
would not take. A value with no skeleton (an object, a ``ModelOutput``) whose ``None``
the graph reads is refused with a :class:`~streamsched.errors.TraceError`.

A transformers ``ModelOutput`` has a skeleton too (its class, and each field's), learned
where the graph reads one of its ``None`` fields other than into a ``ModelOutput`` of the
model's output (:func:`_reads_a_none_field`): with ``return_dict=False`` a model returns
``to_tuple()`` of its output, which leaves out the ``None`` fields, and made over proxies
it kept them (``None`` items at run time, the tuple longer than eager's). The traced code
then gets a ``ModelOutput`` of that class with ``None`` where eager's has it.

Not seen: a ``None`` field of another object that only decided an ``is None`` branch and
is read by nothing (the trace cannot stand in for such objects).
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Hashable, Optional

import torch
from torch import fx

from ..branch import BranchCall
from .opaque_functions import OpaqueFunction

__all__ = [
    "mark_structure_read",
    "Skeleton",
    "OutputCheck",
    "OpaqueOutputChanged",
    "skeleton_of",
    "misleads",
    "leaf_label",
    "consistent",
    "learned",
    "learn",
]

_CONSTANTS = (type(None), bool, int, float, str)


class OpaqueOutputChanged(RuntimeError):
    """An opaque call returned another structure than the trace was made for.
    ``changed``: which call, what it returned and what the trace was made for."""

    def __init__(self, changed: str, message: str):
        super().__init__(message)
        self.changed = changed


class Skeleton:
    """The structure of a value: ``("tensor",)``, ``("none",)``, ``("value", type name)``
    (a number, a bool or a string: read through a proxy, as before, so that one that
    changes between calls stays a value), ``("tuple", kids)``, ``("list", kids)``,
    ``("dict", ((key, kid), ...))`` or ``("output", ModelOutput class, ((field, kid),
    ...))``; hashable, compared by value."""

    __slots__ = ("shape",)

    def __init__(self, shape: tuple):
        self.shape = shape

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Skeleton) and other.shape == self.shape

    def __hash__(self) -> int:
        return hash(self.shape)

    def __repr__(self) -> str:
        return f"Skeleton{self.shape!r}"

    def has_none(self) -> bool:
        """Whether it holds a ``None`` (which an ``is None`` on a proxy gets wrong)."""
        return _has_none(self.shape)

    def matches(self, value: Any) -> bool:
        return _matches(self.shape, value)

    def rebuild(self, proxy: Any) -> Any:
        """The value the traced code sees: the structure, with ``None`` where it is
        ``None`` and a proxy (read with ``getitem`` from ``proxy``) for everything else."""
        return _rebuild(self.shape, proxy)


def skeleton_of(value: Any) -> Optional[Skeleton]:
    """The skeleton of ``value``, or ``None`` where it holds something a trace cannot
    stand in for (an object, a namedtuple, a ``ModelOutput`` holding one)."""
    shape = _shape(value)
    return None if shape is None else Skeleton(shape)


def _model_output_class(value: Any) -> Optional[type]:
    """The class of a transformers ``ModelOutput`` (a dataclass and an ``OrderedDict``
    holding its fields that are not ``None``), or ``None``; found by name, transformers
    being optional."""
    cls = type(value)
    if isinstance(value, OrderedDict) and is_dataclass(value):
        if any(k.__name__ == "ModelOutput" and k.__module__.startswith("transformers.") for k in cls.__mro__):
            return cls
    return None


def _shape(value: Any) -> Optional[tuple]:
    if isinstance(value, torch.Tensor):
        return ("tensor",)
    output_class = _model_output_class(value)
    if output_class is not None:
        # Every field, None or not: which ones are None decides its keys and to_tuple().
        kids = [(f.name, _shape(getattr(value, f.name))) for f in fields(value)]
        if any(k is None for _, k in kids):
            return None
        return ("output", output_class, tuple(kids))
    if value is None:
        return ("none",)
    if type(value) in _CONSTANTS:
        return ("value", type(value).__name__)
    if type(value) in (tuple, list):
        kids = [_shape(v) for v in value]
        if any(k is None for k in kids):
            return None
        return (type(value).__name__, tuple(kids))
    if type(value) is dict and all(type(k) is str for k in value):
        kids = [(k, _shape(v)) for k, v in value.items()]
        if any(k is None for _, k in kids):
            return None
        return ("dict", tuple(kids))
    return None


def _has_none(shape: tuple) -> bool:
    kind = shape[0]
    if kind in ("tensor", "value", "output"):
        # A ModelOutput's None fields mislead only where the graph reads them
        # (:func:`_reads_a_none_field`).
        return False
    if kind == "none":
        return True
    kids = shape[1] if kind != "dict" else [kid for _, kid in shape[1]]
    return any(_has_none(kid) for kid in kids)


def _matches(shape: tuple, value: Any) -> bool:
    kind = shape[0]
    if kind == "tensor":
        return isinstance(value, torch.Tensor)
    if kind == "none":
        return value is None
    if kind == "value":
        return type(value).__name__ == shape[1]
    if kind in ("tuple", "list"):
        kids = shape[1]
        return type(value).__name__ == kind and len(value) == len(kids) and all(map(_matches, kids, value))
    if kind == "output":
        return type(value) is shape[1] and all(_matches(kid, getattr(value, name)) for name, kid in shape[2])
    if kind == "dict":
        kids = shape[1]
        return (
            type(value) is dict
            and list(value) == [k for k, _ in kids]
            and all(_matches(kid, value[k]) for k, kid in kids)
        )
    return False  # pragma: no cover - no other kinds


def _rebuild(shape: tuple, proxy: Any) -> Any:
    kind = shape[0]
    if kind in ("tensor", "value"):
        return proxy
    if kind == "none":
        return None
    if kind == "tuple":
        return tuple(_rebuild(kid, proxy[i]) for i, kid in enumerate(shape[1]))
    if kind == "list":
        return [_rebuild(kid, proxy[i]) for i, kid in enumerate(shape[1])]
    if kind == "output":
        return _model_output(shape, proxy)
    return {k: _rebuild(kid, proxy[k]) for k, kid in shape[1]}


def _model_output(shape: tuple, proxy: Any) -> Any:
    """A ``ModelOutput`` of the learned class holding ``None`` where the real one does and
    the proxy's fields elsewhere, with the keys eager's has (those not ``None``): its
    ``to_tuple()``, ``[i]`` and ``is None`` tests answer as eager's. Made without its
    ``__post_init__``, which would inspect the proxies as values."""
    cls, kids = shape[1], shape[2]
    output = cls.__new__(cls)
    OrderedDict.__init__(output)
    for name, kid in kids:
        value = None if kid[0] == "none" else _rebuild(kid, getattr(proxy, name))
        object.__setattr__(output, name, value)
        if value is not None:
            OrderedDict.__setitem__(output, name, value)
    return output


def _reads_a_none_field(node: fx.Node, value: Any, in_sequence: Callable[[fx.Node], bool]) -> bool:
    """Whether the graph reads a ``None`` field of leaf call ``node``'s ``ModelOutput``
    ``value`` other than into a ``ModelOutput`` of the model's output (which is rebuilt
    from its fields each call, leaving the ``None`` ones out as eager's constructor does):
    as a value, or into a tuple or list of the output (``in_sequence``): a container the
    traced code built while the proxy stood for the field, such as ``to_tuple()`` with
    ``return_dict=False``, which leaves out the fields that are ``None`` and so has
    another length than eager's. Or the fields as a whole (a method of the value)."""
    names = {f.name for f in fields(value)}
    for user in node.users:
        if user.op == "call_method" and user.args and user.args[0] is node:
            return True
        if user.op == "call_function" and user.target is getattr and len(user.args) == 2 and user.args[0] is node:
            name = user.args[1]
            if isinstance(name, str) and name in names and getattr(value, name) is None:
                if any(u.op != "output" for u in user.users) or in_sequence(user):
                    return True
    return False


class OutputCheck:
    """The node target that reads an opaque call's value in a trace made for its learned
    skeleton: returns the value, or raises :class:`OpaqueOutputChanged` when it has
    another structure (the traced code would run a branch eager does not take)."""

    def __init__(self, skeleton: Skeleton, label: str):
        self.skeleton = skeleton
        self.label = label
        self.__name__ = "check_opaque_output"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __call__(self, value: Any) -> Any:
        if not self.skeleton.matches(value):
            got = skeleton_of(value)
            returned = got.shape if got else type(value).__name__
            raise OpaqueOutputChanged(
                f"'{self.label}' returned {returned}, the trace {self.skeleton.shape}",
                f"'{self.label}' returned {returned} where the trace was made "
                f"for {self.skeleton.shape}: its output structure (None-ness) changes between calls "
                "of one signature, which a trace cannot follow, and the plan writes state in place that it "
                "cannot find again to put back (a tensor only a global holds), so the call cannot be run again "
                "as written. Make its caller a @streamsched.branch or list the "
                "caller's class in leaf_modules=, so that the code reading it runs as written.",
            )
        return value

    def __repr__(self) -> str:
        return f"<check {self.label}: {self.skeleton.shape}>"


def leaf_label(node: fx.Node) -> Optional[str]:
    """What names a leaf call across traces (its module path, or its ``@streamsched.branch``
    function), or ``None`` for a node that is not a leaf call."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_function" and isinstance(node.target, BranchCall):
        return f"branch {node.target.task_name}"
    if node.op == "call_function" and isinstance(node.target, OpaqueFunction):
        return node.target.label
    return None


_STRUCTURE_READ = "streamsched_structure_read"


def mark_structure_read(node: fx.Node) -> None:
    """Note that code which branches on what a value is (``isinstance(output, tuple)`` in
    transformers' capture hooks) read leaf call ``node``'s bare proxy: where the real
    value is not a tensor, the proxy misled it (:func:`misleads`)."""
    node.meta[_STRUCTURE_READ] = True


def misleads(node: fx.Node, value: Any, in_sequence: Callable[[fx.Node], bool] = lambda node: False) -> bool:
    """Whether leaf call ``node``'s real ``value`` may have misled the trace, which saw a
    proxy: a ``None`` anywhere in a structure the tracer can hand the traced code instead
    (``if g is not None:`` may have been decided on the proxy, even where nothing reads
    ``g``), or a value the graph reads other than as it is (:func:`consistent`). Tensors
    never, unless read through an :class:`OutputCheck`: a value read through one misled
    the trace where it has another structure than the check's (the trace was made for
    the structure learned on an earlier call: learned again)."""
    for user in node.users:  # (a loop, not a list: asked of every leaf call's value)
        if user.op == "call_function" and isinstance(user.target, OutputCheck):
            # Read through a check: the trace was made for a learned structure. Another
            # one on a recording call (a new size of the call structure: a mask builder
            # returns None up to a window length and a tensor beyond it) is learned in
            # its place. (The first check, where several read it.)
            return not user.target.skeleton.matches(value)
    if isinstance(value, torch.Tensor):
        return False
    if node.meta.get(_STRUCTURE_READ):
        return True  # code asked the proxy what it is (a capture hook's isinstance): learn it
    skeleton = skeleton_of(value)
    if skeleton is not None and skeleton.has_none():
        return True
    if (
        skeleton.shape[0] == "output" if skeleton is not None else _model_output_class(value) is not None
    ) and _reads_a_none_field(node, value, in_sequence):
        # (A ModelOutput holding an object, a cache, has no skeleton: the trace cannot
        # be made for it, and the call goes to eager dispatch.)
        return True
    return not consistent(node, value)


def consistent(node: fx.Node, value: Any) -> bool:
    """Whether the graph reads ``node``'s real ``value`` only in ways a proxy stood for
    correctly: a tensor any way; a container as it is (passed on, returned) or item by
    item through ``getitem`` / ``getattr`` with a constant key, each item consistent in
    turn, but never as an item of an operation's list argument (``torch.stack([value,
    ...])``) nor as the object of a tensor method: there the code took it for a tensor
    (a hook made the module return a tuple, which ``isinstance`` on the proxy missed);
    a number as data; ``None`` only as part of the model's output, as eager returns it
    (any other reader used it as a tensor, or the code branched on it as one)."""
    if isinstance(value, torch.Tensor):
        return True
    users = list(node.users)
    if value is None:
        return all(u.op == "output" for u in users)
    if type(value) in _CONSTANTS:
        return True  # a number used as data: the graph computes with it as eager does
    for user in users:
        if user.op == "call_method" and user.args and user.args[0] is node:
            return False  # a tensor method called on a container: the code took it for a tensor
        if user.op in ("call_function", "call_method") and _item_of_an_argument(user, node):
            # An item of a list or tuple argument (``torch.stack([value, ...])``): an
            # operation taking tensors there was handed a container.
            return False
        if user.op != "call_function" or user.target not in (operator.getitem, getattr):
            continue  # the container itself, passed on as eager passes it
        if len(user.args) != 2 or user.args[0] is not node or user.kwargs or isinstance(user.args[1], fx.Node):
            continue
        key = user.args[1]
        try:
            item = getattr(value, key) if user.target is getattr else value[key]
        except Exception:  # noqa: BLE001 - an item eager does not have: inconsistent
            return False
        if not consistent(user, item):
            return False
    return True


def _item_of_an_argument(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``node`` is an item of a list, tuple or dict that ``user`` takes as an
    argument (not an argument itself)."""

    def inside(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return any(v is node or inside(v) for v in value)
        if isinstance(value, dict):
            return any(v is node or inside(v) for v in value.values())
        return False

    return any(inside(a) for a in user.args) or any(inside(v) for v in user.kwargs.values())


# model -> {(call structure key, module path, call index): skeleton}. Weak: a model
# dropped takes what was learned about it along.
_LEARNED: weakref.WeakKeyDictionary[Any, dict[tuple, Skeleton]] = weakref.WeakKeyDictionary()


def learned(model: Any, spec_key: Hashable) -> dict[tuple[str, int], Skeleton]:
    """What is known of the opaque calls of ``model`` for calls of ``spec_key``:
    (module path, index among that path's calls) -> skeleton."""
    table = _LEARNED.get(model)
    if not table:
        return {}
    return {(path, index): s for (key, path, index), s in table.items() if key == spec_key}


# Skeletons no guess is made from (see learned_with_guesses).
_BARE = ("none", "tensor", "value")


def learned_with_guesses(model: Any, spec_key: Hashable) -> dict[tuple[str, int], Skeleton]:
    """:func:`learned` for ``spec_key``, and for the opaque calls learned only under other
    call structures, what they returned there (the latest learned): a guess a new call
    structure's trace starts from. A guess is what a trace assumes of any opaque call it
    knows nothing of (a tensor) made better: the recording call checks the value against
    it as against that, relearning where it differs, and every later call checks it too
    (the output checks). An attention function returning ``(output, None)`` under each of
    a model's four call structures (mask or not, gradients or not) is learned once, not
    once per structure with a trace and a recording call each. Containers only: what
    returns a bare ``None`` under one structure (a mask function given no mask) often
    returns a tensor under another, the guess a trace makes anyway. A trace that fails
    with guesses is made again without them (``frontend.trace.trace_model``)."""
    table = _LEARNED.get(model)
    if not table:
        return {}
    guesses: dict[tuple[str, int], Skeleton] = {}
    own: dict[tuple[str, int], Skeleton] = {}
    for (key, path, index), skeleton in table.items():
        if key == spec_key:
            own[(path, index)] = skeleton
        elif skeleton.shape[0] not in _BARE:
            guesses[(path, index)] = skeleton
    guesses.update(own)
    return guesses


def learn(model: Any, spec_key: Hashable, path: str, index: int, skeleton: Skeleton) -> None:
    """Remember what the ``index``-th call of ``path`` returned for calls of ``spec_key``."""
    table = _LEARNED.get(model)
    if table is None:
        table = _LEARNED[model] = {}
    table.pop((spec_key, path, index), None)  # (the latest last: the guess other structures take)
    table[(spec_key, path, index)] = skeleton


_RECORDED = "streamsched_recorded_structure"


def note_recorded_structure(node: fx.Node, value: Any) -> None:
    """Note the structure of leaf call ``node``'s value on the recording call (for
    :func:`check_recorded_structures`)."""
    node.meta[_RECORDED] = skeleton_of(value)


def copy_recorded_structures(nodes: list[fx.Node], renamed: dict[fx.Node, fx.Node]) -> None:
    """What the recording call noted of ``nodes`` goes to their counterparts in a new
    trace (``renamed``: old node to new)."""
    for node in nodes:
        skeleton = node.meta.get(_RECORDED)
        if skeleton is not None and node in renamed:
            renamed[node].meta[_RECORDED] = skeleton


def _may_return_none(node: fx.Node, resolve: Callable[[str], torch.nn.Module]) -> bool:
    """Whether leaf call ``node`` runs code that may return ``None`` on some call: an
    opaque function, a ``@streamsched.branch`` function, or a module that is not a
    ``torch.nn`` built-in (whose forwards return what their arguments make). ``resolve``:
    the graph root's ``get_submodule``."""
    if node.op == "call_function":
        return isinstance(node.target, (OpaqueFunction, BranchCall))
    if node.op != "call_module":
        return False
    try:
        module = resolve(str(node.target))
    except AttributeError:  # pragma: no cover - a graph's modules are its root's
        return True
    return not type(module).__module__.startswith("torch.nn.")


def check_recorded_structures(
    traced: Any, metas: dict, resolve: Optional[Callable[[str], torch.nn.Module]] = None
) -> int:
    """After the recording call: every leaf call that may return ``None`` (see
    :func:`_may_return_none`) and returned a structure without one (a tensor, a tuple of
    tensors) is read through an :class:`OutputCheck` of that structure. The proxy stood
    for the value correctly, so the graph is the one a trace knowing it would make
    (``if out is not None:`` went eager's way); but a later call of the signature
    returning ``None`` there (a mask builder for a batch without padding, after a padded
    one) would feed it to code made for a tensor. The check stops the plan first
    (``Runner.checked``: the state the plan may have written before it is put back,
    ``written_state``, and the call runs as written; or it raises where that state
    cannot be found again). ``metas``: the recording call's value descriptions, by node (the check's is
    its call's). ``traced``: the :class:`~streamsched.frontend.trace.Traced` whose graph
    gets them (it holds its program as traced first: a re-trace compares with that).
    ``resolve``: ``traced.root.get_submodule``, or a resolver of its paths the caller
    has. Returns how many checks were added."""
    graph = traced.graph
    if resolve is None:
        resolve = traced.root.get_submodule
    added = 0
    for node in list(graph.nodes):
        skeleton = node.meta.get(_RECORDED)
        if skeleton is None or skeleton.has_none() or node not in metas or not _may_return_none(node, resolve):
            continue
        if any(u.op == "call_function" and isinstance(u.target, OutputCheck) for u in node.users):
            continue
        if not added:
            traced.hold_traced_program()
        with graph.inserting_after(node):
            check = graph.call_function(OutputCheck(skeleton, leaf_label(node) or node.name), (node,))
        node.replace_all_uses_with(check, delete_user_cb=lambda user, check=check: user is not check)
        metas[check] = metas[node]
        added += 1
    return added
