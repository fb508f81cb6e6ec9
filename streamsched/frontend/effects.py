"""What each op reads and writes, at the level of storage.

A graph's data edges say which node consumes which value; they do not say that
``h.mul_(2)``, ``x[:, :k] = 0``, ``nn.ReLU(inplace=True)``, a BatchNorm updating its
running statistics or a module writing its argument *changes a storage* other nodes
read. Eager PyTorch orders all of these by program order; a scheduler that runs
independent nodes side by side must order them by their effects.

The first call of every signature runs node by node (:mod:`streamsched.frontend.meta`); under
:class:`EffectRecorder` each node's dispatched ops are classified by their schemas
(``Tensor(a!)`` arguments are writes, every other tensor argument a read) and mapped to
storages (views alias their base). :func:`effect_edges` turns the per-node accesses into
ordering edges in eager order: write→read, read→write and write→write on one storage.
Storages a node allocates itself are its own business and never make an edge.

Example::

    >>> import torch
    >>> a = torch.zeros(3)
    >>> with EffectRecorder() as rec:
    ...     rec.begin("n1"); _ = a + 1; rec.end()
    ...     rec.begin("n2"); _ = a[:2].add_(1); rec.end()
    >>> [sorted(e) for e in effect_edges(rec.accesses).values()]
    [['n1']]
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .hooks import global_hooks

__all__ = [
    "Effects",
    "NodeAccess",
    "EffectRecorder",
    "RNG_KEY",
    "effect_edges",
    "element_range",
    "op_accesses",
    "storage_key",
]

# The random-number generators, as one storage every op that draws from them writes
# (``dropout`` in training, ``bernoulli_``, ``randn_like``...: the ops torch tags
# ``nondeterministic_seeded``). Eager draws in program order; a schedule that ran two
# draws side by side, or in another order, or a fused kernel that drew for several
# members at once, would hand each one other numbers than eager does. As a write, every
# draw is ordered after the one before it in eager order, and a node that draws is never
# fused into a batched kernel (node_meta.has_effect). One key for every generator (the
# CPU's, each device's, a ``torch.Generator`` passed in): ordering draws of different
# generators too costs nothing a real model notices. Negative: no storage id is.
RNG_KEY = -1
_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)

# Ops whose output is a fresh tensor although their schema says it aliases the input
# (``torch.tensor([...])`` builds its data below the dispatcher and lifts it).
_LIFTS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"})


def storage_key(t: torch.Tensor) -> Optional[int]:
    """An identity of ``t``'s storage, shared by every view of it (``None``: no storage)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def element_range(t: torch.Tensor) -> tuple[int, int]:
    """The elements of its storage ``t`` reaches: ``[start, end)`` (empty for no element)."""
    start = t.storage_offset()
    if t.numel() == 0:
        return start, start
    return start, start + 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))


_SCALARS = (bool, int, float, str, torch.dtype, torch.device)


def _tensors(value: Any) -> list[torch.Tensor]:
    # Most arguments are one tensor or a scalar: no pytree walk for those (the recording
    # call dispatches every op of the model through here).
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, _SCALARS):
        return []
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


@dataclass(frozen=True)
class _OpFacts:
    """What :func:`op_accesses` and :func:`fresh_outputs` read of an op's schema, read once
    per op (an ``OpOverload``'s schema never changes)."""

    positional_writes: tuple[bool, ...]
    """Per positional argument: written in place (``Tensor(a!)``)."""
    keyword_writes: dict[str, bool]
    """Per argument name (every argument): written in place."""
    lifts: bool
    fresh_returns: tuple[bool, ...]
    """Per return: owns new storage (no alias annotation)."""
    seeded: bool = False
    """Draws from a random-number generator (:data:`RNG_KEY`)."""
    unmarked_writes: Optional[tuple[tuple[int, ...], Optional[int]]] = None
    """(positions, flag position) of the arguments an op writes in place although its
    schema does not mark them (``_UNMARKED_WRITES``), where the flag argument (if any)
    is true."""


_OP_FACTS: dict[Any, _OpFacts] = {}

# Ops that write arguments their schema does not mark as written: a batch norm in
# training updates its running statistics (``native_batch_norm``, the op ``F.batch_norm``
# dispatches, and the cuDNN and MIOpen kernels, when ``training``; SyncBatchNorm's
# statistics ops always). Recorded apart (``NodeAccess.unmarked``): they order nothing
# while no other node touches a batch norm's statistics (``_order_shared_unmarked``
# makes them writes where one does), but they are state the call wrote
# (``Effects.writes_state``, ``written_state``).
_UNMARKED_WRITES: dict[str, tuple[tuple[int, ...], Optional[int]]] = {
    "aten::native_batch_norm": ((3, 4), 5),
    "aten::cudnn_batch_norm": ((3, 4), 5),
    "aten::miopen_batch_norm": ((3, 4), 5),
    "aten::batch_norm_update_stats": ((1, 2), None),
    "aten::batch_norm_gather_stats": ((3, 4), None),
    "aten::batch_norm_gather_stats_with_counts": ((3, 4), None),
}


def _op_facts(func: Any) -> _OpFacts:
    facts = _OP_FACTS.get(func)
    if facts is None:
        schema = func._schema

        def writes(arg: Any) -> bool:
            return arg.alias_info is not None and arg.alias_info.is_write

        facts = _OpFacts(
            positional_writes=tuple(writes(a) for a in schema.arguments if not a.kwarg_only),
            keyword_writes={a.name: writes(a) for a in schema.arguments},
            lifts=schema.name in _LIFTS,
            fresh_returns=tuple(r.alias_info is None for r in schema.returns),
            seeded=_SEEDED is not None and _SEEDED in getattr(func, "tags", ()),
            unmarked_writes=_UNMARKED_WRITES.get(schema.name),
        )
        _OP_FACTS[func] = facts
    return facts


def op_accesses(func: Any, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(read, written) tensor arguments of one dispatched op, from its schema."""
    facts = _op_facts(func)
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    for written, value in zip(facts.positional_writes, args):
        (writes if written else reads).extend(_tensors(value))
    by_name = facts.keyword_writes
    for name, value in kwargs.items():
        if name in by_name:
            (writes if by_name[name] else reads).extend(_tensors(value))
    return reads, writes


def fresh_outputs(func: Any, out: Any) -> list[torch.Tensor]:
    """Outputs of one op that own new storage (not views or the written arguments)."""
    facts = _op_facts(func)
    if facts.lifts:
        return list(_tensors(out))
    returns = facts.fresh_returns
    outs = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    fresh: list[torch.Tensor] = []
    for is_fresh, value in zip(returns, outs):
        if is_fresh:
            fresh.extend(_tensors(value))
    return fresh


@dataclass
class NodeAccess:
    """The storages one node read and wrote that it did not allocate itself."""

    reads: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)
    fresh: set[int] = field(default_factory=set)
    unmarked: set[int] = field(default_factory=set)
    """Storages written by ops whose schema does not say so (``_UNMARKED_WRITES``: a
    batch norm's running statistics): state, but no ordering."""

    def external(self) -> tuple[set[int], set[int]]:
        return self.reads - self.fresh - self.writes, self.writes - self.fresh


# ``StorageWeakRef.expired()``, without its two Python frames (it calls
# ``torch.Storage._expired``, which calls this): asked for nearly every tensor of every
# recorded op.
_UNTYPED_EXPIRED = getattr(torch.UntypedStorage, "_expired", None)


def _expired(ref: StorageWeakRef) -> bool:
    if _UNTYPED_EXPIRED is None:  # pragma: no cover - another torch
        return ref.expired()
    return _UNTYPED_EXPIRED(ref.cdata)


# What StorageWeakRef wraps: a weak reference to a storage as a plain int, which must be
# freed once. The recorder holds one per storage it named (thousands on a model of many
# small ops): made, checked and freed directly, they cost a fraction of the wrapper
# objects (a Python __init__ and __del__ each).
_FREE_WEAK_REF = getattr(torch.UntypedStorage, "_free_weak_ref", None)
_RAW_WEAK_REFS = (
    _UNTYPED_EXPIRED is not None and _FREE_WEAK_REF is not None and hasattr(torch.UntypedStorage, "_weak_ref")
)


class EffectRecorder(TorchDispatchMode):
    """Records, per node (``begin(name)`` .. ``end()``), the storages its ops touch.

    Storages are named by an id per storage *lifetime*: a freed storage's address often
    comes back as a new value's, and naming by address alone would tie the two values
    together (an ordering edge between nodes that share nothing, which blocks fusion; and
    which ones depended on the allocator, so plans differed from run to run). A weak
    reference per storage tells a live storage from a new one at the same address.
    Nothing is kept alive, so the first call's peak memory stays eager's.
    """

    def __init__(self, regions: Optional[dict[int, list[tuple[int, int]]]] = None) -> None:
        """``regions``: storages (by ``_cdata``) holding several tensors side by side, each
        with the element ranges ``[start, end)`` of its tensors, sorted (a fused group's
        stack, whose members are views of their slices: ``FusionContext.stack_regions``).
        An access within one range is named by that range, so that members of a stack
        written one by one (a batch norm's statistics in training) order nothing; where
        some access spans ranges, the storage is named as a whole after all
        (:meth:`merge_spanning`)."""
        super().__init__()
        self.accesses: dict[str, NodeAccess] = {}
        self._current: Optional[NodeAccess] = None
        # address -> (id, weak ref): a raw weak reference (an int, freed by this recorder)
        # where torch offers them, else a StorageWeakRef.
        self._ids: dict[int, tuple[int, Any]] = {}
        self._next_id = itertools.count()
        self._raw = _RAW_WEAK_REFS
        self._regions = regions or None
        self._region_ids: dict[tuple[int, int], int] = {}  # (storage id, range) -> id
        self._whole_of: dict[int, int] = {}  # a range's id -> its storage's id
        self._spanning: set[int] = set()  # storage ids some access named as a whole

    def __del__(self) -> None:
        self.release()

    def release(self) -> None:
        """Free the weak references to the storages named (done when the recorder goes)."""
        ids, self._ids = self._ids, {}
        if self._raw and _FREE_WEAK_REF is not None:
            free = _FREE_WEAK_REF
            for _, ref in ids.values():
                free(ref)

    # The recorder only reads tensors' metadata and calls each op as it came: nothing in
    # it for dynamo to compile or skip, so no per-op wrapper to skip it (the wrapper
    # TorchDispatchMode puts around __torch_dispatch__ otherwise cost a tenth of the
    # recording call on a model of thousands of small ops). The wrapped model's whole call
    # runs outside dynamo anyway (StreamScheduledModule.forward).
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def key_of(self, t: torch.Tensor) -> Optional[int]:
        """The id of ``t``'s storage for this recording (None where it has none)."""
        try:  # storage_key, inlined (called for every tensor of every recorded op)
            address = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, AttributeError):
            return None
        entry = self._ids.get(address)
        if self._raw:
            if entry is None or _UNTYPED_EXPIRED(entry[1]):
                if entry is not None:
                    _FREE_WEAK_REF(entry[1])
                entry = self._ids[address] = (next(self._next_id), t.untyped_storage()._weak_ref())
        elif entry is None or _expired(entry[1]):
            entry = self._ids[address] = (next(self._next_id), StorageWeakRef(t.untyped_storage()))
        if self._regions is not None:
            ranges = self._regions.get(address)
            if ranges is not None:
                return self._region_key(t, entry[0], ranges)
        return entry[0]

    def _region_key(self, t: torch.Tensor, whole: int, ranges: list[tuple[int, int]]) -> int:
        """The id of the range of ``ranges`` that holds all of ``t`` (``whole``: its
        storage's id), or ``whole`` where none does (noted: :meth:`merge_spanning`)."""
        if whole in self._spanning or t.numel() == 0:
            return whole
        start, end = element_range(t)
        i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
        if i < 0 or ranges[i][1] < end:
            self._spanning.add(whole)
            return whole
        key = self._region_ids.get((whole, i))
        if key is None:
            key = self._region_ids[(whole, i)] = next(self._next_id)
            self._whole_of[key] = whole
        return key

    def merge_spanning(self) -> None:
        """Name by its storage every range of a storage some access spanned (call once
        the recording ran, before reading ``accesses``): ranges then order as one."""
        if not self._spanning:
            return
        rename = {key: whole for key, whole in self._whole_of.items() if whole in self._spanning}
        if not rename:
            return
        for acc in self.accesses.values():
            for keys in (acc.reads, acc.writes, acc.fresh, acc.unmarked):
                hits = [k for k in keys if k in rename]
                for k in hits:
                    keys.discard(k)
                    keys.add(rename[k])

    def begin(self, name: str) -> None:
        current = self.accesses.get(name)
        if current is None:
            current = self.accesses[name] = NodeAccess()
        self._current = current

    def end(self) -> None:
        self._current = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        acc = self._current
        if acc is None:
            return out
        # What op_accesses and fresh_outputs say, inlined: this runs for every op of the
        # recording call (thousands on a model of many small modules).
        facts = _OP_FACTS.get(func)
        if facts is None:
            facts = _op_facts(func)
        key_of = self.key_of
        written: list[torch.Tensor] = []
        for writes, value in zip(facts.positional_writes, args):
            if writes:
                written.extend(_tensors(value))
            elif isinstance(value, torch.Tensor):
                key = key_of(value)
                if key is not None:
                    acc.reads.add(key)
            elif value is not None and not isinstance(value, _SCALARS):
                for t in _tensors(value):
                    key = key_of(t)
                    if key is not None:
                        acc.reads.add(key)
        if kwargs:
            by_name = facts.keyword_writes
            for name, value in kwargs.items():
                if name not in by_name:
                    continue
                if by_name[name]:
                    written.extend(_tensors(value))
                else:
                    for t in _tensors(value):
                        key = key_of(t)
                        if key is not None:
                            acc.reads.add(key)
        for t in written:
            key = key_of(t)
            if key is not None and key not in acc.fresh:
                acc.writes.add(key)
        unmarked = facts.unmarked_writes
        if unmarked is not None:
            positions, flag = unmarked
            if flag is None or (flag < len(args) and args[flag]):
                for i in positions:
                    if i < len(args) and isinstance(args[i], torch.Tensor):
                        key = key_of(args[i])
                        if key is not None and key not in acc.fresh:
                            acc.unmarked.add(key)
        if facts.seeded:
            acc.writes.add(RNG_KEY)
        if facts.lifts:
            fresh = _tensors(out)
        elif isinstance(out, torch.Tensor):
            fresh = [out] if facts.fresh_returns[:1] == (True,) else []
        else:
            fresh = fresh_outputs(func, out)
        for t in fresh:
            key = key_of(t)
            if key is not None:
                acc.fresh.add(key)
        return out


def effect_edges(accesses: dict[str, NodeAccess]) -> dict[str, set[str]]:
    """For each node (in the recorded, eager order), the earlier nodes it must follow
    because of a shared storage: after the last writer of what it reads or writes, and
    after every reader since that write of what it writes."""
    last_writer: dict[int, str] = {}
    readers: dict[int, set[str]] = {}
    after: dict[str, set[str]] = {}
    for name, acc in accesses.items():
        reads, writes = acc.external()
        deps: set[str] = set()
        for key in reads | writes:
            w = last_writer.get(key)
            if w is not None:
                deps.add(w)
        for key in writes:
            deps |= readers.get(key, set())
        deps.discard(name)
        for key in reads:
            readers.setdefault(key, set()).add(name)
        for key in writes:
            last_writer[key] = name
            readers[key] = set()
        if deps:
            after[name] = deps
    return after


def written_storages(accesses: dict[str, NodeAccess]) -> set[int]:
    """Every storage some node writes without having allocated it."""
    out: set[int] = set()
    for acc in accesses.values():
        out |= acc.external()[1]
    return out


def parameter_writers(accesses: dict[str, NodeAccess], key_of: Any, parameters: Any) -> frozenset:
    """The nodes of a recording (``accesses``, its storage ids ``key_of``) that wrote
    the storage of one of ``parameters`` (:attr:`Effects.parameter_writers`)."""
    keys = {key_of(p) for p in parameters} - {None}
    if not keys:
        return frozenset()
    return frozenset(name for name, acc in accesses.items() if acc.writes & keys)


def _order_shared_unmarked(accesses: dict[str, NodeAccess]) -> None:
    """Make an unmarked write (a batch norm's running statistics) a write like any other
    where another node touches the same storage: a tensor the model holds that aliases
    the statistics (a buffer registered as ``bn.running_mean[:3]``, the same buffer under
    a second name) read after the batch norm, or one pair of statistics that
    ``F.batch_norm`` updates on two branches. Eager orders these by program order; a
    schedule must too."""
    unmarked: dict[int, list[str]] = {}
    for name, acc in accesses.items():
        for key in acc.unmarked - acc.fresh:
            unmarked.setdefault(key, []).append(name)
    if not unmarked:
        return
    touching: dict[int, set[str]] = {}
    for name, acc in accesses.items():
        for key in (acc.reads | acc.writes | acc.unmarked) & unmarked.keys():
            touching.setdefault(key, set()).add(name)
    for key, names in touching.items():
        if len(names) > 1:
            for name in unmarked[key]:
                accesses[name].writes.add(key)


def unmarked_state(accesses: dict[str, NodeAccess]) -> set[int]:
    """The storages written by ops whose schema does not say so (a batch norm's running
    statistics in training) that no node of the call allocated."""
    out: set[int] = set()
    fresh: set[int] = set()
    for acc in accesses.values():
        out |= acc.unmarked
        fresh |= acc.fresh
    return out - fresh


@dataclass
class Effects:
    """The in-place effects of one traced graph, by node name.

    ``after[n]``: nodes ``n`` must follow because of a shared storage (beyond its data
    inputs). ``reads[n]`` / ``writes[n]``: the *locations* (small ints, one per storage
    some node writes) node ``n`` reads and writes, for the race checker. Empty when no
    node writes anything it did not allocate, the common case.
    """

    after: dict[str, set[str]] = field(default_factory=dict)
    reads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    writes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_locations: int = 0
    writes_inputs: bool = False
    """Whether some node writes the storage of a graph input (the plan then holds only
    for the way the inputs alias each other on the call that recorded it)."""
    sees: dict[str, dict[int, Optional[str]]] = field(default_factory=dict)
    """For each node and location it accesses: the node whose write it must see (the
    last writer before it in eager order; ``None``: the state before the call). The race
    checker holds every run to it, so a reordering is caught, not only a race."""
    outputs_written: frozenset = frozenset()
    """Nodes whose own fresh output (or a view of it) a later node writes in place: a
    rewrite must not make such a value share storage with another one (fusion's cat of
    a group's outputs as a view of the kernel's output, say), or the write would show
    there too."""
    writes_state: bool = False
    """Whether some node writes a storage no node of the call allocated (a buffer, a
    parameter, an input, a tensor a module holds): a call stopped part way has changed
    state; one that writes only what the call allocated (``index_add_`` into a
    ``zeros`` of its own) has not."""
    # (Last: from_accesses passes the fields above by position.)
    parameter_writers: frozenset = frozenset()
    """Nodes that write a parameter of the model in place (a weight renormalised under
    ``no_grad`` inside a forward): never fused, since a fused member's parameter is a
    view of its group's stack, which autograd refuses to see written
    (:func:`parameter_writers`)."""

    @property
    def involved(self) -> set[str]:
        """Nodes ordered by an effect edge: their order must be kept exactly (they are
        never fused into a batched kernel). A node writing a storage nobody else touches
        (a BatchNorm's own running statistics) needs no edge and stays fusable."""
        out: set[str] = set()
        for name, deps in self.after.items():
            out.add(name)
            out |= deps
        return out

    def __bool__(self) -> bool:
        return bool(self.writes)

    @classmethod
    def from_accesses(
        cls, accesses: dict[str, NodeAccess], input_keys: frozenset = frozenset(), graph: Any = None
    ) -> Effects:
        """Summarise a recording; with ``graph`` (the fx graph that ran), edges its data
        edges already imply are dropped (``relu_`` on a fresh conv output orders nothing
        new, and such nodes stay fusable)."""
        _order_shared_unmarked(accesses)
        written = written_storages(accesses)
        if not written:
            return cls(writes_state=bool(unmarked_state(accesses)))
        location = {key: i for i, key in enumerate(sorted(written))}
        allocated_by: dict[int, str] = {}
        outputs_written: set[str] = set()
        reads: dict[str, tuple[int, ...]] = {}
        writes: dict[str, tuple[int, ...]] = {}
        sees: dict[str, dict[int, Optional[str]]] = {}
        last_writer: dict[int, str] = {}
        for name, acc in accesses.items():
            r, w = acc.external()
            r_loc = tuple(sorted(location[k] for k in r if k in location))
            w_loc = tuple(sorted(location[k] for k in w))
            if r_loc:
                reads[name] = r_loc
            if w_loc:
                writes[name] = w_loc
            if r_loc or w_loc:
                sees[name] = {loc: last_writer.get(loc) for loc in r_loc + w_loc}
            for loc in w_loc:
                last_writer[loc] = name
            for key in w:
                owner = allocated_by.get(key)
                if owner is not None and owner != name:
                    outputs_written.add(owner)
            for key in acc.fresh:
                allocated_by.setdefault(key, name)
        after = effect_edges(accesses)
        if graph is not None:
            after = _prune_implied(after, graph)
        # The generators' state is not one a call stopped part way leaves changed: the
        # runner puts it back itself (Runner.checked) before running the call as written.
        state = bool(written - set(allocated_by) - {RNG_KEY}) or bool(unmarked_state(accesses))
        return cls(
            after, reads, writes, len(location), bool(written & input_keys), sees, frozenset(outputs_written), state
        )


def _prune_implied(after: dict[str, set[str]], graph: Any) -> dict[str, set[str]]:
    """``after`` without the edges that data edges (and earlier kept edges) already imply."""
    bit: dict[str, int] = {}
    ancestors: dict[str, int] = {}
    kept: dict[str, set[str]] = {}
    for i, node in enumerate(graph.nodes):
        bit[node.name] = i
        anc = 0
        for inp in node.all_input_nodes:
            anc |= ancestors[inp.name] | (1 << bit[inp.name])
        deps = after.get(node.name)
        if deps:
            for dep in sorted(deps, key=lambda d: -bit.get(d, -1)):
                b = bit.get(dep)
                if b is None or (anc >> b) & 1:
                    continue
                kept.setdefault(node.name, set()).add(dep)
                anc |= ancestors[dep] | (1 << b)
        ancestors[node.name] = anc
    return kept


# --- calls that write nothing -----------------------------------------------------------

# ``torch.nn`` classes whose call (``forward``, no hooks, plain tensors in and held) runs
# ops that only read their tensor arguments and the module's parameters and buffers, and
# return new tensors (or their input): whatever the sizes, dtypes, device, grad mode or
# autocast state. The value: the attribute that must be ``False`` for that to hold
# (``inplace``, ``training``), or ``None``.
_READING_MODULES: dict[type, Optional[str]] = {
    torch.nn.Linear: None,
    torch.nn.Conv1d: None,
    torch.nn.Conv2d: None,
    torch.nn.Conv3d: None,
    torch.nn.LayerNorm: None,
    torch.nn.GELU: None,
    torch.nn.Sigmoid: None,
    torch.nn.Tanh: None,
    torch.nn.Softmax: None,
    torch.nn.LogSoftmax: None,
    torch.nn.Identity: None,
    torch.nn.ReLU: "inplace",
    torch.nn.ReLU6: "inplace",
    torch.nn.LeakyReLU: "inplace",
    torch.nn.ELU: "inplace",
    torch.nn.SiLU: "inplace",
    torch.nn.Hardswish: "inplace",
    torch.nn.Hardsigmoid: "inplace",
    torch.nn.Hardtanh: "inplace",
    torch.nn.Mish: "inplace",
    # In training, dropout draws its mask into a tensor of its own (inplace: writes its
    # input); in eval it returns its input.
    torch.nn.Dropout: "training",
}

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain_index(index: Any) -> bool:
    """Whether ``index`` is a basic index of ints and int slices (a view: no copy, no
    write), or a tuple of such, ``None`` and ``...``."""
    kind = type(index)
    if kind is int or index is None or index is Ellipsis:
        return True
    if kind is slice:
        return all(v is None or type(v) is int for v in (index.start, index.stop, index.step))
    if kind is tuple:
        return all(type(v) is not tuple and _plain_index(v) for v in index)
    return False


def _reading_class(kind: type) -> Any:
    """The attribute a ``kind`` instance's call reads only with (``False`` there; ``""``:
    none), or ``None`` where calling one may write or run more than its ``forward``."""
    if kind not in _READING_MODULES:
        return None
    module = torch.nn.Module
    if kind.__call__ is not module.__call__ or kind._call_impl is not module._call_impl:
        return None
    return _READING_MODULES[kind] or ""


_READING_CLASSES: dict[type, Any] = {}


def _plain_module(module: Any) -> bool:
    """Whether calling ``module`` runs only its class's ``forward`` (no hook, no
    per-instance ``forward``, no compiled call), with plain tensors held, and reads only
    (:data:`_READING_MODULES`)."""
    kind = type(module)
    flag = _READING_CLASSES.get(kind, False)
    if flag is False:
        flag = _READING_CLASSES[kind] = _reading_class(kind)
    if flag is None:
        return False
    state = module.__dict__
    if flag and state.get(flag, True) is not False:
        return False
    if (
        "forward" in state
        or state.get("_compiled_call_impl") is not None
        or state.get("_modules")
        or state.get("_forward_hooks")
        or state.get("_forward_pre_hooks")
        or state.get("_backward_hooks")
        or state.get("_backward_pre_hooks")
    ):
        return False
    for table in (state.get("_parameters"), state.get("_buffers")):
        if table is None:
            return False
        for t in table.values():
            if t is not None and type(t) not in _PLAIN_TENSOR_TYPES:
                return False
    return True


def reads_only(graph: Any, resolve: Any, inputs: list[Any]) -> bool:
    """Whether no op of a recording call of ``graph`` can write a storage: every input is
    a plain tensor, and every node is a call of a module :data:`_READING_MODULES` allows
    (as :func:`_plain_module` says) on one value, a basic index of a value
    (``x[:, a:b]``) or ``torch.cat`` / ``torch.stack`` of a list of values; and no mode
    or global module hook is in play. Then :class:`EffectRecorder` would record no write,
    and ``Effects.from_accesses`` of its recording is ``Effects()`` whatever else it
    recorded: the call needs no recorder. Every value is then a plain tensor too (such
    calls of plain tensors return plain tensors), so none of them can dispatch elsewhere.
    ``resolve``: the module of a ``call_module`` node's target."""
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    if global_hooks():
        return False
    for t in inputs:
        if type(t) is not torch.Tensor:
            return False
    node_type = torch.fx.Node
    cat, stack, getitem = torch.cat, torch.stack, operator.getitem
    seen: dict[int, bool] = {}
    for node in graph.nodes:
        op = node.op
        if op == "call_module":
            args = node.args
            if node.kwargs or len(args) != 1 or type(args[0]) is not node_type:
                return False
            module = resolve(node.target)
            plain = seen.get(id(module))
            if plain is None:
                plain = seen[id(module)] = _plain_module(module)
            if not plain:
                return False
        elif op == "call_function":
            target, args = node.target, node.args
            if target is getitem:
                if node.kwargs or len(args) != 2 or type(args[0]) is not node_type or not _plain_index(args[1]):
                    return False
            elif target is cat or target is stack:
                kwargs = node.kwargs
                if len(args) + len(kwargs) > 2 or not args or any(k != "dim" for k in kwargs):
                    return False
                values = args[0]
                if type(values) not in (list, tuple, torch.fx.immutable_collections.immutable_list) or not all(
                    type(v) is node_type for v in values
                ):
                    return False
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                if type(dim) is not int:
                    return False
            else:
                return False
        elif op not in ("placeholder", "output"):
            return False
    return True
