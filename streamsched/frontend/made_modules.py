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
before, and the model runs as written; so is one the model holds outside its submodules
(a plain list of activations): the same object every call, whose attributes may change.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from .hooks import has_hooks


def _holds(value: Any, m: torch.nn.Module) -> bool:
    if value is m:
        return True
    if isinstance(value, (list, tuple)):
        return any(v is m for v in value)
    if isinstance(value, dict):
        return any(v is m for v in value.values())
    return False


def made_module_refusal(m: torch.nn.Module, owners: Iterable[torch.nn.Module]) -> Optional[str]:
    """Why ``m``, a module that is not installed in the model, cannot be traced
    through; ``None`` where it can. ``owners`` are the modules the trace went through:
    one holding ``m`` (in an attribute, a plain list or dict) keeps it from call to call,
    where its attributes may change (a ``LeakyReLU``'s slope) while a trace would have
    baked them in."""
    for owner in owners:
        if any(_holds(v, m) for v in vars(owner).values()):
            return (
                f"a {type(m).__name__} the model holds outside its submodules (in a plain attribute, "
                "list or dict): its attributes may change between calls, a trace would bake them in"
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
