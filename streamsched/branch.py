"""``@streamsched.branch``: mark a function, method or module class as one opaque task.

A branch is a unit of work the scheduler may run beside other work. Its body is never
traced: it may hold any Python (loops, ``if`` on tensor values, ``.item()``, prints), and
runs as one task on one stream.

Three forms::

    import streamsched as ss

    @ss.branch
    def tower(x, w):                 # a free function
        ...

    class Model(nn.Module):
        @ss.branch
        def head(self, h):           # a method: runs with the module as ``self``
            ...

    @ss.branch
    class Block(nn.Module):          # a module class: every instance is a leaf task
        ...

A ``@staticmethod`` (the decorator above or below it) and a ``functools.partial`` work as
a free function does; a classmethod, or a module instance (decorate its class, or name
it in ``leaf_modules``), is refused with a ``TypeError`` that says so.

Outside a :class:`~streamsched.StreamScheduledModule` a decorated function behaves
exactly like the undecorated one.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import fx

__all__ = ["branch", "is_branch_module", "runs_as_branch", "BranchCall"]

F = TypeVar("F")

_BRANCH_ATTR = "__streamsched_branch__"

# Set by the eager-dispatch executor while a model's own forward runs, so that each
# branch call can be launched on a pool stream instead of inline.
_eager_launcher: contextvars.ContextVar[Optional[Callable[..., Any]]] = contextvars.ContextVar(
    "streamsched_eager_launcher", default=None
)


class BranchCall:
    """The callable stored as the target of a traced branch node.

    Holds the decorated function and, for methods, the module it is bound to (with its
    path in the traced model, which names the task).
    """

    def __init__(self, fn: Callable[..., Any], owner: Optional[torch.nn.Module], owner_path: Optional[str]):
        self.fn = fn
        self.owner = owner
        self.owner_path = owner_path
        # fx formats call_function targets by __module__ and __name__.
        self.__module__ = getattr(fn, "__module__", None) or "streamsched"
        # A functools.partial (or another callable object) has no __name__ of its own.
        inner = getattr(fn, "func", fn)
        self.__name__ = getattr(fn, "__name__", None) or getattr(inner, "__name__", None) or type(fn).__name__
        self.__qualname__ = getattr(fn, "__qualname__", None) or getattr(inner, "__qualname__", self.__name__)

    @property
    def task_name(self) -> str:
        if self.owner is None:
            return self.__qualname__
        return f"{self.owner_path}.{self.__name__}" if self.owner_path else self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.owner is None:
            return self.fn(*args, **kwargs)
        return self.fn(self.owner, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<branch {self.task_name}>"


def _find_proxy(obj: Any) -> Optional[fx.Proxy]:
    if isinstance(obj, fx.Proxy):
        return obj
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = _find_proxy(item)
            if found is not None:
                return found
    elif isinstance(obj, dict):
        for item in obj.values():
            found = _find_proxy(item)
            if found is not None:
                return found
    return None


def _module_path(tracer: fx.Tracer, module: torch.nn.Module) -> str:
    try:
        return tracer.path_of_module(module)
    except NameError as exc:
        raise TypeError(
            f"@streamsched.branch method {type(module).__name__} is bound to a module that "
            "is not a submodule of the model being traced; register it as a submodule "
            "(an attribute or an nn.ModuleList entry) so its parameters are part of the model"
        ) from exc


def branch(obj: F) -> F:
    """Mark a function, a method, or an ``nn.Module`` subclass as one opaque branch task.

    Example::

        >>> import torch, streamsched as ss
        >>> @ss.branch
        ... def scaled(x, k: float):
        ...     return x * k if k > 0 else -x      # control flow is fine inside a branch
        >>> scaled(torch.ones(2), 2.0)
        tensor([2., 2.])
    """
    if isinstance(obj, type):
        if not issubclass(obj, torch.nn.Module):
            raise TypeError(f"@streamsched.branch on a class needs an nn.Module subclass, got {obj.__name__}")
        setattr(obj, _BRANCH_ATTR, True)
        return obj
    if isinstance(obj, staticmethod):
        # `@ss.branch` above `@staticmethod`: the wrapper must stay a staticmethod, or the
        # instance is passed as the first argument of a function that takes none.
        return staticmethod(branch(obj.__func__))  # type: ignore[return-value]
    if isinstance(obj, classmethod):
        raise TypeError(
            f"@streamsched.branch cannot mark the classmethod {obj.__func__.__qualname__}: a branch runs "
            "with the module instance as `self` or with no receiver; make it a method or a @staticmethod"
        )
    if isinstance(obj, torch.nn.Module):
        # A wrapper function stored on a model is no submodule: its parameters would drop
        # out of model.parameters(), state_dict and .to().
        raise TypeError(
            f"@streamsched.branch marks a module class, not an instance (got a {type(obj).__name__}): "
            f"decorate the class, or pass leaf_modules=({type(obj).__name__},) to StreamScheduledModule"
        )
    if not callable(obj):
        raise TypeError(f"@streamsched.branch needs a function, method or module class, got {obj!r}")

    fn = obj

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # `a or b` would call bool() on a Proxy, which fx treats as control flow.
        proxy = _find_proxy(args)
        if proxy is None:
            proxy = _find_proxy(kwargs)
        if proxy is not None:
            tracer = proxy.tracer
            owner = None
            owner_path = None
            call_args = args
            if args and isinstance(args[0], torch.nn.Module):
                owner = args[0]
                owner_path = _module_path(tracer, owner)
                call_args = args[1:]
            target = BranchCall(fn, owner, owner_path)
            return tracer.create_proxy("call_function", target, call_args, kwargs)
        launcher = _eager_launcher.get()
        if launcher is not None:
            return launcher(fn, args, kwargs)
        return fn(*args, **kwargs)

    setattr(wrapper, _BRANCH_ATTR, True)
    return wrapper  # type: ignore[return-value]


def is_branch_module(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class was decorated with ``@streamsched.branch``."""
    return bool(getattr(type(module), _BRANCH_ATTR, False))


def runs_as_branch(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` is a branch: its class, or its class's ``forward``,
    was decorated with ``@streamsched.branch``."""
    return is_branch_module(module) or bool(getattr(type(module).forward, _BRANCH_ATTR, False))
