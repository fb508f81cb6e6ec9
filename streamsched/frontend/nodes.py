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
    "modules_of",
    "named_modules_of",
    "own_tensor_ids",
    "own_tensors",
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


# --- module walks ----------------------------------------------------------------------

_NAMED_MODULES = nn.Module.named_modules
_MODULES = nn.Module.modules
_OWN_TENSORS = (
    nn.Module.parameters,
    nn.Module.named_parameters,
    nn.Module.buffers,
    nn.Module.named_buffers,
    nn.Module._named_members,
)


def _walks_plainly(cls: type) -> bool:
    """Whether ``nn.Module.named_modules`` visits a module of class ``cls`` as
    :func:`modules_of` does: the class keeps torch's own ``named_modules``, and its
    instances are told apart by identity (the walk's memo set hashes them)."""
    return (
        getattr(cls, "named_modules", None) is _NAMED_MODULES
        and cls.__hash__ is object.__hash__
        and cls.__eq__ is object.__eq__
    )


def modules_of(root: nn.Module) -> list[nn.Module]:
    """``list(root.modules())``: the same modules in the same order, walked without a
    generator per module (asked of a whole model several times per trace; on a model of
    thousands of modules each generator walk cost milliseconds). Where a class in the
    tree walks its own way (its own ``named_modules``, ``__hash__`` or ``__eq__``), it is
    ``list(root.modules())`` itself."""
    if type(root).modules is not _MODULES:
        return list(root.modules())
    out: list[nn.Module] = []
    memo: set[int] = set()
    plain: set[type] = set()
    stack = [root]
    pop, push = stack.pop, stack.extend
    while stack:
        m = pop()
        key = id(m)
        if key in memo:
            continue
        kind = type(m)
        if kind not in plain:
            if not _walks_plainly(kind):
                return list(root.modules())
            plain.add(kind)
        memo.add(key)
        out.append(m)
        children = m._modules
        if children:
            # Pushed last first: popped (visited) in their order, depth first.
            push([c for c in reversed(children.values()) if c is not None])
    return out


def named_modules_of(root: nn.Module, remove_duplicate: bool = True) -> list[tuple[str, nn.Module]]:
    """``list(root.named_modules(remove_duplicate=remove_duplicate))``, walked as
    :func:`modules_of` walks."""
    out: list[tuple[str, nn.Module]] = []
    memo: set[int] = set()
    plain: set[type] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    pop, push = stack.pop, stack.extend
    while stack:
        item = pop()
        m = item[1]
        key = id(m)
        if key in memo:
            continue
        kind = type(m)
        if kind not in plain:
            if not _walks_plainly(kind):
                return list(root.named_modules(remove_duplicate=remove_duplicate))
            plain.add(kind)
        if remove_duplicate:
            memo.add(key)
        out.append(item)
        children = m._modules
        if children:
            prefix = item[0] + "." if item[0] else ""
            push([(prefix + name, c) for name, c in reversed(children.items()) if c is not None])
    return out


def own_tensors(root: nn.Module) -> list[torch.Tensor]:
    """The tensors of ``(*root.parameters(), *root.buffers())`` (a tensor that several
    modules hold may come more than once), read off the tables of :func:`modules_of`'s
    modules (the two walks generated a frame per module and per tensor)."""
    kind = type(root)
    if (
        kind.parameters,
        kind.named_parameters,
        kind.buffers,
        kind.named_buffers,
        kind._named_members,
    ) != _OWN_TENSORS:
        return [*root.parameters(), *root.buffers()]
    out: list[torch.Tensor] = []
    for m in modules_of(root):
        for table in (m._parameters, m._buffers):
            if table:
                out.extend([t for t in table.values() if t is not None])
    return out


def own_tensor_ids(root: nn.Module) -> set[int]:
    """``{id(t) for t in (*root.parameters(), *root.buffers())}`` (:func:`own_tensors`)."""
    return {id(t) for t in own_tensors(root)}


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
def resolving_submodules(root: nn.Module, resolver: SubmoduleResolver | None = None) -> Iterator[None]:
    """While entered (on this thread), :func:`submodule` resolves each path of ``root``
    once: planning looks up the module of every ``call_module`` node in several passes
    (fusion's signatures, its kernels, costs, coverage), and on a model of thousands of
    module calls each ``get_submodule`` walk (two attribute lookups per path component)
    added up to a third of the planning time. The resolutions are dropped when the
    block ends, and ignored within it once any module of a wrapped model is re-wired
    (the generation moves). ``resolver``: one of ``root`` whose resolutions hold now (no
    module re-wired since they were made), to go on with; inside a block for ``root``
    whose resolutions still hold, that block's is gone on with."""
    previous = getattr(_resolved, "cache", None)
    generation = _generation.current()
    if resolver is None or resolver.root is not root:
        if previous is not None and previous[0] is root and previous[1] == generation:
            resolver = previous[2]
        else:
            resolver = SubmoduleResolver(root)
    _resolved.cache = (root, generation, resolver)
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
