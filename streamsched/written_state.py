"""The state a plan may have written before a check of an opaque call's output stops it.

A plan that reads a leaf call's value through an ``OutputCheck`` (``frontend.opaque_outputs``:
a mask builder returning a mask for a padded batch and ``None`` for one without padding)
is stopped by the check where the value has another structure, and the call then runs
the model as written (``Runner.checked``). Nodes that ran before the check may have
written state in place: a BatchNorm's running statistics in training, a buffer counting
calls. Run as written after that, the call would write it twice.

:class:`WrittenState` names that state, once per compiled signature, from the recording
call's accesses: each storage that a node wrote without the call having allocated it,
where the node is not a descendant of every check (a descendant of every check runs
only once the checks have passed, on every executor: a lane stops at its next task, and
the streams executor issues no task after the one that raised), and finds it again on
each call (a parameter or buffer by its module and name, a plain tensor attribute by
its holder and name, a graph input by position, a constant the graph holds). Each call of
such a plan copies those storages' bytes first (:meth:`WrittenState.save`); a stopped
call puts them back (:meth:`WrittenState.restore`) before running as written, so that
the state ends as eager leaves it. The bytes are copied through a byte view of each whole
storage, made apart from the tensors that use it: no version counter of theirs moves, so
no guard of a tensor the trace baked in sees a change. Where a written storage is none
of those (a tensor only a global holds), the plan has no :class:`WrittenState` and a
stopped call raises as before."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import fx, nn

from .frontend.effects import RNG_KEY
from .frontend.opaque_outputs import OutputCheck

__all__ = ["WrittenState"]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A ``uint8`` view of the whole storage of ``t``, its own version counter."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


class WrittenState:
    """How to find, on each call, the storages a plan may have written before one of its
    output checks stops it (see the module docstring): ``tables`` (a module's
    ``_parameters``, ``_buffers`` or ``__dict__``, and the name there), ``inputs`` (graph
    input positions) and ``constants`` (tensors the graph holds); ``names`` says which,
    for ``sm.plan``-style messages and tests."""

    __slots__ = ("tables", "inputs", "constants", "names", "_views")

    def __init__(self, tables: list, inputs: list[int], constants: list[torch.Tensor], names: list[str]):
        self.tables = tables
        self.inputs = inputs
        self.constants = constants
        self.names = names
        # (tensors found, their data pointers, byte views of their storages by device):
        # made again where a tensor found is another one or its storage moved. Making a
        # byte view costs a few microseconds; checking one costs a tenth of that.
        self._views: Optional[tuple] = None

    @property
    def finders(self) -> list:
        """Everything this call saves (empty: nothing the checks could stop is state)."""
        return [*self.tables, *self.inputs, *self.constants]

    @classmethod
    def of(
        cls,
        graph: fx.Graph,
        accesses: dict[str, Any],
        key_of: Callable[[torch.Tensor], Optional[int]],
        module: nn.Module,
        inputs: list[torch.Tensor],
        constants: list[torch.Tensor],
    ) -> Optional[WrittenState]:
        """The state ``graph``'s nodes may write before a check stops them, from the
        recording's ``accesses`` (by node name) and its storage ids (``key_of``, asked
        while the recording is alive); ``None`` where a storage written is not found
        among ``module``'s parameters, buffers and tensor attributes, the ``inputs`` and
        the graph's ``constants``."""
        checks = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, OutputCheck)]
        after_all = _descendants_of_all(checks)
        allocated: set[int] = set()
        for acc in accesses.values():
            allocated |= acc.fresh
        wanted: set[int] = set()
        for name, acc in accesses.items():
            if name in after_all:
                continue
            wanted |= (acc.external()[1] | acc.unmarked) - allocated
        # The generators' state (a random draw's write) is no storage: the runner puts it
        # back itself before running the call as written.
        wanted.discard(RNG_KEY)
        if not wanted:
            return cls([], [], [], [])
        found: dict[int, tuple[str, str, Any]] = {}

        def offer(t: Any, name: str, kind: str, where: Any) -> None:
            if isinstance(t, torch.Tensor):
                key = key_of(t)
                if key in wanted and key not in found:
                    found[key] = (name, kind, where)

        for i, t in enumerate(inputs):
            offer(t, f"input {i}", "input", i)
        for path, m in module.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            for table in (m._parameters, m._buffers, m.__dict__):
                for name, t in list(table.items()):
                    offer(t, prefix + name, "table", (table, name))
        for t in constants:
            offer(t, "a constant of the graph", "constant", t)
        if len(found) < len(wanted):
            return None
        kinds: dict[str, list] = {"table": [], "input": [], "constant": []}
        for _, kind, where in found.values():
            kinds[kind].append(where)
        names = [name for name, _, _ in found.values()]
        return cls(kinds["table"], kinds["input"], kinds["constant"], names)

    def save(self, tensors: list[torch.Tensor]) -> Optional[list]:
        """A copy of each storage's bytes, before a call of the plan: ``[(views, copy)]``,
        one copy per device (one ``cat``: a kernel, not one per storage), or ``None``
        where there is nothing to save."""
        held = [table.get(name) for table, name in self.tables]
        held += self.constants
        cached = self._views
        if (
            cached is None
            or len(cached[0]) != len(held)
            or not all(a is b for a, b in zip(held, cached[0]))
            or [None if t is None else t.data_ptr() for t in held] != cached[1]
        ):
            cached = self._views = (held, [None if t is None else t.data_ptr() for t in held], _views_of(held))
        groups = cached[2]
        if self.inputs:
            groups = _views_of([*held, *(tensors[i] for i in self.inputs)])
        if not groups:
            return None
        with torch.no_grad():
            return [(group, torch.cat(group)) for group in groups]

    @staticmethod
    def restore(saved: Optional[list]) -> None:
        """Put back what :meth:`save` copied (the caller ordered the plan's writes before
        this: every stream joined the caller's)."""
        if saved is None:
            return
        with torch.no_grad():
            for group, copy in saved:
                offset = 0
                for view in group:
                    n = view.numel()
                    view.copy_(copy[offset : offset + n])
                    offset += n


def _views_of(tensors: list) -> list[list[torch.Tensor]]:
    """Byte views of the storages of ``tensors`` (each storage once), grouped by device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if t is None:
            continue
        whole = _whole(t)
        ptr = whole.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        by_device.setdefault(whole.device, []).append(whole)
    return list(by_device.values())


def _descendants_of_all(checks: list[fx.Node]) -> set[str]:
    """Names of the nodes that read, directly or not, the value of every node in
    ``checks`` (none where there is no check)."""
    common: Optional[set[str]] = None
    for check in checks:
        seen: set[str] = set()
        todo = list(check.users)
        while todo:
            node = todo.pop()
            if node.name in seen:
                continue
            seen.add(node.name)
            todo.extend(node.users)
        common = seen if common is None else common & seen
    return common or set()
