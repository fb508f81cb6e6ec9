"""A process-wide counter that moves whenever any module registers a submodule,
parameter or buffer (``setattr`` of one, ``register_*``, construction of a module) or
deletes an attribute (``del model.head``, ``del model.layers[0]``).

Wrappers compare it with the value they last validated against: unchanged means no
module anywhere was re-wired, so the per-call check costs one integer comparison.
When it moved, the wrapper re-checks that every module its plans call is still in
place (and re-traces if not).
"""

from __future__ import annotations

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
