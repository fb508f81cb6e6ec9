"""What fusion keeps for one wrapped model across all of its plans.

:class:`FusionContext` owns the stacked parameters of one model (so two plans never stack
the same weights twice) and the :class:`~streamsched.passes.fusion.stacked.StackedParameter`
of each group once ``fused_parameters()`` asked for them (kept across re-planning, so an
optimizer holding them stays valid). Each plan runs the pass through :meth:`FusionContext.fuse`.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, Sequence

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from ... import _generation
from ...frontend.effects import element_range
from ...frontend.nodes import own_tensors
from .fuse import FuseResult, fuse_graph
from .params import StackedTensors, stacks_holding
from .propose import StaticSignatures, plain_attribute_names, structure_signature
from .stacked import StackedParameter

__all__ = ["FusionContext"]

log = logging.getLogger(__name__)


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only view of its whole storage (so it can be re-pointed)."""
    if t.grad_fn is not None or t.is_sparse:
        return False
    if t.is_meta:
        return True
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return t.storage_offset() == 0 and t.is_contiguous() and storage.nbytes() == t.nbytes


def _storage_address(t: Any) -> Optional[int]:
    """The address of a tensor's storage, or None (a meta or sparse tensor, an empty
    storage: no address to tell storages apart by)."""
    if not isinstance(t, torch.Tensor) or t.is_meta or t.is_sparse:
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


class FusionContext:
    """The stacked tensors of one model, shared by all of its plans."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.alias = True
        self.direct_grads = False
        self._stacks: dict[tuple, StackedTensors] = {}
        self._claimed: dict[int, tuple] = {}
        # Parameters and buffers (by id) a recorded call returned a view of, or its graph
        # reads a view of: stacking one would move its storage from under that view
        # (``views_held``).
        self._returned: set[int] = set()
        # Stacked parameters by stack key; they outlive invalidate() (an optimizer holds them).
        self._params: dict[tuple, StackedParameter] = {}
        # Each fused module with the configuration its kernel baked in (class, mode,
        # extra_repr and plain attributes of it and its submodules), by id.
        self._fused: dict[int, tuple[nn.Module, tuple]] = {}
        self._assignments = _generation.assignments()
        # Stacks of plans dropped by invalidate(), by storage address: their members are
        # still views into them, and a new plan may stack them again (else a swapped
        # member would leave its group stacked per call for good).
        # A weak reference tells the stack's storage from a new one at the same address.
        self._released: dict[int, tuple[tuple, StorageWeakRef]] = {}
        # Per traced graph: the size-independent halves of its nodes' fusion signatures,
        # for its plans at other input sizes (propose.StaticSignatures).
        self._statics: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _reclaimable(self, t: torch.Tensor) -> Optional[tuple]:
        """The key of a released stack ``t`` is a view of, or None."""
        if not self._released or t.grad_fn is not None or t.is_sparse or t.device.type == "meta":
            return None
        try:
            entry = self._released.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None
        if entry is None or entry[1].expired():
            return None
        return entry[0]

    def views_held(self, tensors: Sequence[Any]) -> None:
        """Note each parameter and buffer of the model that one of ``tensors`` (a recorded
        call's outputs, the tensors its graph reads as attributes or constants) is a view
        of, not being that tensor itself, so that no stack takes its storage over: the
        storage moved into a stack, such a view would go on showing (and writing) the old
        copy. Eager's view of a weight written by the caller writes the weight; a view a
        module keeps (``self.rows = self.linear.weight.detach()[:2]``) follows every
        optimizer step. The same holds for two parameters or buffers of the model that
        share a storage (a buffer registered as ``weight.detach()``, or as a slice of a
        batch norm's running mean): both are noted, where that storage is not a stack's."""
        tensors_held = own_tensors(self.model)  # (one walk of the modules for both uses)
        own = {id(t) for t in tensors_held}
        storages = set()
        for t in tensors:
            # (A parameter read or returned itself follows its storage.)
            if isinstance(t, torch.Tensor) and id(t) not in own:
                address = _storage_address(t)
                if address is not None:
                    storages.add(address)
        addresses = [_storage_address(t) for t in tensors_held]
        first_at: dict[int, torch.Tensor] = {}
        shared: set[int] = set()
        for t, address in zip(tensors_held, addresses):
            if address is None:
                continue
            if address in storages:
                self._returned.add(id(t))
            first = first_at.setdefault(address, t)
            if first is not t:
                shared.add(address)
        # Members of a stack share its storage by design: only other sharing is held.
        held = {a for a in shared if stacks_holding(first_at[a]) is None}
        if held:
            for t, address in zip(tensors_held, addresses):
                if address in held:
                    self._returned.add(id(t))

    def stack_regions(self) -> dict[int, list[tuple[int, int]]]:
        """Each live stack's storage (by ``_cdata``) with its members' element ranges,
        sorted, for the effect recorder (``EffectRecorder(regions=...)``): a member's
        writes (a fused batch norm's statistics in training) touch its slice only, and
        must not order it after the other members' as one storage would."""
        out: dict[int, list[tuple[int, int]]] = {}
        for stack in self._stacks.values():
            if not stack.alias or stack.stack is None or not stack.live:
                continue
            try:
                address = stack.stack.untyped_storage()._cdata
                ranges = sorted(element_range(t) for t in stack.tensors if t.untyped_storage()._cdata == address)
            except (RuntimeError, NotImplementedError, AttributeError):
                continue
            if len(ranges) != len(stack.tensors) or address in out:
                continue  # (a member elsewhere, or two groups in one storage: named whole)
            if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
                continue  # overlapping members: named whole
            out[address] = ranges
        return out

    def stack_for(self, owners: Sequence[tuple[nn.Module, str]], concat: bool = False) -> StackedTensors:
        key = (tuple((id(m), n) for m, n in owners), concat)
        existing = self._stacks.get(key)
        if existing is not None:
            return existing
        tensors = [getattr(m, n) for m, n in owners]
        unique = len({id(t) for t in tensors}) == len(tensors)
        claimed = any(id(t) in self._claimed for t in tensors)
        returned = any(id(t) in self._returned for t in tensors)
        # (With no released stack, none is a view of one: the members' tensors are not
        # each asked, nor hashed, which for a tensor is a Python call.)
        reclaimed: dict[torch.Tensor, Optional[tuple]] = {}
        if self._released and self.alias and unique and not claimed:
            reclaimed = {t: self._reclaimable(t) for t in tensors}
        alias = self.alias and unique and not claimed and not returned
        share: Optional[StackedTensors] = None
        if alias and not all(_owns_storage(t) for t in tensors):
            # Views into stacks: re-stacked where no live wrapper of the model reads those
            # stacks any more (this one's plans dropped by invalidate(), or another wrapper
            # dropped); read as they are where one live stack (a wrapper of the same model
            # made earlier) holds these very members in this order; else copy mode (taking
            # members out of a live stack would have the two re-stack in turn on every call).
            held = [None if _owns_storage(t) else stacks_holding(t) for t in tensors]
            free = all(
                _owns_storage(t) or (h is not None and not h) or (h is None and reclaimed.get(t) is not None)
                for t, h in zip(tensors, held)
            )
            if not free:
                share = StackedTensors.sharer_of(tensors, concat)
                alias = share is not None
        if alias:
            self._retire_params({k for k in reclaimed.values() if k is not None} - {key})
        if not alias:
            reason = (
                "tensors shared between members"
                if not unique
                else "already stacked for another group"
                if claimed
                else "a call returned a view of one, or the model holds one"
                if returned
                else "fuse_params='copy'"
                if not self.alias
                else "parameters do not own their storage, or another live wrapper stacked them otherwise"
            )
            log.debug("fusion: %d x %s stacked per call (%s)", len(tensors), owners[0][1], reason)
        stack = StackedTensors(
            owners, concat=concat, alias=alias, direct_grads=self.direct_grads, tensors=tensors, share=share
        )
        self._stacks[key] = stack
        if alias:
            for t in tensors:
                self._claimed[id(t)] = key
            param = self._params.get(key)
            if param is not None and param.active:
                if all(a is b for a, b in zip(param._stack.members, stack.tensors)):
                    stack.bind(param)  # re-planned (after .to(), invalidate()): same parameter, new storage
                else:
                    param._deactivate()
                    del self._params[key]
        return stack

    # --- fused_parameters() ------------------------------------------------------------

    def stacked_parameters(self) -> list[torch.Tensor]:
        """Every parameter of the model once, each aliased fused group as one active
        :class:`StackedParameter` (at its first member's place), the others as themselves."""
        names = {id(m): name for name, m in self.model.named_modules(remove_duplicate=False)}
        holder: dict[int, StackedParameter] = {}
        stacks = [
            (key, stack)
            for key, stack in list(self._stacks.items())
            if stack.alias and all(isinstance(t, nn.Parameter) for t in stack.tensors)
        ]
        for _, stack in stacks:
            stack.check(full=True)
        # Checked all before binding any: a refusal leaves every group as it was.
        swapped = [stack for _, stack in stacks if not stack.live]
        if swapped:
            held = [_qualified(names, m, n) for stack in swapped for m, n in stack.owners]
            raise RuntimeError(
                "fused_parameters(): called while torch.func.functional_call (torch.nn.utils.stateless) has "
                f"tensors swapped into the fused parameters {', '.join(held[:4])}{', ...' if len(held) > 4 else ''}; "
                "an optimizer must be given the model's own parameters, which are not in their places until the "
                "call returns: call fused_parameters() before or after functional_call, not inside it"
            )
        for key, stack in stacks:
            param = self._params.get(key)
            if param is None or not all(a is b for a, b in zip(param._stack.members, stack.tensors)):
                param = _shared_param(stack)
            if param is None or not all(a is b for a, b in zip(param._stack.members, stack.tensors)):
                member_names = [_qualified(names, m, n) for m, n in stack.owners]
                param = StackedParameter.over(stack.stack, stack.tensors, member_names, stack.sizes)
            self._params[key] = param
            stack.bind(param)
            param._activate()
            for t in stack.tensors:
                holder[id(t)] = param
        out: list[torch.Tensor] = []
        seen: set[int] = set()
        for p in self.model.parameters():
            q = holder.get(id(p), p)
            if id(q) not in seen:
                seen.add(id(q))
                out.append(q)
        return out

    def member_parameters(self) -> None:
        """Back to per-member gradients: the kernels read the members again."""
        for stack in self._stacks.values():
            stack.unbind()
        for param in self._params.values():
            # Another wrapper of the model reading the same stack through it keeps it.
            if not _bound_elsewhere(param):
                param._deactivate()

    def fuse(
        self, graph: fx.Graph, root: nn.Module, metas: dict, config: Any, device: Any, source: Optional[fx.Graph] = None
    ) -> FuseResult:
        """Fuse ``graph`` in place (see :func:`~streamsched.passes.fusion.fuse.fuse_graph`)
        under ``config``'s ``fuse_params``, ``grad_handoff`` and ``fuse_min_size``.
        ``source``: the traced graph ``graph`` is a copy of; the size-independent halves
        of the fusion signatures are kept for it, for its plans at other input sizes."""
        self.alias = config.fuse_params == "alias"
        self.direct_grads = config.grad_handoff == "direct"
        statics = None
        if source is not None:
            statics = self._statics.get(source)
            if statics is None:
                statics = self._statics[source] = StaticSignatures()
        result = fuse_graph(graph, root, metas, self, device, config.fuse_min_size, statics)
        names: set[str] = set()
        read: set[int] = set()  # signatures whose names are in (alike members share one)
        for m in result.modules:
            # The proposal read each module's configuration just before its kernel was built.
            known = result.structures.get(id(m))
            signature = known[1] if known is not None and known[0] is m else structure_signature(m)
            self._fused[id(m)] = (m, signature)
            if id(signature) not in read:
                read.add(id(signature))
                names |= plain_attribute_names(m, signature)
        # Assigning one of these attributes moves the generation, so the wrapper asks
        # fused_unchanged() before its next call.
        _generation.watch(names)
        self._assignments = _generation.assignments()
        if statics is not None:
            statics.seal()
        return result

    def fused_unchanged(self) -> bool:
        """Whether every module a kernel replaced still has the configuration the kernel
        baked in (``conv.padding = 0``, ``act.scale = 3`` after planning: no)."""
        if _generation.assignments() == self._assignments:
            return True  # no watched attribute assigned since the last look (a mode switch, a re-registration)
        if all(structure_signature(m) == sig for m, sig in self._fused.values()):
            self._assignments = _generation.assignments()
            return True
        return False

    def check_all(self, full: bool = False) -> None:
        for stack in self._stacks.values():
            stack.check(full)

    def check_buffers(self) -> None:
        """:meth:`check_all` (full) of the stacks of buffers only: buffers were given
        other tensors, no parameter was."""
        for stack in self._stacks.values():
            module, name = stack.owners[0]
            if name in module._buffers:
                stack.check(True)

    def _retire_params(self, keys: set) -> None:
        """Members of a released stack are stacked into another group: the stacked
        parameter an optimizer may hold over the old group no longer reaches them."""
        for old in keys:
            param = self._params.pop(old, None)
            if param is not None and param.active:
                log.warning(
                    "fusion: the fused group of %s... was re-planned with other members; optimizers built from "
                    "fused_parameters() no longer update it (call fused_parameters() again)",
                    param._stack.names[0],
                )
                param._deactivate()

    def invalidate(self) -> None:
        self._released = {a: e for a, e in self._released.items() if not e[1].expired()}
        for key, stack in self._stacks.items():
            if stack.alias and stack.stack is not None:
                storage = stack.stack.untyped_storage()
                self._released[storage.data_ptr()] = (key, StorageWeakRef(storage))
            stack.retire()
        self._stacks.clear()
        self._claimed.clear()
        self._fused.clear()
        self._statics.clear()


def _shared_param(stack: StackedTensors) -> Optional[StackedParameter]:
    """The active stacked parameter another wrapper of the model bound to the stack
    ``stack`` shares (one parameter per stack: two would each claim the members' ``.grad``)."""
    assert stack.stack is not None
    for other in stacks_holding(stack.stack) or ():
        if other is not stack and other.param is not None and other.param.active:
            return other.param
    return None


def _bound_elsewhere(param: StackedParameter) -> bool:
    """Whether a live stack (of another wrapper) still has ``param`` bound."""
    for other in stacks_holding(param) or ():
        if other.param is param:
            return True
    return False


def _qualified(names: dict[int, str], module: nn.Module, attr: str) -> str:
    prefix = names.get(id(module), "")
    return f"{prefix}.{attr}" if prefix else attr
