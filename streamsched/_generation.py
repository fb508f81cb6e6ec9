"""A process-wide counter that moves whenever any module registers a submodule,
parameter or buffer (``setattr`` of one, ``register_*``, construction of a module),
deletes an attribute (``del model.head``, ``del model.layers[0]``), or sets a *watched*
plain attribute: ``training`` (``.train()``, ``.eval()``, ``bn.training = False``) and
every flag a trace read from a traced-through module (``drop_prob``, ``use_cache``...),
whose value the trace baked in.

Wrappers compare it with the value they last validated against: unchanged means no
module anywhere was re-wired, so the per-call check costs one integer comparison.
When it moved, the wrapper re-checks that every module its plans call is still in
place (and re-traces if not).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

from torch.nn.modules import module as _module

_generation = 0


def current() -> int:
    return _generation


def _bump(*_args, **_kwargs) -> None:
    global _generation
    _generation += 1
    return None


_handles = (
    _module.register_module_module_registration_hook(_bump),
    _module.register_module_parameter_registration_hook(_bump),
    _module.register_module_buffer_registration_hook(_bump),
)

# PyTorch has no hook for removals; wrap __delattr__ (behaviour unchanged) so that
# deleting a submodule or parameter moves the counter too.
_original_delattr = _module.Module.__delattr__


def _delattr(self, name: str) -> None:
    _bump()
    _original_delattr(self, name)


if not getattr(_module.Module.__delattr__, "_streamsched", False):
    _delattr._streamsched = True  # type: ignore[attr-defined]
    _module.Module.__delattr__ = _delattr  # type: ignore[method-assign]

# Plain attributes whose assignment moves the counter. Traces add the names of the flags
# they bake in (``watch``); the set only grows, and checking it costs one set lookup.
_watched: set[str] = {"training"}
# While a trace runs on some thread, an assignment to a module attribute from that thread
# is a side effect the trace would not repeat: the tracer registers a callback here.
_on_setattr: dict[int, Callable[[Any, str], None]] = {}
_original_setattr = _module.Module.__setattr__


def watch(names: Iterable[str]) -> None:
    """Move the counter whenever any module attribute of one of these names is assigned."""
    _watched.update(names)


def _setattr(self, name: str, value: Any) -> None:
    if name in _watched:
        _bump()
    if _on_setattr:
        callback = _on_setattr.get(threading.get_ident())
        if callback is not None:
            callback(self, name)
    _original_setattr(self, name, value)


if not getattr(_module.Module.__setattr__, "_streamsched", False):
    _setattr._streamsched = True  # type: ignore[attr-defined]
    _module.Module.__setattr__ = _setattr  # type: ignore[method-assign]
