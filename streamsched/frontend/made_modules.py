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
"""

from __future__ import annotations

from typing import Optional

import torch

from .hooks import has_hooks


def made_module_refusal(m: torch.nn.Module) -> Optional[str]:
    """Why ``m``, a module the forward made (not installed in the model), cannot be
    traced through; ``None`` where it can."""
    if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
        return (
            f"a {type(m).__name__} made while the forward runs holds parameters or buffers: "
            "a trace would bake in the tensors of one call"
        )
    if any(has_hooks(sub) for sub in m.modules()):
        return f"a {type(m).__name__} made while the forward runs has hooks, which must fire on every call"
    return None
