"""The shortcut for calls whose signature is settled to run the model as written.

Two kinds of call run the model as written whatever their sizes, once decided:

- a call that passes a non-tensor object (a KV cache, a config, a dataclass batch), under
  every executor and every tensor signature (``pipeline.new_signature``): the
  object would be baked into a trace. Its nested children (``nesting.py``) must have gone
  quiet first (none of them scheduled);
- a call of tensors and plain values whose call structure (the signature without its
  sizes) has nothing to run side by side or batch, once its trial decided the model as
  written for every size (``planning.signatures``: a *uniform* structure). Greedy decoding
  without a cache grows the input every call: every call has a new size;
- a call of tensors and plain values at a size settled to run as written (its size
  bucket's verdict), through a table of the layout's settled shapes;
- a call of tensors and plain values at a size its call structure has never met, where
  the size policy would run it as written for being new (``planning.signatures``: not
  seen, not planned, its bucket neither decided nor under trial): it is counted as seen,
  as the full path would count it, and the next call of that size takes the full path.
  A decoding loop brings a new size on every call, from its first;
- a call of tensors and plain values whose plain numbers (ints, floats, tuples of them:
  a temperature, a timestep, a guidance scale) hold values its call structure has not
  met, where a value new to the structure runs as written (``new_signatures``: under
  every executor): a *varying* layout checks everything but those numbers, and their
  values against a table of the values it met (``ValueTable``). A value not in the table
  is added and runs as written; one in it came back and takes the full path, which plans
  it. A sampler passes a new timestep on every call.

All such a call needs is the forward itself. Binding, the plan key (every tensor's
shape, dtype, device and grad flag, the modules' modes, autocast) and the LRU lookups
would cost a model of a few tens of microseconds a sixth of its time (a decoding step
with a KV cache is such a call), and none of them can change the verdict.

What can change it is checked on every call, by a function made for the settled call's
layout: the type of each positional argument and each keyword's name and type (a
``None`` where the cache was is another structure, planned as usual); for a tensor
layout each tensor's dtype, device, grad flag and number of dimensions, each plain
value's type and value, grad mode and autocast (the structure's key less its sizes), and
the shapes where it settled size by size; and, by the caller, the global
generation (a module re-wired, a mode switched or a hook registered anywhere in the
model) and, for object calls, the nested children's retry falling due.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Optional

import torch

from .frontend.binder import is_plain
from .frontend.trace_guard import autocast_state
from .planning.signatures import ANY_SIZE, rare_text, size_bucket

__all__ = [
    "BucketCall",
    "SettledCalls",
    "SizeTable",
    "ValueTable",
    "settles",
    "shapes_of",
    "tensor_layout_check",
    "tensor_meta",
    "tensors_of",
    "value_entry",
]

_MISSING = object()

# A settled tensor layout has no retry to count down to.
_NEVER = 1 << 62

# Sizes a layout settled size by size remembers (the full path's own table of settled
# signatures holds every one).
MAX_SETTLED_SIZES = 256
# Size buckets it remembers (a structure keeps the verdicts of as many), and the shapes
# they admitted that it remembers (forgotten all at once when full).
MAX_SETTLED_BUCKETS = 64
MAX_BUCKET_HITS = 1024

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


class BucketCall:
    """What ``sm.plan`` reports for a call a settled size bucket admitted: the bucket's
    verdict (``plan_for``, kept in ``SizeTable.buckets``) for the call's own shapes, made
    when read. Read by the call path as an as-written signature's record."""

    __slots__ = ("plan_for", "shapes")

    as_written = True
    alias_pattern = None
    trial = None
    nests = False
    every_size = False

    def __init__(self, plan_for: Callable[[tuple], Any], shapes: tuple):
        self.plan_for = plan_for
        self.shapes = shapes

    @property
    def plan(self) -> Any:
        return self.plan_for(self.shapes)


class RareCall:
    """What ``sm.plan`` reports for a call of a size that comes back too rarely to repay a
    plan, run as written by a settled layout (``Structure.rare_again``): made when read,
    from the call's shapes and what they were judged on, which each such call sets."""

    __slots__ = ("plan_for", "shapes", "interval", "rarity")

    as_written = True
    alias_pattern = None
    trial = None
    nests = False
    every_size = False

    def __init__(self, plan_for: Callable[[tuple, str], Any]):
        self.plan_for = plan_for
        self.shapes: tuple = ()
        self.interval = 0
        self.rarity: Any = None

    @property
    def plan(self) -> Any:
        return self.plan_for(self.shapes, rare_text(self.shapes, self.interval, self.rarity))


class SizeTable(dict):
    """A tensor layout's settled shapes (``shapes_of``) -> what ``sm.plan`` reports for
    them (``False``: a planned shape of a settled bucket, which takes the full path), and
    ``buckets``: size buckets (``planning.signatures.size_bucket`` of those shapes) settled
    to run as written (decided so, or for a schedule that would not repay a plan per size),
    each of whose sizes but the planned ones runs as written (each bucket with how
    ``sm.plan`` reports a call of given shapes: ``BucketCall``). A decoding loop meets each
    length of a settled bucket once: a table of sizes alone would send each length through
    the full path first."""

    __slots__ = ("buckets", "hits", "structure", "fresh", "rare")

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.buckets: dict = {}
        # Shapes a bucket admitted -> their BucketCall: the next call of those shapes is
        # one lookup (a decoding loop meets each length again on every sequence). Not
        # the table itself, whose room is for sizes settled one by one.
        self.hits: dict = {}
        # Where the layout's new sizes run as written: its call structure
        # (``planning.signatures.Structure``, whose tables of sizes seen once and planned
        # are keyed in the order ``shapes_of`` reads them). A shape in neither this table
        # nor a bucket, that the structure's size policy would run as written because it
        # is new (``Structure.admit``: not seen, not planned, its bucket neither decided
        # nor under trial, no churn), is counted in its ``seen`` here and runs as written
        # (``fresh``: what ``sm.plan`` says, one record whose shapes each such call sets:
        # nothing allocated per call). Any other takes the full path.
        # A decoding loop brings a new size on every call: each would otherwise pay
        # binding, the plan key and the size policy, a tenth of a small model's call.
        self.structure: Any = None
        self.fresh: Optional[BucketCall] = None
        # A size seen before that comes back too rarely to repay a plan
        # (``Structure.rare_again``) runs as written here too: one record, which each
        # such call sets (as ``fresh``).
        self.rare: Optional[RareCall] = None

    def holds(self, key: tuple) -> bool:
        """Whether shapes ``key`` are settled here (in the table, or in a settled bucket
        and not planned): read without counting a new size."""
        found = self.get(key)
        if found is None and self.buckets:
            return size_bucket(key) in self.buckets
        return bool(found)


class ValueTable(dict):
    """A varying layout's table (``SettledCalls(..., values=...)``): the values of its
    plain numbers met, in the order the layout reads them (``key_of``: a tuple of them, or
    the one number itself), forgotten all at once past ``cap`` (the full path's own
    table of values met holds as many: a value that comes back after more calls than
    that is new again, and runs as written). Read and filled by the layout's check,
    without the lock, as ``SizeTable.hits`` is."""

    __slots__ = ("cap", "key_of")

    # (WrapperState.stop_counting reads a settled layout's table for the sizes it counts.)
    structure = None

    def __init__(self, cap: int, key_of: Callable[[tuple, dict], Any]):
        super().__init__()
        self.cap = cap
        self.key_of = key_of

    def met(self, args: tuple, kwargs: dict) -> bool:
        """Whether the call's plain numbers hold values the layout met (read, not added)."""
        return self.key_of(args, kwargs) in self

    def add(self, args: tuple, kwargs: dict) -> None:
        """Note the call's values as met."""
        if len(self) >= self.cap:
            self.clear()
        self[self.key_of(args, kwargs)] = True


def tensor_meta(t: torch.Tensor) -> tuple:
    """What a uniform structure's key holds of a tensor: all but its sizes."""
    return (t.dtype, t.device, t.requires_grad, t.dim())


class SettledCalls:
    """The settled call's layout check, the generation it settled at, what ``sm.plan``
    reports, the nested children to count calls for (object calls), and how many calls may
    take the shortcut before their retry."""

    __slots__ = ("generation", "admits", "left", "reported", "nested", "sizes", "varying")

    def __init__(
        self,
        generation: int,
        args: tuple,
        kwargs: dict,
        reported: Any,
        nested: Any = None,
        left: Optional[int] = None,
        tensors: bool = False,
        sizes: Optional[dict] = None,
        values: Optional[int] = None,
    ):
        """``tensors``: a tensor layout (every argument a plain tensor, checked with its
        metadata, or a plain value, checked by value); otherwise an object layout, checked
        by types alone. ``sizes``:
        for a tensor layout settled size by size, ``{(each tensor's shape, ...): what sm.plan
        reports}`` (more are added as they settle, and size buckets: ``SizeTable``);
        ``None``: every size. ``values``: a varying tensor layout (at every size), whose
        plain numbers (``free_entry``) are checked by type, and their values against a
        table of at most ``values`` of them met (``ValueTable``): it admits a call whose
        values it has not met, and notes them."""
        self.generation = generation
        self.varying = values is not None
        if values is not None:
            arg_entries = tuple(free_entry(a) for a in args)
            kw_entries = tuple((k, free_entry(v)) for k, v in kwargs.items())
            grad, autocast = torch.is_grad_enabled(), autocast_state()
            check = tensor_layout_check(arg_entries, kw_entries, grad, autocast, values)
            self.admits = check
            self.left = _NEVER
            self.reported = reported
            self.nested = nested
            self.sizes: Any = ValueTable(values, _values_reader(arg_entries, kw_entries))
            return
        if tensors:
            check = tensor_layout_check(
                tuple(value_entry(a) for a in args),
                tuple((k, value_entry(v)) for k, v in kwargs.items()),
                torch.is_grad_enabled(),
                autocast_state(),
            )
        else:
            check = _object_layout_check(tuple(type(a) for a in args), tuple((k, type(v)) for k, v in kwargs.items()))
        # ``admits(args, kwargs, sizes)``: whether a call has the settled call's layout
        # (and, for a tensor layout with ``sizes``, one of its shapes or size buckets: then
        # what ``sm.plan`` reports for the call, else ``None``).
        self.admits: Callable[[tuple, dict, Optional[dict]], Any] = check
        self.left = _NEVER if left is None else left
        self.reported = reported
        self.nested = nested
        self.sizes = None if sizes is None else SizeTable(sizes)

    def add_size(self, shapes: tuple, reported: Any) -> None:
        """Another size of the layout settled to run as written (up to a bound: the table
        is per layout, and a workload of ever new sizes must not grow it for ever)."""
        sizes = self.sizes
        if sizes is not None and len(sizes) < MAX_SETTLED_SIZES:
            sizes[shapes] = reported

    def count_new_sizes(
        self, structure: Any, plan_for: Callable[[tuple], Any], rare_plan: Callable[[tuple, str], Any]
    ) -> None:
        """Sizes of this layout new to ``structure`` run as written, counted in its
        ``seen`` (``SizeTable.structure``), and so do sizes it has seen that come back
        too rarely to repay a plan (``rare_plan(shapes, why)``: what ``sm.plan`` says)."""
        sizes = self.sizes
        if sizes is not None:
            sizes.structure, sizes.fresh, sizes.rare = structure, BucketCall(plan_for, ()), RareCall(rare_plan)

    def add_bucket(self, shapes: tuple, plan_for: Callable[[tuple], Any], planned: Any = ()) -> None:
        """The size bucket of ``shapes`` settled to run as written (decided for the model as
        written, or for a schedule that would not repay a plan per size): each of its sizes
        runs as written (``plan_for(shapes)``: what ``sm.plan`` says for a call of such
        shapes, ``BucketCall``), but ``planned``: shapes whose plans run as they were
        decided (the table holds ``False`` for them: the full path)."""
        sizes = self.sizes
        if sizes is not None and len(sizes.buckets) < MAX_SETTLED_BUCKETS:
            for other in planned:
                sizes.setdefault(other, False)
            sizes.buckets[size_bucket(shapes)] = plan_for


def _compiled_check(lines: list[str], names: dict[str, Any]) -> Callable[[tuple, dict, Optional[dict]], Any]:
    """``check(args, kwargs, sizes)`` with ``lines`` as its body, over ``names``."""
    # Written out for the layout, no loop: it runs before anything else on every such
    # call, whose whole budget is a microsecond or two. Made once per layout (the callers
    # cache it).
    source = "def check(args, kwargs, sizes):\n" + "".join(f"    {line}\n" for line in lines)
    exec(compile(source, "<streamsched settled layout>", "exec"), names)
    return names["check"]


@functools.lru_cache(maxsize=256)
def _object_layout_check(arg_types: tuple, kw_types: tuple) -> Callable[[tuple, dict, Optional[dict]], Any]:
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
    return _compiled_check(["return " + " and ".join(tests)], names)


def value_entry(value: Any) -> tuple:
    """How a tensor layout checks one argument: a plain tensor by its metadata, a plain
    value (None, numbers, strings, dtypes, tuples of them: they key a call by value) by its
    type and value."""
    if type(value) is torch.Tensor:
        return ("tensor", tensor_meta(value))
    return ("value", type(value), value)


# The plain numbers a varying layout reads by value from its table: a number, or a short
# tuple of them (a guidance pair, per-channel scales).
_NUMBERS = (int, float)
_MAX_FREE_TUPLE = 8


def free_entry(value: Any) -> tuple:
    """How a varying layout checks one argument: a plain number (or a short tuple of them)
    by its type (and, for a tuple, its length and its items' types), its value read into
    the call's key of values met; anything else as ``value_entry`` does."""
    kind = type(value)
    if kind in _NUMBERS:
        return ("free", kind, ())
    if kind is tuple and 0 < len(value) <= _MAX_FREE_TUPLE and all(type(v) in _NUMBERS for v in value):
        return ("free", tuple, tuple(type(v) for v in value))
    return value_entry(value)


def has_free_values(args: tuple, kwargs: dict) -> bool:
    """Whether a call has a plain number a varying layout would read from its table."""
    return any(free_entry(v)[0] == "free" for v in itertools.chain(args, kwargs.values()))


def _values_reader(arg_entries: tuple, kw_entries: tuple) -> Callable[[tuple, dict], Any]:
    """``key_of(args, kwargs)``: the values of a varying layout's plain numbers, in the
    order its check reads them (positional arguments, then keywords by name), as its
    check keys its table: one number itself, more in a tuple."""
    reads: list[Any] = [i for i, e in enumerate(arg_entries) if e[0] == "free"]
    reads += [name for name, e in sorted(kw_entries, key=lambda x: x[0]) if e[0] == "free"]

    def key_of(args: tuple, kwargs: dict) -> Any:
        key = tuple([args[r] if type(r) is int else kwargs[r] for r in reads])
        return key[0] if len(key) == 1 else key

    return key_of


def settles(args: tuple, kwargs: dict) -> bool:
    """Whether a call may settle as a tensor layout: every argument a plain tensor or a
    plain value, at least one tensor among them."""
    found = False
    for v in itertools.chain(args, kwargs.values()):
        if type(v) is torch.Tensor:
            found = True
        elif not is_plain(v):
            return False
    return found


def tensors_of(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """A call's tensors in the order a layout reads them: the positional arguments' first,
    then the keywords' by name."""
    tensors = [a for a in args if type(a) is torch.Tensor]
    tensors += [kwargs[k] for k in sorted(kwargs) if type(kwargs[k]) is torch.Tensor]
    return tensors


def shapes_of(args: tuple, kwargs: dict) -> tuple:
    """The key of a tensor layout's table of sizes: each tensor's shape, in
    :func:`tensors_of`'s order (the order ``admits`` reads them in; written out: this
    runs on settled calls)."""
    shapes = [a.shape for a in args if type(a) is torch.Tensor]
    for name in sorted(kwargs):
        v = kwargs[name]
        if type(v) is torch.Tensor:
            shapes.append(v.shape)
    return tuple(shapes)


def _forget_oldest(seen: Any) -> None:
    """Drop the least recently used entry of ``seen`` (an ``LRU``), if any is left: the
    layout's check runs without the wrapper's lock, and another thread's call may have
    emptied the table meanwhile."""
    try:
        seen.popitem(last=False)
    except KeyError:
        pass


def _device_test(value: str, device: torch.device, name: str) -> str:
    """The expression that is true where tensor ``value`` is not on ``device`` (``name``):
    ``is_cpu`` (a flag) for the CPU, cheaper than making and comparing a device."""
    if device.type == "cpu":
        return f"not {value}.is_cpu"
    return f"{value}.device != {name}"


@functools.lru_cache(maxsize=256)
def tensor_layout_check(
    arg_entries: tuple, kw_entries: tuple, grad: bool, autocast: tuple, varying: int = 0
) -> Callable[[tuple, dict, Optional[dict]], Any]:
    """``check(args, kwargs, sizes)``: the grad mode and autocast state of the settled call
    (a structure's key holds both; read first: they are what a wrapper's settled layouts
    most often differ by), as many positional arguments and the same keywords, each
    tensor plain with the settled one's dtype, device and grad flag, each plain value of
    the settled one's type and equal to it; then, where ``sizes`` is ``None``, whether each
    tensor has the settled one's number of dimensions, else what the table holds for the
    tensors' shapes (``shapes_of``: they hold the ranks), or a ``BucketCall`` where it holds
    their size bucket, or, where the layout's new sizes run as written
    (``SizeTable.structure``) and the shapes are new to its structure, the table's
    ``fresh`` record, the shapes counted as seen (``None`` where none of these holds).

    ``varying``: where not 0, a varying layout's check (``free_entry``), its table holding
    up to ``varying`` values: its plain numbers checked by type; then, where ``sizes``
    (the ``ValueTable``) is ``None``, whether each tensor has the settled one's number of
    dimensions, else, at those ranks, ``True`` where the numbers' values are not in the
    table (added), ``None`` where they are (met: the full path plans them)."""
    names: dict[str, Any] = {
        "_Tensor": torch.Tensor,
        "_grad": torch.is_grad_enabled,
        "_autocast": autocast_state,
        "_any_autocast": _any_autocast,
        "_AC": autocast,
        "_MISSING": _MISSING,
        "_bucket": size_bucket,
        "_ANY_SIZE": ANY_SIZE,
        "_BucketCall": BucketCall,
        "_forget_oldest": _forget_oldest,
    }
    if autocast == () and _any_autocast is not None:
        lines = [f"if _grad() is not {grad} or _any_autocast(): return False"]  # one call, autocast off
    elif {device for device, _ in autocast} <= {"cuda", "cpu"}:
        # autocast_state's reads, written out (no tuple made): each device on or off, and
        # the dtype of those on.
        names["_is_autocast"], names["_autocast_dtype"] = torch.is_autocast_enabled, torch.get_autocast_dtype
        dtypes = dict(autocast)
        tests = [f"_grad() is not {grad}"]
        for device in ("cuda", "cpu"):
            if device in dtypes:
                names[f"_AC_{device}"] = dtypes[device]
                tests.append(f"not _is_autocast({device!r}) or _autocast_dtype({device!r}) is not _AC_{device}")
            else:
                tests.append(f"_is_autocast({device!r})")
        lines = [f"if {' or '.join(tests)}: return False"]
    else:
        lines = [f"if _grad() is not {grad} or _autocast() != _AC: return False"]
    lines.append(f"if len(args) != {len(arg_entries)} or len(kwargs) != {len(kw_entries)}: return False")
    shapes = []
    entries = [(f"args[{i}]", e) for i, e in enumerate(arg_entries)]
    entries += [(f"kwargs.get({name!r}, _MISSING)", e) for name, e in sorted(kw_entries, key=lambda x: x[0])]
    ranks = []
    values = []
    for i, (read, entry) in enumerate(entries):
        lines.append(f"v{i} = {read}")
        if entry[0] == "free":
            names[f"_T{i}"] = entry[1]
            tests = [f"type(v{i}) is not _T{i}"]
            if entry[1] is tuple:
                tests.append(f"len(v{i}) != {len(entry[2])}")
                for j, item in enumerate(entry[2]):
                    names[f"_T{i}_{j}"] = item
                    tests.append(f"type(v{i}[{j}]) is not _T{i}_{j}")
            lines.append(f"if {' or '.join(tests)}: return False")
            values.append(f"v{i}, ")
        elif entry[0] == "tensor":
            dtype, device, requires_grad, ndim = entry[1]
            names[f"_D{i}"], names[f"_V{i}"] = dtype, device
            lines.append(
                f"if type(v{i}) is not _Tensor or v{i}.dtype is not _D{i} or {_device_test(f'v{i}', device, f'_V{i}')} "
                f"or v{i}.requires_grad is not {requires_grad}: return False"
            )
            shapes.append(f"v{i}.shape, ")
            ranks.append(f"v{i}.dim() == {ndim}")
        else:
            names[f"_T{i}"], names[f"_X{i}"] = entry[1], entry[2]
            lines.append(f"if type(v{i}) is not _T{i} or not (v{i} == _X{i}): return False")
    if varying:
        # Every size, at the settled ranks; the values from the table.
        lines.append(f"if not ({' and '.join(ranks) or 'True'}): return False")
        lines.append("if sizes is None: return True")
        # (One number is its own key: no tuple to make and hash. The table is forgotten
        # all at once when full: evicting the oldest on every call cost as much again.)
        lines.append(f"key = {values[0][:-2]}" if len(values) == 1 else f"key = ({''.join(values)})")
        lines.append("if key in sizes: return None")
        lines.append(f"if len(sizes) >= {varying}: sizes.clear()")
        lines.append("sizes[key] = True")
        lines.append("return True")
        return _compiled_check(lines, names)
    # The ranks: read where every size is admitted (a table's shapes hold them already).
    lines.append(f"if sizes is None: return {' and '.join(ranks) or 'True'}")
    lines.append(f"key = ({''.join(shapes)})")
    lines.append("if sizes:")  # (a layout whose new sizes run as written may have none settled)
    lines.append("    found = sizes.get(key)")
    lines.append("    if found is not None: return found")
    lines.append("bucket = None")
    lines.append("if sizes.buckets:")
    lines.append("    found = sizes.hits.get(key)")
    lines.append("    if found is not None: return found")
    lines.append("    bucket = _bucket(key)")
    lines.append("    plan_for = sizes.buckets.get(bucket)")
    lines.append("    if plan_for is not None:")
    lines.append("        found = _BucketCall(plan_for, key)")
    lines.append(f"        if len(sizes.hits) >= {MAX_BUCKET_HITS}: sizes.hits.clear()")
    lines.append("        sizes.hits[key] = found")
    lines.append("        return found")
    # A new size of a layout whose new sizes run as written: counted, as the size policy
    # counts it (the next call of these shapes takes the full path, which plans them).
    # (Structure.admit's verdict for a new size, written out.)
    lines.append("structure = sizes.structure")
    lines.append("if structure is None or structure.churning or key in structure.planned: return None")
    lines.append("if structure.decisions or structure.trying:")
    # (The bucket read once: a size of a layout with settled buckets reads it above.)
    lines.append("    if structure.uniform: bucket = _ANY_SIZE")
    lines.append("    elif bucket is None: bucket = _bucket(key)")
    lines.append("    if bucket in structure.decisions or bucket in structure.trying: return None")
    # Counted if new (one lookup for both): a size seen once already came back, and
    # runs as written here where it comes back too rarely to repay a plan (the size
    # policy's verdict for it, Structure.rare_again; None: the full path judges it).
    lines.append("seen = structure.seen")
    lines.append("if key in seen:")
    lines.append("    judged = structure.rare_again(key)")
    lines.append("    if judged is None: return None")
    lines.append("    found = sizes.rare")
    lines.append("    found.shapes = key")
    lines.append("    found.interval, found.rarity = judged")
    lines.append("    return found")
    # A full table forgets its oldest size, as the size policy's own count would (an LRU):
    # a workload of more distinct sizes than it holds (a batch and a length that both
    # vary) would otherwise send every new size through the full path from then on.
    lines.append("if len(seen) >= seen.maxsize: _forget_oldest(seen)")
    # (Structure.admit's count, and when: the wrapper counts this call once it is admitted.)
    lines.append("seen[key] = (1, structure.clock() + 1)")
    lines.append("found = sizes.fresh")
    lines.append("found.shapes = key")
    lines.append("return found")
    return _compiled_check(lines, names)
