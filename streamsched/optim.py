"""Standard ``torch.optim`` optimizers over fused groups as stacked tensors.

A fused group of N identical members (1000 MLPs in an ``nn.ModuleList``) already keeps
its N weights in one stacked tensor that the batched kernel reads. An optimizer built
over the members still steps N separate parameters; one built over
:func:`fused_parameters` steps one :class:`~streamsched.passes.fusion.StackedParameter` per
group, which *is* that stacked storage, so a step over 1000 members is a handful of
tensor ops::

    import torch, streamsched as ss
    from streamsched import optim as sso

    sm = ss.StreamScheduledModule(model)
    sm(example)                                              # plans (and fuses) once
    opt = torch.optim.AdamW(sm.fused_parameters(), lr=1e-3)  # stacked tensors + the rest
    for x, y in loader:
        opt.zero_grad()
        loss_fn(sm(x), y).backward()                        # stacked gradients
        sso.clip_grad_norm_per_member_(model.members, 1.0)  # optional
        opt.step()

The members stay the model's parameters: ``state_dict()`` keys and values,
checkpoints, ``load_state_dict()``, reading a member's weight or ``.grad`` (a view of the
stacked gradient) work as before. :func:`stack_state` and :func:`unstack_state` carry an
optimizer's state (and options) between the two layouts; :func:`member_parameters`
switches the model back to per-member gradients. See ``docs/training.md``.

What a stacked step cannot express is refused (:class:`StackedLayoutError`): members of
one group with different options (a per-member ``lr`` through parameter groups),
partly frozen groups, state held by some members only.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from .errors import TraceError
from .passes.fusion.stacked import StackedLayoutError, StackedParameter, layout_version, stacked_owner

__all__ = [
    "StackedLayoutError",
    "StackedParameter",
    "fused_parameters",
    "member_parameters",
    "stack_state",
    "unstack_state",
    "clip_grad_norm_per_member_",
]

ParamGroups = Union[Iterable[torch.Tensor], Iterable[dict]]

# Optimizer state entries that are one value per parameter (a step count, ASGD's eta and
# mu), never one per element, even for a 0-dim parameter.
_SCALAR_STATE = frozenset({"step", "eta", "mu"})


# --- parameters ---------------------------------------------------------------------------


def fused_parameters(sm: Any, param_groups: Optional[ParamGroups] = None) -> Union[list[torch.Tensor], list[dict]]:
    """The parameters of ``sm``'s model for an optimizer that steps each fused group as
    one stacked tensor (same as ``sm.fused_parameters(param_groups)``).

    Returns every parameter once, in ``model.parameters()`` order, with the members of
    each fused group replaced by the group's :class:`StackedParameter` (at its first
    member's place); parameters outside fused groups, and groups that could not alias
    their members' storage (tied weights, ``fuse_params="copy"``), are passed through as
    themselves. From this call on the fused kernels read the stacked parameters, whose
    ``.grad`` receives the stacked gradient (see :mod:`streamsched.passes.fusion.stacked`).
    Calling it again returns the same objects.

    With ``param_groups`` (what you would give the optimizer: an iterable of parameters
    or of ``{"params": ..., **options}`` dicts), returns the same groups with members
    replaced by their stacked parameter. All members of a fused group must share their
    options (``lr``, ``weight_decay``, ...): a stacked step applies one value to the whole
    group, so members with different options raise :class:`StackedLayoutError`, as does a
    group some of whose members are in no parameter group.

    Fusion is planned on the first call with an input, so call the model once before, in
    ``train()`` or with gradients (in inference, ``eval()`` without gradients, a call
    structure's first call runs as written and its plan is made when the same sizes come
    back: ``planning.signatures.FIRST_CALL_AS_WRITTEN``)
    (a :class:`RuntimeError` says so otherwise; also after ``invalidate()`` or ``.to()``,
    which drop the plans). A model that could not be traced (``strict=False``) has
    nothing fused: its parameters are returned as they are. Parameters fused only by a plan made
    later (a new input signature that fuses differently) keep per-member gradients until
    ``fused_parameters()`` is called again.
    """
    st = sm._ss
    if st.fusion is not None and not st.plans and any(isinstance(t, TraceError) for t in st.traces.values()):
        # Called, but the model could not be traced (it runs its own forward): nothing fused.
        flat = list(sm.module.parameters())
        return flat if param_groups is None else _regroup(flat, param_groups)
    if st.fusion is None or not st.plans:
        raise RuntimeError(
            f"fused_parameters(): {type(sm.module).__name__} has no plan yet; fusion is planned on the first call "
            "with an input, so call the wrapped model once (for example on one batch, under torch.no_grad()) "
            "before building the optimizer (in train(), or with gradients: a model in eval() called without "
            "them runs its first call as written, and is planned when a call of the same sizes comes back)"
        )
    with st.lock:
        flat = st.fusion.stacked_parameters()
    if param_groups is None:
        return flat
    return _regroup(flat, param_groups)


def member_parameters(sm: Any) -> list[nn.Parameter]:
    """Switch ``sm`` back to per-member gradients and return ``model.parameters()``.

    The fused kernels read the members again; each member keeps its ``.grad`` (a view of
    the stacked gradient, with its values), so a per-member optimizer built now (with
    :func:`unstack_state` to carry the state over) continues where the stacked one left
    off. The stacked parameters stay valid objects: ``fused_parameters()`` turns them on
    again.
    """
    st = sm._ss
    if st.fusion is not None:
        with st.lock:
            st.fusion.member_parameters()
    return list(sm.module.parameters())


def _regroup(flat: list[torch.Tensor], param_groups: ParamGroups) -> list[dict]:
    holder: dict[int, StackedParameter] = {}
    for t in flat:
        if isinstance(t, StackedParameter):
            for m in t._stack.members:
                holder[id(m)] = t
    groups = list(param_groups)
    if not groups or not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    placed: dict[int, tuple[int, dict, str]] = {}
    seen: dict[int, set[int]] = {}
    out: list[dict] = []
    for gi, group in enumerate(groups):
        if not isinstance(group, dict):
            raise TypeError("param_groups: give parameters, or dicts with a 'params' entry, not a mix of both")
        options = {k: v for k, v in group.items() if k != "params"}
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        new: list[torch.Tensor] = []
        for p in params:
            s = holder.get(id(p))
            if s is None:
                new.append(p)
                continue
            name = s._stack.names[s._stack.index[id(p)]]
            seen.setdefault(id(s), set()).add(id(p))
            first = placed.get(id(s))
            if first is None:
                placed[id(s)] = (gi, options, name)
                new.append(s)
            elif first[0] != gi:
                _check_same_options(first[1], options, first[2], name, s)
        out.append({**options, "params": new})
    for sid, members in seen.items():
        s = next(t for t in flat if id(t) == sid)
        if len(members) != len(s._stack.members):
            missing = next(n for m, n in zip(s._stack.members, s._stack.names) if id(m) not in members)
            raise StackedLayoutError(
                f"{missing} is in no parameter group, but other members of its fused group are ({len(members)} of "
                f"{len(s._stack.members)}); a stacked tensor is updated as a whole. Put every member of the group in "
                "the parameter groups, or keep per-member parameters (model.parameters())"
            )
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - uncomparable values are different
        return a is b


def _option_difference(a: dict, b: dict) -> Optional[str]:
    for key in sorted(set(a) | set(b), key=str):
        if key in ("params", "initial_lr"):
            continue
        if key not in a or key not in b or not _same(a[key], b[key]):
            return key
    return None


def _check_same_options(a: dict, b: dict, name_a: str, name_b: str, s: StackedParameter) -> None:
    key = _option_difference(a, b)
    if key is None:
        return
    raise StackedLayoutError(
        f"{name_a} ({key}={a.get(key, '<default>')!r}) and {name_b} ({key}={b.get(key, '<default>')!r}) are members "
        f"of one fused group ({len(s._stack.members)} members, held as one stacked tensor); a stacked optimizer step "
        f"applies one {key} to all of them and will not average it. Give every member of the group the same "
        "options, or build this optimizer over per-member parameters (model.parameters())"
    )


# --- optimizer state ----------------------------------------------------------------------


def _is_per_element(key: Any, value: torch.Tensor, shape: torch.Size) -> bool:
    return key not in _SCALAR_STATE and value.shape == shape


def _group_index(opt: torch.optim.Optimizer) -> dict[int, int]:
    return {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}


def _copy_value(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _stack_states(s: StackedParameter, states: list[dict]) -> Optional[dict]:
    link = s._stack
    held = [bool(st) for st in states]
    if not any(held):
        return None
    if not all(held):
        raise StackedLayoutError(
            f"stack_state: {link.names[held.index(False)]} has no optimizer state but {link.names[held.index(True)]} "
            "(a member of the same fused group) has; a stacked tensor holds one state for the whole group. Take a "
            "step in which every member has a gradient first"
        )
    keys = list(states[0])
    out: dict = {}
    for i, st in enumerate(states):
        if set(st) != set(keys):
            raise StackedLayoutError(
                f"stack_state: {link.names[i]} has optimizer state {sorted(map(str, st))} but {link.names[0]} has "
                f"{sorted(map(str, keys))}"
            )
    for key in keys:
        values = [st[key] for st in states]
        v0 = values[0]
        if isinstance(v0, torch.Tensor) and all(
            isinstance(v, torch.Tensor) and _is_per_element(key, v, m.shape) for v, m in zip(values, link.members)
        ):
            with torch.no_grad():
                parts = [v.detach() for v in values]
                out[key] = torch.cat(parts, 0) if link.sizes is not None else torch.stack(parts, 0)
            continue
        for i, v in enumerate(values[1:], 1):
            if not _same(v0, v):
                raise StackedLayoutError(
                    f"stack_state: optimizer state {key!r} differs between members of one fused group "
                    f"({link.names[0]}: {v0!r}, {link.names[i]}: {v!r}); a stacked tensor has one {key!r} for the "
                    "whole group"
                )
        out[key] = _copy_value(v0)
    return out


def _unstack_state(s: StackedParameter, state: dict, i: int) -> dict:
    out: dict = {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor) and _is_per_element(key, v, s.shape):
            out[key] = s.member_slice(v.detach(), i).clone()
        else:
            out[key] = _copy_value(v)
    return out


def _set_options(
    target: torch.optim.Optimizer,
    source: torch.optim.Optimizer,
    sources_of: list[list[tuple[int, str]]],
) -> None:
    """Each target group takes the options of the source groups its parameters came from
    (which must agree)."""
    for tg, contributing in zip(target.param_groups, sources_of):
        if not contributing:
            continue
        gi0, name0 = contributing[0]
        options = source.param_groups[gi0]
        for gi, name in contributing[1:]:
            if gi == gi0:
                continue
            key = _option_difference(options, source.param_groups[gi])
            if key is not None:
                raise StackedLayoutError(
                    f"{name0} ({key}={options.get(key, '<default>')!r}) and {name} "
                    f"({key}={source.param_groups[gi].get(key, '<default>')!r}) end up in one parameter group of the "
                    f"target optimizer, which applies one {key} to both; give them the same options or put them in "
                    "groups of their own"
                )
        for key, value in options.items():
            if key != "params":
                tg[key] = copy.deepcopy(value)


def stack_state(source: torch.optim.Optimizer, target: torch.optim.Optimizer, hyperparameters: bool = True) -> None:
    """Give ``target`` (an optimizer over :func:`fused_parameters`) the state of
    ``source`` (the same kind of optimizer over per-member parameters).

    Each stacked parameter's state is its members' states stacked (``exp_avg``,
    ``momentum_buffer``, ...: ``state[S][key][i] == source.state[member_i][key]``); values
    that are one per parameter (``step``) must agree across the group's members, as must
    non-tensor values. Parameters passed through (not fused) keep their state, copied.
    With ``hyperparameters`` (the default) each target parameter group also takes the
    options (``lr``, ``betas``, ``weight_decay``...) of the source groups its members came
    from. Members of one group with different options or different step counts, or
    state held by some members only, raise :class:`StackedLayoutError`.

    ``target`` must be the same optimizer class as ``source``; afterwards
    ``target.state_dict()`` saves the stacked layout, and ``unstack_state`` converts back.
    """
    groups = _group_index(source)

    def stacked(t: torch.Tensor) -> Optional[tuple[list[tuple[int, str]], Optional[dict]]]:
        if not isinstance(t, StackedParameter):
            return None
        link = t._stack
        where = [groups.get(id(m)) for m in link.members]
        if all(g is None for g in where):
            return [], None
        if any(g is None for g in where):
            missing = link.names[where.index(None)]
            raise StackedLayoutError(
                f"stack_state: {missing} is not in the source optimizer but other members of its fused group "
                "are; a stacked tensor is stepped as a whole"
            )
        first: dict[int, int] = {}  # source group -> its first member here
        for i, g in enumerate(where):
            first.setdefault(g, i)
        g0 = where[0]
        for g, i in first.items():
            if g != g0:
                _check_same_options(source.param_groups[g0], source.param_groups[g], link.names[0], link.names[i], t)
        contributing = [(g, link.names[i]) for g, i in first.items()]
        return contributing, _stack_states(t, [source.state.get(m, {}) for m in link.members])

    _move_state(source, target, hyperparameters, groups, stacked)


def unstack_state(source: torch.optim.Optimizer, target: torch.optim.Optimizer, hyperparameters: bool = True) -> None:
    """Give ``target`` (an optimizer over per-member parameters, e.g.
    ``model.parameters()``) the state of ``source`` (one over :func:`fused_parameters`):
    member ``i`` of a stacked parameter ``S`` gets ``source.state[S][key][i]`` (a copy)
    for per-element entries and a copy of the rest (``step``). Parameters passed through
    keep their state. With ``hyperparameters`` each target group takes the options of the
    source groups its parameters came from (which must agree).

    Use :func:`member_parameters` to switch the model back to per-member gradients.
    """
    groups = _group_index(source)
    owner: dict[int, tuple[StackedParameter, int]] = {}
    for g in source.param_groups:
        for p in g["params"]:
            if isinstance(p, StackedParameter):
                for i, m in enumerate(p._stack.members):
                    owner[id(m)] = (p, i)

    def member(p: torch.Tensor) -> Optional[tuple[list[tuple[int, str]], Optional[dict]]]:
        hit = owner.get(id(p))
        if hit is None:
            return None
        s, i = hit
        st = source.state.get(s)
        return [(groups[id(s)], s._stack.names[i])], (_unstack_state(s, st, i) if st else None)

    _move_state(source, target, hyperparameters, groups, member)


def _move_state(
    source: torch.optim.Optimizer,
    target: torch.optim.Optimizer,
    hyperparameters: bool,
    groups: dict[int, int],
    convert: Callable[[torch.Tensor], Optional[tuple[list[tuple[int, str]], Optional[dict]]]],
) -> None:
    """Replace the state of ``target``'s parameters: ``convert(p)`` gives, for a parameter
    whose layout changes, the ``(source group, name)`` pairs it comes from and its new
    state (or None where it is not converted); any other parameter of ``source`` keeps a
    copy of its state. With ``hyperparameters`` each target group takes the options of
    the source groups its parameters came from."""
    sources_of: list[list[tuple[int, str]]] = []
    new_state: dict = {}
    for tg in target.param_groups:
        contributing: list[tuple[int, str]] = []
        for p in tg["params"]:
            converted = convert(p)
            if converted is not None:
                came_from, state = converted
                contributing.extend(came_from)
                if state is not None:
                    new_state[p] = state
            elif id(p) in groups:
                contributing.append((groups[id(p)], _name(p)))
                st = source.state.get(p)
                if st:
                    new_state[p] = {k: _copy_value(v) for k, v in st.items()}
        sources_of.append(contributing)
    if hyperparameters:
        _set_options(target, source, sources_of)
    for tg in target.param_groups:
        for p in tg["params"]:
            target.state.pop(p, None)
    target.state.update(new_state)


def _name(p: torch.Tensor) -> str:
    return f"parameter of shape {tuple(p.shape)}"


# --- gradient clipping --------------------------------------------------------------------


class _ClipPlan:
    """Where each listed member's gradients live: rows of stacked parameters, or loose
    parameters."""

    def __init__(self, members: Sequence[Any]):
        self.members = list(members)  # keeps the ids of the key alive
        self.version = layout_version()
        n = len(self.members)
        rows: OrderedDict[int, tuple[StackedParameter, list[int]]] = OrderedDict()
        self.loose: list[tuple[torch.Tensor, int]] = []
        for j, member in enumerate(self.members):
            params = member.parameters() if isinstance(member, nn.Module) else member
            if isinstance(params, torch.Tensor):
                params = [params]
            for p in params:
                hit = stacked_owner(p)
                if hit is None:
                    self.loose.append((p, j))
                    continue
                s, i = hit
                if id(s) not in rows:
                    rows[id(s)] = (s, [n] * s.shape[0])  # rows of unlisted members: slot n
                slots = rows[id(s)][1]
                if s._stack.sizes is None:
                    slots[i] = j
                else:
                    start = s._stack.starts[i]
                    slots[start : start + s._stack.sizes[i]] = [j] * s._stack.sizes[i]
        self.stacked = list(rows.values())
        self._slots: dict[tuple, torch.Tensor] = {}

    def valid(self) -> bool:
        return self.version == layout_version()

    def slots(self, k: int, device: torch.device) -> torch.Tensor:
        key = (k, device)
        t = self._slots.get(key)
        if t is None:
            t = self._slots[key] = torch.tensor(self.stacked[k][1], dtype=torch.long, device=device)
        return t


_CLIP_PLANS: OrderedDict[tuple, _ClipPlan] = OrderedDict()


def _clip_plan(members: Sequence[Any]) -> _ClipPlan:
    key = tuple(id(m) for m in members)
    plan = _CLIP_PLANS.get(key)
    if plan is None or not plan.valid() or any(a is not b for a, b in zip(plan.members, members)):
        plan = _ClipPlan(members)
        _CLIP_PLANS[key] = plan
        while len(_CLIP_PLANS) > 8:
            _CLIP_PLANS.popitem(last=False)
    else:
        _CLIP_PLANS.move_to_end(key)
    return plan


@torch.no_grad()
def clip_grad_norm_per_member_(
    members: Iterable[Union[nn.Module, Iterable[torch.Tensor]]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip each member's gradients to ``max_norm`` on its own, in either layout.

    ``members`` is the ensemble's members (``model.mlps``: modules, or iterables of
    parameters). Equal to ``torch.stack([torch.nn.utils.clip_grad_norm_(m.parameters(),
    max_norm, norm_type) for m in members])`` (which it returns: each member's total norm
    before clipping), but where the members' parameters are held by active stacked
    parameters (:func:`fused_parameters`) it works on the stacked gradients: a few tensor
    ops per stacked parameter instead of several per member parameter.

    ``torch.nn.utils.clip_grad_norm_(sm.fused_parameters(), max_norm)`` by contrast
    computes one global norm over everything it is given, which is the same as clipping
    over all members' parameters together (``model.parameters()``), not per member.
    """
    members = list(members)
    plan = _clip_plan(members)
    n = len(members)
    p = float(norm_type)
    inf = math.isinf(p)
    grads: list[tuple[int, torch.Tensor]] = []
    for k, (s, _) in enumerate(plan.stacked):
        if s._stack.active and s._stack.buf is not None:
            s._sync_leaf()
        if s.grad is not None:
            grads.append((k, s.grad))
    loose = [(g, j) for q, j in plan.loose if (g := q.grad) is not None]
    if not grads and not loose:
        return torch.zeros(n)
    device = grads[0][1].device if grads else loose[0][0].device
    dtype = torch.promote_types((grads[0][1] if grads else loose[0][0]).dtype, torch.float32)
    acc = torch.zeros(n + 1, dtype=dtype, device=device)
    for k, g in grads:
        slots = plan.slots(k, g.device)
        norms = torch.linalg.vector_norm(g.reshape(g.shape[0], -1), p, dim=1, dtype=dtype).to(device)
        if inf:
            acc.scatter_reduce_(0, slots.to(device), norms, "amax")
        else:
            acc.index_add_(0, slots.to(device), norms.pow(p))
    for g, j in loose:
        norm = torch.linalg.vector_norm(g, p, dtype=dtype).to(device)
        if inf:
            acc[j] = torch.maximum(acc[j], norm)
        else:
            acc[j] += norm.pow(p)
    total = acc[:n] if inf else acc[:n].pow(1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(total).all()):
        j = int((~torch.isfinite(total)).nonzero()[0])
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients of member {j} is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef_ext = torch.cat([coef, coef.new_ones(1)])
    for k, g in grads:
        scale = coef_ext[plan.slots(k, device)].to(g.device, g.dtype)
        g.mul_(scale.view((-1,) + (1,) * (g.dim() - 1)))
    for g, j in loose:
        g.mul_(coef[j].to(g.device, g.dtype))
    return total
