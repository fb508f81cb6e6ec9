"""A plan compiled to Python: one generated function per task, values in a flat list.

Every graph value lives in a slot of ``env`` (a list). Each task becomes a generated
function ``task(env)`` that runs its nodes in order, reading and writing slots: no
interpreter dispatch, no dict lookups, as cheap per node as a hand-written forward.

Each node is one source line of the generated code, so when a node raises, the line in
the traceback names the node, and the error is re-raised with its module path at no
cost on the hot path (see :func:`annotate_exception`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import linecache
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..frontend.nodes import node_label
from ..passes.fusion.kernels import FusedKernel
from ..passes.fusion.layout import specialise_gather
from ..planning.schedule import Schedule, ScheduledTask
from .generated import LazyFunction

__all__ = ["CompiledTask", "Program", "ProgramCache", "compile_program", "program_key", "annotate_exception"]

_counter = itertools.count()


@dataclass
class CompiledTask:
    """One task ready to run: its generated function and its synchronisation facts."""

    id: int
    name: str
    stream: int
    source: LazyFunction
    waits: tuple[int, ...]
    records: bool
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    cross_reads: tuple[int, ...]
    frees: tuple[int, ...] = ()
    node_names: tuple[str, ...] = ()
    seq: int = 0

    @functools.cached_property
    def fn(self) -> Callable[[list], None]:
        """``task(env)``, compiled when an executor first runs the task (the serial
        executor runs the whole-call function instead)."""
        return self.source.get()


@dataclass(eq=False)  # compared and hashed by identity: executors key their state by program
class Program:
    """Everything an executor needs to run one plan."""

    n_slots: int
    input_slots: tuple[int, ...]
    attr_slots: tuple[tuple[int, str], ...]
    tasks: list[CompiledTask]
    output_source: LazyFunction
    output_slots: tuple[int, ...]
    num_streams: int
    serial_source: LazyFunction
    root: torch.nn.Module
    load_source: LazyFunction
    call: Optional[Callable[[list], Any]] = None
    """``call(inputs) -> output``: load, every task in issue order and the output in one
    generated function over local variables (what the serial executor runs when nothing
    observes the tasks); the same lines as ``load``, ``run_serial`` and ``output``."""
    slot_producer: dict[int, int] = field(default_factory=dict)
    lines: dict[tuple[str, int], str] = field(default_factory=dict)
    location_slots: tuple[int, ...] = ()
    """Ids (after the value slots) of the storages some task writes in place; tasks list
    them among their reads and writes, so the SyncLog and its checker see every in-place
    effect. They hold no value."""
    expected_writers: dict[tuple[int, int], int] = field(default_factory=dict)
    """``(task, location slot) -> task`` whose write that task must see first (eager
    order; -1: the state before the call), for the race checker."""
    stacks: tuple[Any, ...] = ()
    """The stacked parameters the fused kernels read: checked before every call (a member
    re-assigned since is stacked again), and by a CUDA graph before replay."""

    def __post_init__(self) -> None:
        self.tasks_by_id = {t.id: t for t in self.tasks}
        # Checks every stack at once before a call: ``stack_guard.check()`` (a
        # StackSetGuard; None without stacks).
        self.stack_guard: Any = type(self.stacks[0]).set_guard(self.stacks) if self.stacks else None
        # Outputs allocated on a side stream need record_stream on the caller's stream.
        self.side_outputs = tuple(
            s
            for s in self.output_slots
            if s in self.slot_producer and self.tasks_by_id[self.slot_producer[s]].stream != 0
        )

    # Compiled by the first executor that runs them (see runtime.generated).
    @functools.cached_property
    def output(self) -> Callable[[list], Any]:
        """``output(env)``: the call's output from the slots."""
        return self.output_source.get()

    @functools.cached_property
    def run_serial(self) -> Callable[[list], None]:
        """``run_serial(env)``: every task's statements in issue order, with the frees."""
        return self.serial_source.get()

    @functools.cached_property
    def load(self) -> Callable[[list], list]:
        """``load(inputs) -> env``: the inputs and attributes in their slots."""
        return self.load_source.get()

    def new_env(self, inputs: list[Any]) -> list[Any]:
        """A fresh value list holding the inputs and the current parameters and buffers."""
        return self.load(inputs)

    def streams_used(self) -> list[int]:
        return sorted({t.stream for t in self.tasks})


def _fresh_kernel_value(node: Any) -> bool:
    """``node`` is a fused kernel's call whose result is a tensor of its own."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and isinstance(node.target, FusedKernel)
        and node.target.fresh_output
    )


def _private_inputs(node: fx.Node) -> bool:
    """Whether every tensor input of ``node`` is a fresh fused-kernel result that ``node``
    alone reads, once: no other node, no output and no later task sees it, so ``node``
    may write it in place (see :meth:`FusedKernel.specialise`)."""
    inputs = [a for a in node.args if isinstance(a, fx.Node)]
    if not inputs or node.kwargs:
        return False
    for a in inputs:
        if not _fresh_kernel_value(a) or len(a.users) != 1 or sum(1 for b in node.args if b is a) != 1:
            return False
    return True


class _Emitter:
    """Renders fx arguments as Python expressions over ``env`` (or, with ``local``, over
    local variables ``v<slot>``)."""

    def __init__(self, slot: dict[fx.Node, int]):
        self.slot = slot
        self.globals: dict[str, Any] = {"slice": slice, "inf": math.inf, "nan": math.nan}
        self._names: dict[int, str] = {}
        self.local = False
        self._gathers: dict[fx.Node, Optional[Callable]] = {}

    def ref(self, slot: int) -> str:
        return f"v{slot}" if self.local else f"env[{slot}]"

    def constant(self, value: Any, hint: str = "c") -> str:
        key = id(value)
        name = self._names.get(key)
        if name is None:
            name = f"_{hint}{len(self._names)}"
            self._names[key] = name
            self.globals[name] = value
        return name

    def render(self, arg: Any) -> str:
        if isinstance(arg, fx.Node):
            return self.ref(self.slot[arg])
        if isinstance(arg, tuple) and not hasattr(arg, "_fields"):
            if arg and all(type(a) is int for a in arg):
                # Sizes (a kernel's planned shape): a constant, so that the plans of one
                # trace at other sizes generate the same text, compiled once (generated.py).
                return self.constant(arg, "t")
            inner = ", ".join(self.render(a) for a in arg)
            return f"({inner},)" if len(arg) == 1 else f"({inner})"
        if isinstance(arg, list):
            return "[" + ", ".join(self.render(a) for a in arg) + "]"
        if isinstance(arg, dict):
            items = ", ".join(f"{self.render(k)}: {self.render(v)}" for k, v in arg.items())
            return "{" + items + "}"
        if isinstance(arg, slice):
            return f"slice({self.render(arg.start)}, {self.render(arg.stop)}, {self.render(arg.step)})"
        if arg is None or isinstance(arg, (bool, int, str)):
            return repr(arg)
        if isinstance(arg, float):
            if math.isinf(arg):
                return "inf" if arg > 0 else "-inf"
            if math.isnan(arg):
                return "nan"
            return repr(arg)
        return self.constant(arg)

    def call_args(self, args: tuple, kwargs: dict) -> str:
        parts = [self.render(a) for a in args]
        parts += [f"{k}={self.render(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def gather(self, node: fx.Node) -> Optional[Callable]:
        """The function specialised for a layout gather (``stack_members`` ...) whose
        layout arguments are constants, made once per node."""
        if node not in self._gathers:
            fn = None
            args = node.args
            if args and not node.kwargs and not any(isinstance(a, fx.Node) for a in args[1:]):
                src = args[0]
                fresh = _fresh_kernel_value(src) and len(src.users) == 1
                fn = specialise_gather(node.target, tuple(args[1:]), fresh)
            self._gathers[node] = fn
        return self._gathers[node]

    def statement(self, node: fx.Node, root: torch.nn.Module) -> str:
        out = self.ref(self.slot[node])
        if node.op == "call_module":
            mod = self.constant(root.get_submodule(node.target), "m")
            return f"{out} = {mod}({self.call_args(node.args, node.kwargs)})"
        if node.op == "call_function":
            target = node.target
            if isinstance(target, FusedKernel):
                # The kernel's specialised function, with its dtype check on the first call.
                entry = "fast_private" if _private_inputs(node) else "fast"
                return f"{out} = {self.constant(target, 'f')}.{entry}({self.call_args(node.args, node.kwargs)})"
            gather = self.gather(node)
            if gather is not None:
                return f"{out} = {self.constant(gather, 'g')}({self.render(node.args[0])})"
            fn = self.constant(node.target, "f")
            return f"{out} = {fn}({self.call_args(node.args, node.kwargs)})"
        if node.op == "call_method":
            obj = self.render(node.args[0])
            method = str(node.target)
            if method.isidentifier():
                return f"{out} = {obj}.{method}({self.call_args(node.args[1:], node.kwargs)})"
            getter = self.constant(method, "s")
            return f"{out} = getattr({obj}, {getter})({self.call_args(node.args[1:], node.kwargs)})"
        raise ValueError(f"cannot compile fx op {node.op}")


def _compile_loader(
    n_slots: int,
    input_slots: list[int],
    attr_slots: list[tuple[int, str]],
    root: torch.nn.Module,
    emitter: _Emitter,
    filename: str,
) -> LazyFunction:
    """``load(inputs) -> env``: inputs and attributes in their slots, in one generated function.

    Parameters and buffers are read from their owning module's own ``_parameters`` /
    ``_buffers`` dict on every call: a dict lookup, and always the current tensor (a
    re-assigned parameter replaces the dict entry; a replaced module re-traces).
    """
    lines = [f"env = [None] * {n_slots}"] + _load_lines(input_slots, attr_slots, root, emitter)
    lines.append("return env")
    return LazyFunction.of_body("load", lines, filename, emitter.globals, arg="inputs")


def _load_lines(
    input_slots: list[int], attr_slots: list[tuple[int, str]], root: torch.nn.Module, emitter: _Emitter
) -> list[str]:
    """The statements that put the inputs and the attributes in their slots."""
    ref = emitter.ref
    lines = [f"{ref(s)} = inputs[{i}]" for i, s in enumerate(input_slots)]
    for s, target in attr_slots:
        path, _, name = target.rpartition(".")
        owner = root.get_submodule(path) if path else root
        if name in owner._parameters:
            lines.append(f"{ref(s)} = {emitter.constant(owner._parameters, 'p')}[{name!r}]")
        elif name in owner._buffers:
            lines.append(f"{ref(s)} = {emitter.constant(owner._buffers, 'b')}[{name!r}]")
        else:
            lines.append(f"{ref(s)} = getattr({emitter.constant(owner, 'o')}, {name!r})")
    return lines


def _compile_function(name: str, body: list[str], emitter: _Emitter, filename: str, arg: str = "env") -> Callable:
    """The generated function, compiled now (the whole-call function every serial call runs)."""
    return LazyFunction.of_body(name, body, filename, emitter.globals, arg).get()


class ProgramCache:
    """The program compiled for one trace's latest plan, and everything it was compiled
    from (:func:`program_key`): a plan of the trace at other input sizes that compiles
    from the same graph, tasks, streams and effects gets the same generated functions.

    Only a graph whose statements name no size qualifies: a fused kernel is a new object
    per plan (it views stacked values with the sizes it was planned at), so a plan with
    one never matches. The cached program keeps every object its key names by identity
    alive, so an identity in the key cannot be another object's."""

    __slots__ = ("key", "program", "hits")

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.program: Optional[Program] = None
        self.hits = 0


def _arg_key(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return ("n", a.name)
    # As _Emitter.render tells them apart (fx's immutable containers are lists and dicts).
    if isinstance(a, tuple) and not hasattr(a, "_fields"):
        return (tuple, tuple(_arg_key(x) for x in a))
    if isinstance(a, list):
        return (list, tuple(_arg_key(x) for x in a))
    if isinstance(a, dict):
        return (dict, tuple((_arg_key(k), _arg_key(v)) for k, v in a.items()))
    if isinstance(a, slice):
        return (slice, _arg_key(a.start), _arg_key(a.stop), _arg_key(a.step))
    if a is None or isinstance(a, (bool, int, str, float)):
        return (type(a), repr(a))  # rendered by repr: 0.0 and -0.0 are equal, not alike
    return ("object", id(a))  # rendered as a constant: the program holds it


def program_key(schedule: Schedule) -> tuple:
    """Everything :func:`compile_program` reads of ``schedule``: the graph's nodes (their
    targets and constants by identity), the scheduled tasks (nodes, stream, issue
    position, waits, records, storages), the writes the logged in-place accesses must
    see and the stacked parameters. Equal keys compile to the same code."""
    effects = schedule.effects
    nodes = tuple(
        (
            n.name,
            n.op,
            n.target if type(n.target) is str else id(n.target),
            _arg_key(n.args),
            _arg_key(n.kwargs),
            len(n.users),
        )
        for n in schedule.graph.nodes
    )
    tasks = tuple(
        (
            t.name,
            tuple(n.name for n in t.nodes),
            t.stream,
            t.position,
            t.waits,
            t.records,
            t.storage_reads,
            t.storage_writes,
        )
        for t in schedule.tasks
    )
    located = ()
    if effects:
        located = (
            effects.num_locations,
            tuple(sorted((k, tuple(sorted(v.items(), key=repr))) for k, v in effects.sees.items())),
        )
    return (id(schedule.root), nodes, tasks, schedule.num_streams, located, tuple(id(s) for s in schedule.stacks))


def compile_program(schedule: Schedule, cache: Optional[ProgramCache] = None) -> Program:
    """Compile the planner's :class:`~streamsched.planning.schedule.Schedule` into a
    :class:`Program`: one generated function per scheduled task, issued in their order,
    on their streams, with their waits and records.

    ``cache``: the trace's :class:`ProgramCache`. Where ``schedule`` compiles from what
    the cached program did, the result is a new :class:`Program` (executors keep state
    per program: a CUDA graph captured at other sizes is not this one's) over the same
    generated functions."""
    key = None
    if cache is not None:
        key = program_key(schedule)
        if key == cache.key and cache.program is not None:
            cache.hits += 1
            old = cache.program
            return dataclasses.replace(
                old, tasks=list(old.tasks), slot_producer=dict(old.slot_producer), lines=dict(old.lines)
            )
    program = _compile(schedule)
    if cache is not None:
        cache.key, cache.program = key, program
    return program


@dataclass
class _Layout:
    """Where the graph's values live in ``env``: one slot per node but the output, then
    (with in-place effects) one id per logged storage, which holds no value."""

    slot: dict[fx.Node, int]
    input_slots: list[int]
    attr_slots: list[tuple[int, str]]
    output_node: fx.Node
    output_slots: tuple[int, ...]


def _slot_layout(graph: fx.Graph) -> _Layout:
    slot: dict[fx.Node, int] = {}
    input_slots = []
    attr_slots = []
    output_node = None
    for node in graph.nodes:
        if node.op == "output":
            output_node = output_node or node
            continue
        slot[node] = len(slot)
        if node.op == "placeholder":
            input_slots.append(slot[node])
        elif node.op == "get_attr":
            attr_slots.append((slot[node], str(node.target)))
    assert output_node is not None, "a traced graph has an output node"
    output_slots = tuple(slot[n] for n in output_node.all_input_nodes)
    return _Layout(slot, input_slots, attr_slots, output_node, output_slots)


def _frees(order: list[ScheduledTask], drops: dict[fx.Node, list[int]]) -> dict[int, tuple[int, ...]]:
    """Task id -> the slots dropped after it: those its statements read last
    (:func:`_node_drops`), which the serial and streams executors drop once the task ran."""
    frees: dict[int, tuple[int, ...]] = {}
    for t in order:
        slots = sorted(s for node in t.nodes for s in drops.get(node, ()))
        if slots:
            frees[t.id] = tuple(slots)
    return frees


def _node_drops(order: list[ScheduledTask], layout: _Layout) -> dict[fx.Node, list[int]]:
    """Node -> the slots no statement reads after it in issue order: where the function
    that runs the whole call (``call``, ``run_serial``: one thread, issue order) drops its
    reference to each value. The call's outputs are never dropped, nor inputs and
    attributes: the caller's arguments and the module keep them alive for the whole call
    anyway, so dropping a reference frees nothing.

    A task holds every value it made until it ends otherwise: a plan whose tasks were
    coarsened into a few (a serial plan is often one) would keep each intermediate of an
    inference call alive to the end of the call, where eager frees it after its last use
    (four times eager's peak of live activations on two branches of element-wise steps
    coarsened into one task: ``profiles/cpu/plan-memory``)."""
    slot = layout.slot
    held = set(layout.output_slots) | set(layout.input_slots) | {s for s, _ in layout.attr_slots}
    last: dict[int, fx.Node] = {}
    for t in order:
        for node in t.nodes:
            for inp in node.all_input_nodes:
                last[slot[inp]] = node
    drops: dict[fx.Node, list[int]] = {}
    for s, node in last.items():
        if s not in held:
            drops.setdefault(node, []).append(s)
    return {node: sorted(slots) for node, slots in drops.items()}


def _drop_line(refs: list[str]) -> str:
    """One statement dropping every reference in ``refs``."""
    return " = ".join(refs) + " = None"


def _local_drops(task: ScheduledTask, drops: dict[fx.Node, list[int]], slot: dict[fx.Node, int]) -> dict:
    """Of ``drops``, those a task's own function makes: the slots the task made itself and
    reads last. No other task reads those (one issued after this task would read last),
    so no other stream needs them kept; every other value is dropped by the executor
    after the task that reads it last, once its ``record_stream`` is made."""
    made = {slot[n] for n in task.nodes}
    local: dict = {}
    for node in task.nodes:
        slots = [s for s in drops.get(node, ()) if s in made]
        if slots:
            local[node] = slots
    return local


def _task_slots(
    task: ScheduledTask, slot: dict[fx.Node, int], node_task: dict[fx.Node, int], n_values: int
) -> tuple[list[int], list[int]]:
    """The slots ``task`` reads (values made by other tasks, then the storages it reads)
    and writes (its values, then the storages it writes in place): what the SyncLog logs."""
    t = task.id
    reads: list[int] = []
    writes: list[int] = []
    for node in task.nodes:
        writes.append(slot[node])
        for inp in node.all_input_nodes:
            if node_task.get(inp) != t and slot[inp] not in reads:
                reads.append(slot[inp])
    reads += [n_values + loc for loc in task.storage_reads]
    writes += [n_values + loc for loc in task.storage_writes]
    return reads, writes


def _expected_writers(
    order: list[ScheduledTask], graph: fx.Graph, effects: Any, n_values: int, node_task: dict[fx.Node, int]
) -> dict[tuple[int, int], int]:
    """``(task, storage id) -> task`` whose write the task's first access must see (eager
    order; -1: the state before the call), for the race checker."""
    expected: dict[tuple[int, int], int] = {}
    if not effects:
        return expected
    writer_node = {n.name: n for n in graph.nodes}
    for task in order:
        t = task.id
        written_here: set[int] = set()
        for node in task.nodes:
            for loc, writer in effects.sees.get(node.name, {}).items():
                slot_id = n_values + loc
                if slot_id in written_here or (t, slot_id) in expected:
                    continue
                if writer is None:
                    expected[(t, slot_id)] = -1
                elif writer in writer_node:  # a writer fused away wrote only its own storage
                    expected[(t, slot_id)] = node_task[writer_node[writer]]
            written_here.update(n_values + loc for loc in effects.writes.get(node.name, ()))
    return expected


def _cross_reads(
    reads: list[int], stream: int, slot_producer: dict[int, int], stream_of: list[int], inputs: set[int]
) -> tuple[int, ...]:
    """Values a task on ``stream`` reads that were made on another stream: the task's
    stream is recorded on them (record_stream), so their memory is not reused before its
    work is done. The module's inputs are made on the caller's stream (stream 0) and no
    task's output, and a side stream's backward reads one it saved after the call
    returns, when the caller may have dropped it."""
    return tuple(
        r
        for r in reads
        if (r in slot_producer and stream_of[slot_producer[r]] != stream) or (r in inputs and stream != 0)
    )


def _compile_tasks(
    schedule: Schedule,
    order: list[ScheduledTask],
    layout: _Layout,
    emitter: _Emitter,
    frees: dict[int, tuple[int, ...]],
    drops: dict[fx.Node, list[int]],
    node_task: dict[fx.Node, int],
    uid: int,
    lines: dict[tuple[str, int], str],
) -> tuple[list[CompiledTask], list[str], dict[int, int]]:
    """One generated function per task, in issue order, and the body of ``run_serial``
    (every task's statements, each value dropped after the statement that reads it last:
    ``drops``); also ``slot -> producing task``. A task's function drops the values it
    alone makes and reads (:func:`_local_drops`); the executors drop ``frees`` after
    each task. ``lines`` gets the node label of every generated line."""
    slot, root = layout.slot, schedule.root
    inputs = set(layout.input_slots)
    stream_of = [t.stream for t in schedule.tasks]
    serial_body: list[str] = []
    serial_file = f"<streamsched-program-{uid}>"
    slot_producer: dict[int, int] = {}
    seq_counter = [0] * max(schedule.num_streams, 1)
    tasks: list[CompiledTask] = []
    for task in order:
        t, stream = task.id, task.stream
        body = []
        filename = f"<streamsched-task-{uid}-{t}>"
        local = _local_drops(task, drops, slot)
        for node in task.nodes:
            statement = emitter.statement(node, root)
            lines[(filename, len(body) + 2)] = node_label(node)
            lines[(serial_file, len(serial_body) + 2)] = node_label(node)
            body.append(statement)
            serial_body.append(statement)
            if node in local:
                body.append(_drop_line([f"env[{s}]" for s in local[node]]))
            if node in drops:
                serial_body.append(_drop_line([f"env[{s}]" for s in drops[node]]))
            slot_producer[slot[node]] = t
        fn = LazyFunction.of_body(f"task_{t}", body, filename, emitter.globals)
        reads, writes = _task_slots(task, slot, node_task, len(slot))
        cross = _cross_reads(reads, stream, slot_producer, stream_of, inputs)
        seq_counter[stream] += 1
        tasks.append(
            CompiledTask(
                id=t,
                name=task.name,
                stream=stream,
                source=fn,
                waits=task.waits,
                records=task.records,
                reads=tuple(reads),
                writes=tuple(writes),
                cross_reads=cross,
                frees=frees.get(t, ()),
                node_names=tuple(n.name for n in task.nodes),
                seq=seq_counter[stream],
            )
        )
    return tasks, serial_body, slot_producer


def _compile_call(
    order: list[ScheduledTask],
    layout: _Layout,
    root: torch.nn.Module,
    emitter: _Emitter,
    drops: dict[fx.Node, list[int]],
    call_file: str,
    lines: dict[tuple[str, int], str],
) -> Callable[[list], Any]:
    """The whole call in one function over locals: the serial executor's path when no
    log, chaos or observer looks at the tasks (one frame instead of four, no env list).
    Each value is dropped after the statement that reads it last (``drops``)."""
    emitter.local = True
    body = _load_lines(layout.input_slots, layout.attr_slots, root, emitter)
    for task in order:
        for node in task.nodes:
            lines[(call_file, len(body) + 2)] = node_label(node)
            body.append(emitter.statement(node, root))
            if node in drops:
                body.append(_drop_line([f"v{s}" for s in drops[node]]))
    body.append(f"return {emitter.render(layout.output_node.args[0])}")
    emitter.local = False
    return _compile_function("call", body, emitter, call_file, arg="inputs")


def _compile(schedule: Schedule) -> Program:
    """Compile the scheduled tasks into a :class:`Program`: slots for the graph's values,
    a generated function per task, the serial runner, the loader, the output and the
    whole call; the in-place effects add the storages each task reads and writes to its
    logged reads and writes."""
    layout = _slot_layout(schedule.graph)
    n_values = len(layout.slot)
    order = [schedule.tasks[t] for t in schedule.issue_order()]
    node_task = {node: task.id for task in schedule.tasks for node in task.nodes}
    emitter = _Emitter(layout.slot)
    uid = next(_counter)
    lines: dict[tuple[str, int], str] = {}
    drops = _node_drops(order, layout)
    frees = _frees(order, drops)
    tasks, serial_body, slot_producer = _compile_tasks(
        schedule, order, layout, emitter, frees, drops, node_task, uid, lines
    )
    files = {k: f"<streamsched-{k}-{uid}>" for k in ("program", "load", "output", "call")}
    run_serial = LazyFunction.of_body("run_serial", serial_body, files["program"], emitter.globals)
    load = _compile_loader(n_values, layout.input_slots, layout.attr_slots, schedule.root, emitter, files["load"])
    out_expr = emitter.render(layout.output_node.args[0])
    output = LazyFunction.of_body("output", [f"return {out_expr}"], files["output"], emitter.globals)
    call = _compile_call(order, layout, schedule.root, emitter, drops, files["call"], lines)
    effects = schedule.effects
    program = Program(
        n_slots=n_values,
        input_slots=tuple(layout.input_slots),
        attr_slots=tuple(layout.attr_slots),
        tasks=tasks,
        output_source=output,
        output_slots=layout.output_slots,
        num_streams=schedule.num_streams,
        serial_source=run_serial,
        root=schedule.root,
        load_source=load,
        call=call,
        slot_producer=slot_producer,
        lines=lines,
        location_slots=tuple(n_values + i for i in range(effects.num_locations if effects else 0)),
        expected_writers=_expected_writers(order, schedule.graph, effects, n_values, node_task),
        stacks=tuple(schedule.stacks),
    )
    # The generated source stays readable in tracebacks for as long as the program
    # lives, and no longer: plans come and go (LRU), linecache must not grow with them.
    filenames = {f for f, _ in lines} | set(files.values())
    filenames |= {f"<streamsched-task-{uid}-{t.id}>" for t in order}
    weakref.finalize(program, _forget_sources, tuple(filenames))
    return program


def _forget_sources(filenames: tuple[str, ...]) -> None:
    for name in filenames:
        linecache.cache.pop(name, None)


def run_task(task: CompiledTask, env: list, observer: Any, stream: int) -> None:
    """Run one task, bracketed by ``observer.push``/``pop`` (on this thread) when there is one."""
    if observer is None:
        task.fn(env)
        return
    observer.push(task, stream)
    try:
        task.fn(env)
    finally:
        observer.pop(task, stream)


def failing_node(program: Program, exc: BaseException) -> Optional[str]:
    """The label of the generated line an exception came from, if any."""
    tb = exc.__traceback__
    found = None
    while tb is not None:
        key = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        if key in program.lines:
            found = program.lines[key]
        tb = tb.tb_next
    return found


def annotate_exception(exc: BaseException, where: str) -> None:
    """Add "(in module 'x')" to an exception's message, keeping its type.

    The message is extended in place when it is a single string (so ``str(exc)`` shows
    it, as users of eager PyTorch expect); otherwise a note is added.
    """
    suffix = f"\n  [streamsched] raised in {where}"
    if getattr(exc, "_streamsched_where", None) is not None:
        return
    try:
        exc._streamsched_where = where  # type: ignore[attr-defined]  (read by new_signatures)
    except AttributeError:
        return
    if len(exc.args) == 1 and isinstance(exc.args[0], str) and not isinstance(exc, KeyError):
        exc.args = (exc.args[0] + suffix,)
    else:
        exc.add_note(suffix.strip())
