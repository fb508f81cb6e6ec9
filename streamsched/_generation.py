"""A process-wide counter that moves whenever any module registers a submodule,
parameter or buffer (``setattr`` of one, ``register_*``, construction of a module).

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
