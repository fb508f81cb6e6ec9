"""Refusing a trace whose reads of held tensors run-time code may make stale.

The trace runs the forward once, and what the forward reads from state held outside
the graph's parameters and buffers (a tensor in a dict a plain object holds, an item of
a list, an attribute of an object, a module's plain tensor attribute) it reads then,
at trace time: the graph holds that tensor as a constant (or a ``get_attr`` read in
graph order, not in the forward's order). That is exact only where nothing writes that
state during the call. Code the trace does not run does run during the call: hooks of a
leaf module (they fire in its ``__call__`` at run time, not while the trace makes its
``call_module`` node), the forward of a module run as one opaque call, and
``@streamsched.branch`` / opaque functions. A forward hook that stores its module's
output where the forward reads it back (a feature collector) would hand every call the
previous call's tensor: the trace read the value the last call left, and the held-state
guards, seeing it replaced, only re-trace to bake the next stale one.

Whether such code writes the state cannot be told from outside (a hook that only reads
looks like one that writes), so a graph that reads a held tensor while such code runs
in the same call is refused: the forward then runs in eager dispatch, where each read
happens when eager's does. Global module hooks already make the wrapper run the model
as written (``runner``), and a hook added after planning changes the hook guards
(``state``), so the next call re-traces and meets this check.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import fx

from ..branch import BranchCall, runs_as_branch
from .effects import storage_key
from .hooks import has_hooks
from .opaque_functions import OpaqueFunction

__all__ = ["stale_held_read"]


def stale_held_read(
    graph: fx.Graph,
    root: torch.nn.Module,
    resolve: Callable[[str], Any],
    fresh: set[int],
    baked: tuple[torch.Tensor, ...],
) -> Optional[str]:
    """Why ``graph`` may answer a call with a stale held tensor (module docstring), or
    None. ``fresh``: the storages of tensors made while tracing; ``baked``: held tensors
    the trace computed with as real tensors."""
    updated = _buffer_updated_in_the_call(graph, resolve, baked)
    if updated is not None:
        return updated
    read = _held_read(graph, root, resolve, fresh, baked)
    if read is None:
        return None
    writer = _run_time_code(graph, resolve)
    if writer is None:
        return None
    return (
        f"the forward reads {read}, held outside the parameters and buffers, which {writer} runs "
        "during the same call and may replace: the trace would read it before that code runs"
    )


def _held_read(
    graph: fx.Graph, root: torch.nn.Module, resolve: Callable[[str], Any], fresh: set[int], baked: tuple
) -> Optional[str]:
    """A description of the first held tensor ``graph`` reads (a constant or a plain
    attribute, not a parameter or buffer, not made while tracing), or None."""
    if baked:
        return f"a held {_describe(baked[0])} (computed with while tracing)"
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, name = str(node.target).rpartition(".")
        try:
            owner = resolve(owner_path) if owner_path else root
            value = getattr(owner, name)
        except Exception:  # noqa: BLE001 - not resolvable here: not a held tensor we can name
            continue
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        if isinstance(owner, torch.nn.Module) and name in owner._buffers:
            continue
        if storage_key(value) in fresh:
            continue
        return f"a held {_describe(value)} ('{node.target}' in the graph)"
    return None


def _buffer_updated_in_the_call(graph: fx.Graph, resolve: Callable[[str], Any], baked: tuple) -> Optional[str]:
    """Why a held tensor the trace computed with (``baked``) would be stale, where it
    shares its storage with a buffer that a module the graph calls updates during the
    call (a view of a batch norm's running variance, kept as a plain attribute, read
    after the batch norm in training), or None. The trace computed with the value from
    before the call; eager reads the one the module just wrote."""
    held_at = {storage_key(t): t for t in baked}
    held_at.pop(None, None)
    if not held_at:
        return None
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        for path, sub in resolve(node.target).named_modules(prefix=str(node.target)):
            if not sub.training:
                continue  # (in eval a module of torch.nn updates no buffer)
            for name, buffer in sub._buffers.items():
                held = held_at.get(storage_key(buffer)) if buffer is not None else None
                if held is not None:
                    return (
                        f"the forward computes with a held {_describe(held)} that shares its storage with "
                        f"the buffer '{name}' of {type(sub).__name__} ('{path}'), which that module updates "
                        "during the call in training: the trace would compute with the value from before it"
                    )
    return None


def _run_time_code(graph: fx.Graph, resolve: Callable[[str], Any]) -> Optional[str]:
    """A description of the first code the graph runs at run time that the trace did
    not see (a hook, an opaque module's forward, a branch or opaque function), or None."""
    for node in graph.nodes:
        if node.op == "call_module":
            module = resolve(node.target)
            for sub in module.modules():
                if has_hooks(sub):
                    return f"a hook of {type(sub).__name__} ('{node.target}')"
            if runs_as_branch(module) or not type(module).__module__.startswith("torch."):
                return f"{type(module).__name__}.forward ('{node.target}', run as one call)"
        elif node.op == "call_function" and isinstance(node.target, (BranchCall, OpaqueFunction)):
            return f"the opaque function {getattr(node.target, 'label', None) or node.target}"
    return None


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} tensor"
