"""Small facts about fx nodes: what to call them, and whether they are glue.

A *compute* node launches real work (a module call, a matmul, a branch). A *glue* node
only reshapes or picks apart values (views, ``getitem``, ``x.shape``) and is never worth
a stream or an event of its own.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from .. import _generation
from ..branch import BranchCall
from . import node_meta
from .opaque_outputs import OutputCheck

__all__ = [
    "node_label",
    "span_label",
    "is_glue",
    "scope_of",
    "target_name",
    "submodule",
    "submodule_resolver",
    "SubmoduleResolver",
    "resolving_submodules",
    "VIEW_METHODS",
    "AUGMENTED_OPERATORS",
]

VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "permute",
        "transpose",
        "t",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "narrow",
        "chunk",
        "split",
        "unbind",
        "size",
        "dim",
        "select",
        "movedim",
        "__getitem__",
        "detach",
        "numel",
        "stride",
        "is_contiguous",
        "type_as",
        "contiguous",
    }
)

# The operators of augmented assignment (``x += y``): traced as calls of these, they
# write their first argument in place when it is a tensor, as the statement does.
AUGMENTED_OPERATORS = (
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.imatmul,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
)

VIEW_FUNCTIONS = frozenset(
    {
        operator.getitem,
        getattr,
        torch.flatten,
        torch.reshape,
        torch.permute,
        torch.transpose,
        torch.squeeze,
        torch.unsqueeze,
        torch.chunk,
        torch.split,
        torch.unbind,
        torch.narrow,
        torch.select,
        torch.movedim,
        torch.t,
        torch.Tensor.size,
        torch.Tensor.dim,
        len,
    }
)


def target_name(node: fx.Node) -> str:
    """A short name for what a node does: ``relu``, ``cat``, ``Linear``."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    if isinstance(target, BranchCall):
        return target.task_name
    return getattr(target, "__name__", None) or type(target).__name__


def scope_of(node: fx.Node) -> str:
    """The path of the innermost module whose forward created this node ("" for the root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = next(reversed(stack))
    if node.op == "call_module" and path == node.target:
        # The stack of a leaf call ends with the leaf itself; its scope is the parent.
        items = list(stack)
        return items[-2] if len(items) > 1 else ""
    return path


def node_label(node: fx.Node) -> str:
    """The name users see for a node: a module path, a branch name, or ``scope.op``."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "call_function" and isinstance(node.target, BranchCall):
        return node.target.task_name
    fused = node_meta.fused_label(node)
    if fused:
        return fused
    if node.op == "call_function" and isinstance(node.target, OutputCheck) and isinstance(node.args[0], fx.Node):
        # The check of what a leaf call returned goes by the call's name.
        return node_label(node.args[0])
    scope = scope_of(node)
    name = target_name(node)
    return f"{scope}.{name}" if scope else name


# Branch calls named inside a span's label, at most; the rest are counted.
_NAMED_BRANCHES = 3


def span_label(compute: Sequence[fx.Node]) -> str:
    """The name of a run of nodes (a task): ``first .. last``, and the user's
    ``@streamsched.branch`` calls between them by name, ``[with head, refine]``: merging
    cheap neighbours into one task must not hide the functions the user marked."""
    first, last = node_label(compute[0]), node_label(compute[-1])
    label = first if first == last else f"{first} .. {last}"
    inner = [node_label(n) for n in compute[1:-1] if n.op == "call_function" and isinstance(n.target, BranchCall)]
    inner = [name for name in dict.fromkeys(inner) if name not in (first, last)]
    if inner:
        named = ", ".join(inner[:_NAMED_BRANCHES])
        more = f" and {len(inner) - _NAMED_BRANCHES} more" if len(inner) > _NAMED_BRANCHES else ""
        label += f" [with {named}{more}]"
    return label


def is_glue(node: fx.Node, root: Any = None) -> bool:
    """Whether the node only views or unpacks values (no kernel worth scheduling)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return True
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    if node.op == "call_function":
        if node.target in VIEW_FUNCTIONS:
            return True
        return node_meta.is_inserted_glue(node)
    return False


# --- children ---------------------------------------------------------------------------

_CHILDREN = (nn.Module.children, nn.Module.named_children)


def _default_children(m: nn.Module) -> bool:
    kind = type(m)
    return (kind.children, kind.named_children) == _CHILDREN


def has_children(m: nn.Module) -> bool:
    """``next(m.children(), None) is not None``, read off ``m._modules`` where the class
    keeps ``nn.Module``'s own ``children``: asked of every module of a model on a first
    call, and the generator (with its memo set) cost more than the answer."""
    if not _default_children(m):
        return next(m.children(), None) is not None
    for child in m._modules.values():
        if child is not None:
            return True
    return False


def children_of(m: nn.Module) -> list[nn.Module]:
    """``list(m.children())``, read off ``m._modules`` as :func:`has_children` does."""
    if not _default_children(m):
        return list(m.children())
    out: list[nn.Module] = []
    seen: set[nn.Module] = set()
    for child in m._modules.values():
        if child is not None and child not in seen:
            seen.add(child)
            out.append(child)
    return out


# --- module paths ----------------------------------------------------------------------

_resolved = threading.local()


class SubmoduleResolver:
    """``root.get_submodule`` as a callable, each path resolved once (a path whose parent
    was resolved costs one attribute lookup). For as long as nothing re-wires ``root``'s
    modules: see :func:`resolving_submodules`."""

    __slots__ = ("root", "found", "_walk")

    def __init__(self, root: nn.Module):
        self.root = root
        self.found: dict[str, nn.Module] = {}
        """The paths resolved so far."""
        # A root with its own get_submodule resolves every path itself (each once).
        self._walk = type(root).get_submodule is nn.Module.get_submodule

    def __call__(self, target: str) -> nn.Module:
        module = self.found.get(target)
        if module is None:
            parent, _, name = target.rpartition(".")
            module = getattr(self(parent), name, None) if parent and self._walk else None
            if not isinstance(module, nn.Module):
                module = self.root.get_submodule(target)  # or get_submodule's own error
            self.found[target] = module
        return module


def submodule_resolver(root: nn.Module) -> Callable[[str], nn.Module]:
    """A :class:`SubmoduleResolver` of ``root``."""
    return SubmoduleResolver(root)


@contextlib.contextmanager
def resolving_submodules(root: nn.Module) -> Iterator[None]:
    """While entered (on this thread), :func:`submodule` resolves each path of ``root``
    once: planning looks up the module of every ``call_module`` node in several passes
    (fusion's signatures, its kernels, costs, coverage), and on a model of thousands of
    module calls each ``get_submodule`` walk (two attribute lookups per path component)
    added up to a third of the planning time. The resolutions are dropped when the
    block ends, and ignored within it once any module of a wrapped model is re-wired
    (the generation moves)."""
    previous = getattr(_resolved, "cache", None)
    _resolved.cache = (root, _generation.current(), SubmoduleResolver(root))
    try:
        yield
    finally:
        _resolved.cache = previous


def submodule(root: nn.Module, target: str) -> nn.Module:
    """``root.get_submodule(target)``; inside :func:`resolving_submodules` for ``root``,
    each path is resolved once."""
    cache = getattr(_resolved, "cache", None)
    if cache is None or cache[0] is not root or cache[1] != _generation.current():
        return root.get_submodule(target)
    resolver = cache[2]
    module = resolver.found.get(target)  # resolved before: no call
    return module if module is not None else resolver(target)
