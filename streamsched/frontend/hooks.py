"""Module hooks: which modules have them, and whether PyTorch's global ones are set.

A hook fires inside ``nn.Module.__call__``. The trace cannot keep one on a module it
traces through (the hook would run once, at trace time, on fx proxies), and no fused
kernel can fire one per member; so a hooked module runs as one call of its own
(``frontend.trace``), is never fused (``passes.fusion``), and hooks on the wrapped model
itself or global module hooks make the wrapper run the model as written (``module``).
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["has_hooks", "global_hooks"]


def has_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has a forward, forward-pre, backward or backward-pre hook."""
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None)
    )


def global_hooks() -> bool:
    """Whether a global module hook (``nn.modules.module.register_module_forward_hook``
    and its siblings) is registered: it fires on every module call of every model."""
    return bool(
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or getattr(_module, "_global_backward_pre_hooks", None)
    )
