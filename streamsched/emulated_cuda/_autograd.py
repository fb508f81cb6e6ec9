"""Autograd's stream semantics in backward, on the emulated device.

On CUDA, PyTorch's autograd engine (``torch/csrc/autograd/engine.cpp`` and
``input_buffer.cpp``; "Stream semantics of backward passes" in PyTorch's CUDA notes):

1. **Each backward node runs on the stream its forward op ran on.** A node's stream is
   the stream current when the node was made: when the forward op that returns the
   node's tensors ran, and for a leaf's ``AccumulateGrad`` when the first op that put the
   leaf into a graph ran (the node lives as long as a graph holds it, and is made anew
   after that). The engine makes that stream (and its device) current around the node's
   hooks and its function.
2. **A gradient crossing streams is synchronised by the engine**
   (``InputBuffer::add``). For each input slot of a consumer node: the first producer's
   gradient is stored, an event is recorded on the producer's stream (the slot's *ready
   event*), and the gradient is ``record_stream``-ed on the consumer's stream if the two
   differ. A later producer's gradient is added on the slot's *accumulation stream* (the
   consumer's stream when the gradient is on the consumer's device): that stream first
   waits on an event recorded on the producer's stream and on the slot's ready event (each
   where it is another stream, with ``record_stream`` of the tensor it orders), runs the
   add, and the slot's ready event is re-recorded on it. Before a node runs, its stream
   waits on the ready event of every gradient it receives that was made ready on another
   stream. The gradient given to ``backward()`` counts as produced on the stream current
   at the call.
3. **The caller's stream is ordered after the leaves.** Every node that returns no
   gradients (``AccumulateGrad`` above all) adds its stream to the graph task's *leaf
   streams*; when the last node has run, the stream current on each device at the
   ``backward()``/``autograd.grad()`` call waits on an event recorded on each leaf stream
   of that device, before the engine's final callbacks (DDP's among them) run on the
   caller's streams.

How it is modelled: the forward tags every autograd node made on the emulated device
with the stream current when it was made (``node.metadata``, which lives in the node),
and registers a pre-hook and a post-hook on it. The pre-hook makes the node's stream
current and issues the waits of (2); the post-hook records the ready events of the
gradients the node hands on and, for a slot that already holds a gradient, tells the
kernel mode which ``add`` the engine is about to run and on which stream (the kernel
mode runs it there, after the waits, and re-records the slot's ready event). A final
callback of the graph task issues the waits of (3) and makes the caller's streams
current again; the wrapped ``torch.autograd._engine_run_backward`` restores them too
when the backward raises.

Nodes are tagged where the emulator sees them made: after every call the placement mode
sees (the call's autograd nodes, those of composite operators included, are reached from
its outputs' ``grad_fn`` through ``next_functions`` up to the first tagged node), after
``torch.autograd.Function.apply``, and, with ``create_graph=True``, after each backward
node (for the nodes its function made). The rest (see docs/gpu.md) is not modelled.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional

import torch

from ._core import Emulator, _EventState, _Stream, storage_id, tensors_in

__all__ = ["BackwardStreams"]

_KEY = "streamsched.emulated_cuda.stream"
_ACCUMULATE = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


class _Tag:
    """What the engine knows of one node: its stream (``None``: a node whose tensors are
    not on the emulated device), a number for its input slots, and for each of its
    outputs the consumer node's tag and input slot (``None`` where the edge goes
    nowhere or to a node the emulator never saw made)."""

    __slots__ = ("stream", "nid", "edges", "__weakref__")

    def __init__(self, stream: Optional[_Stream], nid: int):
        self.stream = stream
        self.nid = nid
        self.edges: list[Optional[tuple[_Tag, int]]] = []


class _Slot:
    """One input slot of a consumer node during one backward: where gradients for it are
    added, and the event (and its stream) after which the slot's gradient is ready."""

    __slots__ = ("accum", "ready", "ready_stream")

    def __init__(self, accum: _Stream, ready: _EventState, ready_stream: _Stream):
        self.accum = accum
        self.ready = ready
        self.ready_stream = ready_stream


class _Call:
    """A ``backward()``/``autograd.grad()`` call: the caller's current device and streams."""

    __slots__ = ("device", "streams", "roots", "captures")

    def __init__(self, emu: Emulator):
        self.device = emu.current_device()
        self.streams = {d: emu.current_stream(d) for d in range(emu.num_devices)}
        self.roots: dict[int, _EventState] = {}
        # autograd.grad: the (node, input slot) whose gradient the engine captures.
        self.captures: list[tuple[_Tag, int]] = []


class _Task:
    """One graph task of the engine."""

    __slots__ = ("call", "slots", "leaves", "pending", "events")

    def __init__(self, call: _Call):
        self.call = call
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.leaves: dict[int, _Stream] = {}
        # Gradients the engine is about to add into a slot that holds one: (storage, slot,
        # producer stream, the gradient), consumed by the kernel mode's add.
        self.pending: list[tuple[int, _Slot, _Stream, torch.Tensor]] = []
        self.events: list[_EventState] = []


def _captures(inputs: Any) -> list[tuple[_Tag, int]]:
    """The tagged node and input slot each of ``autograd.grad``'s inputs is captured at."""
    out = []
    for inp in inputs or ():
        if isinstance(inp, torch.Tensor):
            if not inp.requires_grad:
                continue
            inp = torch.autograd.graph.get_gradient_edge(inp)
        node = getattr(inp, "node", None)
        if node is None:
            continue
        tag = node.metadata.get(_KEY)
        if tag is not None:
            out.append((tag, inp.output_nr))
    return out


class BackwardStreams:
    """The engine's stream handling for one emulator (see the module docstring)."""

    def __init__(self, emu: Emulator):
        self.emu = emu
        self._nids = itertools.count(1)
        self._tls = threading.local()
        self._tasks: dict[int, _Task] = {}
        self.backward_kernels: dict[int, int] = {}
        """Kernels run inside a backward, per stream key (``EmulatedCuda.backward_kernels``)."""

    # --- forward: tag the nodes -------------------------------------------------------------

    def tag(self, value: Any) -> None:
        """Tag the untagged nodes behind the tensors of ``value``, just made: the current
        stream of a tensor's device is theirs (none for a tensor off the device)."""
        emu = self.emu
        for t in tensors_in(value):
            fn = t.grad_fn
            if fn is not None:
                d = emu.device_of(t)
                self._walk(fn, None if d is None else emu.current_stream(d))

    def _walk(self, root: Any, stream: Optional[_Stream]) -> None:
        emu = self.emu
        made: list[tuple[Any, _Tag]] = []
        todo = [root]
        while todo:
            node = todo.pop()
            md = node.metadata
            if _KEY in md:
                continue
            s = stream
            variable = getattr(node, "variable", None)
            if isinstance(variable, torch.Tensor):  # AccumulateGrad: the leaf's device
                d = emu.device_of(variable)
                s = None if d is None else emu.current_stream(d)
            tag = _Tag(s, next(self._nids))
            md[_KEY] = tag
            made.append((node, tag))
            for nxt, _ in node.next_functions:
                if nxt is not None:
                    todo.append(nxt)
        for node, tag in made:
            tag.edges = [
                None if nxt is None or _KEY not in nxt.metadata else (nxt.metadata[_KEY], nr)
                for nxt, nr in node.next_functions
            ]
            # The hooks hold the tag, never the node: a node holding itself through its own
            # hook would never be freed.
            node.register_prehook(self._pre_hook(tag))
            node.register_hook(self._post_hook(tag))

    def _pre_hook(self, tag: _Tag) -> Any:
        def pre(grads: tuple) -> None:
            if self.emu.active:  # a graph made on the device may outlive it
                self._before(tag, grads)

        return pre

    def _post_hook(self, tag: _Tag) -> Any:
        def post(grad_inputs: tuple, grad_outputs: tuple) -> None:
            if self.emu.active:
                self._after(tag, grad_inputs)

        return post

    # --- backward ------------------------------------------------------------------------------

    def _calls(self) -> list[_Call]:
        tls = self._tls
        if not hasattr(tls, "calls"):
            tls.calls = []
        return tls.calls

    def run_backward(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """``torch.autograd._engine_run_backward``: note the caller's streams; put them
        back however the backward ends."""
        call = _Call(self.emu)
        if not kwargs.get("accumulate_grad", True):
            call.captures = _captures(args[4] if len(args) > 4 else kwargs.get("inputs", ()))
        calls = self._calls()
        calls.append(call)
        try:
            return original(*args, **kwargs)
        finally:
            calls.pop()
            self._restore(call)
            # A backward that raised never ran its final callback: its tasks end here.
            for tid in [tid for tid, task in self._tasks.items() if task.call is call]:
                for ev in self._tasks.pop(tid).events:
                    self.emu.event_deleted(ev)
            for ev in call.roots.values():
                self.emu.event_deleted(ev)

    def _task(self) -> _Task:
        tid = torch._C._current_graph_task_id()
        task = self._tasks.get(tid)
        if task is None:
            calls = self._calls()
            # A backward entered some other way than _engine_run_backward: nothing ran
            # on the device since it began, so the streams now are the caller's.
            task = self._tasks[tid] = _Task(calls[-1] if calls else _Call(self.emu))
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._finish(tid))
        return task

    def _root(self, task: _Task, device: int) -> tuple[_EventState, _Stream]:
        """The ready event of a gradient handed to ``backward()``: recorded on the caller's
        stream when the call began (nothing the caller issues can come between)."""
        call = task.call
        stream = call.streams[device]
        ev = call.roots.get(device)
        if ev is None:
            ev = call.roots[device] = self._record(stream)
        return ev, stream

    def _record(self, stream: _Stream) -> _EventState:
        ev = self.emu.new_event(timing=False)
        self.emu.event_record(ev, stream)
        return ev

    def _before(self, tag: _Tag, grads: tuple) -> None:
        """Engine::evaluate_function, before the node's function: its stream current, and
        its stream waits for each incoming gradient readied on another stream."""
        emu = self.emu
        task = self._task()
        task.pending.clear()  # adds the engine skipped (a node it will not run)
        stream = tag.stream
        if stream is None:
            self._restore(task.call)  # the CPU queue runs on the calling thread
            return
        emu.set_current_stream(stream)
        for pos, g in enumerate(grads):
            if not isinstance(g, torch.Tensor) or emu.device_of(g) is None:
                continue
            slot = task.slots.pop((tag.nid, pos), None)
            if slot is None:
                ready, ready_stream = self._root(task, emu.device_of(g))
            else:
                ready, ready_stream = slot.ready, slot.ready_stream
            if ready_stream is not stream:
                emu.event_wait(ready, stream)

    def _after(self, tag: _Tag, grad_inputs: tuple) -> None:
        """After the node's function: the first gradient for a slot gets its ready event on
        this stream; a later one is added by the engine next (see :meth:`accumulation`)."""
        emu = self.emu
        task = self._task()
        producer = tag.stream
        if not grad_inputs:
            if producer is not None:
                task.leaves[producer.skey] = producer
            return
        for i, g in enumerate(grad_inputs):
            if not isinstance(g, torch.Tensor):
                continue
            dev = emu.device_of(g)
            if dev is None:
                continue
            if g.grad_fn is not None:  # create_graph: nodes this function made, on its stream
                self.tag(g)
            edge = tag.edges[i] if i < len(tag.edges) else None
            if edge is None or edge[0].stream is None:
                continue
            consumer_tag, nr = edge
            consumer = consumer_tag.stream
            made_on = producer if producer is not None else emu.current_stream(dev)
            key = (consumer_tag.nid, nr)
            slot = task.slots.get(key)
            if slot is None:
                if consumer.device == dev:
                    accum = consumer
                elif made_on.device == dev:
                    accum = made_on
                else:
                    accum = emu.current_stream(dev)
                if consumer is not made_on:
                    emu.record_stream(g, consumer)
                ready = self._record(made_on)
                task.events.append(ready)
                task.slots[key] = _Slot(accum, ready, made_on)
            else:
                cdata = storage_id(g)
                if cdata is not None:
                    task.pending.append((cdata, slot, made_on, g))

    def accumulation(self, args: tuple) -> Optional[tuple[_Slot, _Stream]]:
        """If this ``add`` is the engine adding a gradient into a slot that holds one: issue
        the waits of ``InputBuffer::add`` and return the slot and its accumulation stream."""
        task = self._tasks.get(torch._C._current_graph_task_id())
        if task is None or not task.pending:
            return None
        ids = [storage_id(a) for a in args[:2] if isinstance(a, torch.Tensor)]
        for k, (cdata, slot, made_on, g) in enumerate(task.pending):
            if cdata not in ids:
                continue
            del task.pending[k]
            emu = self.emu
            accum = slot.accum
            if accum is not made_on:
                ev = self._record(made_on)
                task.events.append(ev)
                emu.event_wait(ev, accum)
                emu.record_stream(g, accum)
            if accum is not slot.ready_stream:
                emu.event_wait(slot.ready, accum)
                for a in args[:2]:
                    if isinstance(a, torch.Tensor) and storage_id(a) != cdata:
                        emu.record_stream(a, accum)
            return slot, accum
        return None

    def accumulated(self, slot: _Slot) -> None:
        """After the add: the slot's gradient is ready once the accumulation stream is."""
        task = self._tasks.get(torch._C._current_graph_task_id())
        slot.ready = self._record(slot.accum)
        slot.ready_stream = slot.accum
        if task is not None:
            task.events.append(slot.ready)

    def _finish(self, tid: int) -> None:
        """GraphTask::exec_post_processing: the caller's streams wait on the leaf streams,
        and are current again for the final callbacks."""
        task = self._tasks.pop(tid, None)
        if task is None:
            return
        emu = self.emu
        for tag, nr in task.call.captures:
            # A node whose input autograd.grad captures: the engine makes its stream wait for
            # that gradient (unless the node ran, and waited, already) and counts the stream
            # as a leaf, whether or not the node runs.
            stream = tag.stream
            if stream is None:
                continue
            slot = task.slots.pop((tag.nid, nr), None)
            if slot is not None and slot.ready_stream is not stream:
                emu.event_wait(slot.ready, stream)
            task.leaves[stream.skey] = stream
        for leaf in task.leaves.values():
            caller = task.call.streams[leaf.device]
            if caller is not leaf:
                ev = self._record(leaf)
                emu.event_wait(ev, caller)
                emu.event_deleted(ev)
        self._restore(task.call)
        for ev in task.events:
            emu.event_deleted(ev)

    def _restore(self, call: _Call) -> None:
        emu = self.emu
        for stream in call.streams.values():
            emu.set_current_stream(stream)
        emu.set_device(call.device)

    def counted(self, stream: _Stream) -> None:
        self.backward_kernels[stream.skey] = self.backward_kernels.get(stream.skey, 0) + 1
