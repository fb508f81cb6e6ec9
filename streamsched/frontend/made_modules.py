"""Modules a forward makes as it runs: transformers' heads compute their loss with
``loss_fct = CrossEntropyLoss(ignore_index=-100)`` built in the forward, on every call.

Such a module is no submodule of the model: fx cannot name it for a ``call_module``
node, and a node holding the object would run that one instance on every call where
eager builds a new one. A module without parameters or buffers (the losses,
``nn.Dropout(p)``, ``nn.Flatten()``, activation modules) is a function of its
constructor's plain arguments, which the trace sees as the forward passes them, so its
forward is traced through where it is called: its operations become the plan's and the
rest of the model is traced and scheduled. One that holds tensors (a ``Linear`` made
per call draws new weights each time; a loss given a class-weight tensor) is refused as
before, and the model runs as written.

Only a module *constructed while the trace ran* (:func:`recording`) is traced through:
one the forward reaches otherwise (a global ``ACT = nn.LeakyReLU(0.1)``, a closure cell,
a class attribute, an attribute of a plain object the model holds, a default argument)
is the same object every call, whose attributes may change between calls (the slope),
which a trace would bake in. Telling those apart by where the object is *not* found
(the traced modules' attributes) cannot be complete; construction during the trace can.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Iterator, Optional

import torch

from .hooks import has_hooks

# Modules constructed on each tracing thread, one dict per active :func:`recording`
# (nested traces on one thread each see what was built inside them). Other threads
# construct modules concurrently: only the recording thread's constructions count.
_RECORDERS: dict[int, list[dict[int, torch.nn.Module]]] = {}
_PATCH_LOCK = threading.Lock()
_ORIGINAL_INIT: Any = None
_ACTIVE = 0
_BURIED = False
"""Whether our patch was left in place below one installed over it (still reached)."""


def _recording_init(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    recorders = _RECORDERS.get(threading.get_ident())
    if recorders:
        # Held (not by id alone) until the recording ends: no id is reused meanwhile.
        for made in recorders:
            made[id(self)] = self
    _ORIGINAL_INIT(self, *args, **kwargs)


@contextlib.contextmanager
def recording() -> Iterator[dict[int, torch.nn.Module]]:
    """Record the modules constructed on this thread while the block runs: a dict
    ``id -> module``. ``nn.Module.__init__`` is patched while any thread records (every
    subclass's ``super().__init__()`` reaches it); calls on other threads pass through."""
    global _ORIGINAL_INIT, _ACTIVE, _BURIED
    made: dict[int, torch.nn.Module] = {}
    thread = threading.get_ident()
    with _PATCH_LOCK:
        if _ACTIVE == 0 and not _BURIED and torch.nn.Module.__init__ is not _recording_init:
            _ORIGINAL_INIT = torch.nn.Module.__init__
            torch.nn.Module.__init__ = _recording_init  # type: ignore[method-assign]
        _ACTIVE += 1
        _RECORDERS.setdefault(thread, []).append(made)
    try:
        yield made
    finally:
        with _PATCH_LOCK:
            stack = _RECORDERS[thread]
            stack.remove(made)
            if not stack:
                del _RECORDERS[thread]
            _ACTIVE -= 1
            # Take back only our own patch: one installed over it since stays, and ours
            # below it (passing every call through while nothing records) is reused.
            if _ACTIVE == 0:
                if torch.nn.Module.__init__ is _recording_init:
                    torch.nn.Module.__init__ = _ORIGINAL_INIT  # type: ignore[method-assign]
                else:
                    _BURIED = True


def kept_after_trace(made_through: list) -> Optional[str]:
    """Why the trace must be refused where a module it traced through as made by the
    forward (weak references in ``made_through``) outlives the trace; ``None`` where all
    are gone. A module constructed on the traced call but kept (a global filled on the
    first call, an ``functools.lru_cache`` factory) is the same object on later calls,
    whose attributes may change while the trace baked them in. Modules hold no reference
    cycles of their own, so the common case needs no collection: one runs only where a
    module is still alive."""
    alive = [ref() for ref in made_through]
    if not any(m is not None for m in alive):
        return None
    del alive
    gc.collect()
    for ref in made_through:
        m = ref()
        if m is not None:
            return (
                f"a {type(m).__name__} the forward constructed while traced is kept after the call (a global "
                "or cache filled on the first call): the same object on later calls, its attributes may "
                "change between calls and a trace would bake them in"
            )
    return None


def made_module_refusal(m: torch.nn.Module, made: dict[int, torch.nn.Module]) -> Optional[str]:
    """Why ``m``, a module that is not installed in the model, cannot be traced
    through; ``None`` where it can. ``made`` are the modules constructed during the
    trace (:func:`recording`): any other is kept from call to call somewhere the forward
    reaches (a global, closure, class attribute or held object), where its attributes may
    change (a ``LeakyReLU``'s slope) while a trace would have baked them in. One made
    during the trace but kept for the next call (stored on the model, in a cache) is
    refused once the trace ends (:func:`kept_after_trace`)."""
    if made.get(id(m)) is not m:
        return (
            f"a {type(m).__name__} the forward reaches outside the model's submodules (a global, closure, "
            "class attribute or held object): the same object every call, its attributes may change "
            "between calls and a trace would bake them in"
        )
    if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
        return (
            f"a {type(m).__name__} made while the forward runs holds parameters or buffers: "
            "a trace would bake in the tensors of one call"
        )
    if any(isinstance(v, torch.Tensor) for sub in m.modules() for v in vars(sub).values()):
        return f"a {type(m).__name__} made while the forward runs holds tensors: a trace would bake them in"
    if any(has_hooks(sub) for sub in m.modules()):
        return f"a {type(m).__name__} made while the forward runs has hooks, which must fire on every call"
    return None
