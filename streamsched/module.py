"""``StreamScheduledModule``: wrap a model, get the same results with its independent
parts run side by side (and its identical parts batched).

The wrapper *shares* the wrapped model's submodules, parameters and buffers (the very
same dicts), so ``state_dict()`` keys, ``named_parameters()`` and optimizers see exactly
what they would see on the model itself; ``.module`` is the model, which stays the owner
of every parameter.

Per input signature (tensor shapes, dtypes, devices; the values of non-tensor
arguments; train/eval; grad mode; autocast) the first call runs the traced graph node by
node (that is the call's result) while recording shapes, then fuses, plans and compiles a
schedule (``new_signatures.py``); later calls with that signature run the compiled schedule
directly (``runner.py``). Plans live in a bounded LRU cache (``state.py``). This module is
the ``nn.Module`` face: construction, plumbing, the public API and each call's own path.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from typing_extensions import Unpack

from . import _generation
from .config import SchedulerConfig, SchedulerOptions, make_config
from .hot_plans import MISS
from .optim import fused_parameters
from .passes.fusion import FusionContext
from .planning.plan import Plan
from .runner import Runner
from .runtime.synclog import SyncLog
from .state import AttachedForward, WrapperState, check_wrappable

__all__ = ["StreamScheduledModule"]

_module_call = nn.Module.__call__
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state


_MISSING = object()


def _data_of(t: torch.Tensor) -> tuple:
    """Where ``t``'s data is and its version counter (None for what it lacks: a tensor
    without storage, an inference tensor without a version counter)."""
    try:
        where = t.data_ptr()
    except RuntimeError:
        where = None
    try:
        version = t._version
    except RuntimeError:
        version = None
    return where, version


class StreamScheduledModule(nn.Module):
    """Run ``model`` with its independent branches on separate streams and its identical
    branches batched, with outputs and gradients equal to ``model``'s own.

    Args:
        model: the ``nn.Module`` to run. It stays the owner of its parameters.
        config: a :class:`~streamsched.SchedulerConfig`; defaults suit most models.
        **overrides: individual config fields (``num_streams=4``, ``executor="streams"``),
            applied on top of ``config``.

    Example::

        >>> import torch, streamsched as ss
        >>> from torch import nn
        >>> class Heads(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(4))
        ...     def forward(self, x):
        ...         return torch.cat([h(x) for h in self.heads], dim=1)
        >>> model = Heads()
        >>> sm = ss.StreamScheduledModule(model)
        >>> x = torch.randn(3, 8)
        >>> torch.allclose(sm(x), model(x), atol=1e-6)
        True
        >>> sm.plan.fused_groups[0].size
        4
    """

    def __init__(
        self, model: nn.Module, config: Optional[SchedulerConfig] = None, **overrides: Unpack[SchedulerOptions]
    ):
        check_wrappable(model, StreamScheduledModule)
        name = type(model).__name__
        cfg = make_config(config, overrides, owner=name)
        super().__init__()
        # Share the model's own dicts: same parameters, same names, same state_dict keys.
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["module"] = model
        # Re-wiring the model (or the wrapper, which holds the same dicts) moves the
        # generation the wrapper checks on every call; other modules' registrations do not.
        _generation.track(model)
        _generation.track(self)
        self.__dict__["config"] = cfg
        st = self.__dict__["_ss"] = WrapperState(model, cfg)
        self.__dict__["_runner"] = Runner(model, cfg, st, StreamScheduledModule)
        st.fusion = FusionContext(model)

    # --- nn.Module plumbing ---------------------------------------------------------

    # The wrapper's mode is the model's: ``model.train()`` called on the model itself shows
    # in ``sm.training`` too. (nn.Module.__init__ sets it before the model is there.)
    @property
    def training(self) -> bool:  # type: ignore[override]
        model = self.__dict__.get("module")
        return model.training if model is not None else self.__dict__.get("_training_before_model", True)

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("module")
        if model is None:
            self.__dict__["_training_before_model"] = mode
        else:
            model.training = mode

    def train(self, mode: bool = True) -> StreamScheduledModule:
        self.module.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("module")
            if model is None or name.startswith("__"):
                raise
            value = getattr(model, name, _MISSING)
            if value is _MISSING:
                raise
        # A plain value of the model (HF's main_input_name, timm's num_classes; not
        # ``config``, which is the wrapper's own SchedulerConfig):
        # read through, so the wrapper stands in for a submodule whose parent reads them
        # (T5's generate reads encoder.main_input_name). A method (forward_features,
        # generate) is not: called on the model it would run unscheduled, so say where it
        # is and how its calls of the model are scheduled.
        if not callable(value):
            return value
        raise AttributeError(
            f"'StreamScheduledModule' object has no attribute {name!r}: it is a method of the "
            f"wrapped {type(model).__name__}; call sm.module.{name}(...) (it runs as written), or, "
            f"for a method that calls the model itself (as generate does), sm.attach().{name}(...) "
            "to run those calls through the schedule"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> StreamScheduledModule:
        # Conversions (.to, .half, .cuda) replace parameter storage: plans and stacked
        # parameters built from the old tensors must go. A conversion that changed nothing
        # (``sm.to(device)`` on every step of a model already there: ``fn`` returned each
        # tensor itself, its data where it was and not written) keeps them: dropping them
        # sent every such call back to tracing and planning, or to the model as written
        # for good.
        changed = False

        def watched(t: torch.Tensor) -> Any:
            nonlocal changed
            before = _data_of(t)
            out = fn(t)
            if out is not t or _data_of(out) != before:
                changed = True
            return out

        try:
            self.module._apply(watched, recurse)
        finally:
            if changed:  # (also where the conversion raised part way)
                self.invalidate()
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            self.invalidate()
        return result

    def extra_repr(self) -> str:
        changed = {k: getattr(self.config, k) for k in sorted(self.config.model_fields_set)}
        opts = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        return f"model={type(self.module).__name__}" + (f", {opts}" if opts else "")

    def __getstate__(self) -> dict:
        return {"module": self.module, "config": self.config}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["module"], state["config"])

    def __deepcopy__(self, memo: dict) -> StreamScheduledModule:
        return StreamScheduledModule(copy.deepcopy(self.module, memo), self.config)

    # --- public API -------------------------------------------------------------------

    @property
    def plan(self) -> Optional[Plan]:
        """The plan of the most recent call (``None`` before the first call)."""
        st = self._ss
        last = st.last
        if last is None:
            return None
        plan = last.plan
        nested = st.nested
        if plan.nested_leaf_calls and nested is not None and (plan.mode != "traced" or plan.executor != "eager"):
            # Nested children ran (their calls were counted as the parent's own, as
            # written): the share their plans schedule.
            plan = plan.model_copy(update={"nested_in_tasks": nested.scheduled_calls(plan.nested_leaf_calls)})
        if nested is not None and nested.trial is not None and nested.trial.reason and getattr(last, "nests", False):
            # What the measurement of nesting against the forward as written found.
            plan = plan.model_copy(update={"notes": [*plan.notes, nested.trial.reason]})
        return plan

    @property
    def plans(self) -> list[Plan]:
        """Every cached plan, least recently used first."""
        return [s.plan for s in self._ss.plans.values()]

    @property
    def nested_plans(self) -> dict[str, Plan]:
        """Where the model's forward cannot be traced and runs as written, the plan of
        each child module scheduled on its own (and of theirs), by module path: the most
        recent call's. Empty for a traced model (its plan covers every submodule)::

            >>> sm(x)                                   # doctest: +SKIP
            >>> sm.plan.mode, list(sm.nested_plans)     # doctest: +SKIP
            ('eager-dispatch', ['model.layers.0', 'model.layers.1'])
        """
        nested = self._ss.nested
        return nested.plans() if nested is not None else {}

    @property
    def last_sync_log(self) -> Optional[SyncLog]:
        """The synchronisation log of the last call (with ``sync_log=True``)."""
        return self._ss.last_sync_log

    @contextlib.contextmanager
    def observing(self, observer: Any) -> Iterator[Any]:
        """Call ``observer.push(task, stream)`` and ``observer.pop(task, stream)`` around
        every task of the calls made inside the block (on the task's lane or stream), and,
        if the observer has one, ``observer.ran(schedule)`` with what the most recent call
        ran on entering the block and after each call in it (``schedule.plan``; for a
        traced model also ``.program`` and ``.tasks``).

        Timelines and profiles use this; the first call with a new input signature runs
        unscheduled (it records shapes), so warm up before observing.
        """
        st = self._ss
        ran = getattr(observer, "ran", None)
        if ran is not None and st.last is not None:
            ran(st.last)  # what the most recent call ran, before any observed call
        previous = st.observer
        st.observer = observer
        st.hot = None  # observed calls run schedules: no as-written shortcut
        st.unsettle()
        try:
            yield observer
        finally:
            st.observer = previous
            st.hot = None

    def attach(self) -> nn.Module:
        """Route the model's own calls through the wrapper, and return the model.

        After ``sm.attach()``, ``model(x)`` and every method of the model that calls
        ``self(...)`` or ``self.forward(...)`` run their forwards through the wrapper:
        the one line a Hugging Face user needs for ``generate``::

            >>> sm = ss.StreamScheduledModule(model)        # doctest: +SKIP
            >>> sm.attach().generate(ids, max_new_tokens=20)  # doctest: +SKIP

        The model's own hooks fire around each call as in eager. The model gets an
        instance attribute ``forward`` (its class is unchanged); :meth:`detach` removes
        it, and :meth:`detached` removes it for a block. An attached model cannot be
        pickled or deep-copied (detach it first): the copy would call this wrapper.
        """
        return AttachedForward.attach(self.module, self)

    def detach(self) -> nn.Module:
        """Undo :meth:`attach`: the model's calls run its class's forward again."""
        return AttachedForward.detach(self.module, self)

    @contextlib.contextmanager
    def detached(self) -> Iterator[nn.Module]:
        """A block in which an attached model runs as written (for comparing with eager)."""
        attached = AttachedForward.attached(self.module)
        self.detach()
        try:
            yield self.module
        finally:
            if attached:
                self.attach()

    def fused_parameters(self, param_groups: Any = None) -> list:
        """The model's parameters for an optimizer that steps each fused group as one
        stacked tensor: ``torch.optim.SGD(sm.fused_parameters(), lr=...)``. Call the model
        once first (fusion is planned on the first call). See
        :func:`streamsched.optim.fused_parameters`."""
        return fused_parameters(self, param_groups)

    def invalidate(self) -> None:
        """Drop every cached trace, plan and stacked parameter; the next call re-plans."""
        st = self._ss
        with st.lock:
            st.clear(self.module)
            st.state_written = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ with no hook of the wrapper's own, none global, no jit trace
        # and no compiled call only calls forward: the wrapper goes straight to its entry.
        # Anything else takes nn.Module's own __call__, which fires the hooks around it.
        # (The global hooks are read here, not through frontend.hooks.global_hooks, and the
        # settled call is WrapperState.find_settled and Runner.settled written out: a
        # settled call's whole budget is the microsecond nn.Module.__call__ costs eager,
        # and each frame is a tenth of it.)
        if (
            not _is_compiling()
            and self._compiled_call_impl is None
            and not (
                self._forward_hooks
                or self._forward_pre_hooks
                or self._backward_hooks
                or self._backward_pre_hooks
                or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks
            )
            and self._plain_forward
            and "forward" not in self.__dict__
            and not _tracing_state()
        ):
            st = self._ss
            generation = _generation._generation
            hot = st.hot_plans
            if hot is not None and hot.generation == generation:
                # A signature whose plan runs as one function (hot_plans.py).
                found = hot.admits(args, kwargs, hot.sizes)
                if found:
                    out = self._runner.hot(found, args)
                    if out is not MISS:
                        return out
            settled = st.settled
            found = None
            if settled is not None and settled.generation == generation:
                found = settled.admits(args, kwargs, settled.sizes)
            if not found and st.settled_more:
                # Another settled layout (autocast or the grad mode switched around each call).
                settled, found = st.other_settled(args, kwargs, generation)
            if found:
                settled.left -= 1
                if settled.left <= 0:
                    st.settled = None  # the nested children's retry is due next call
                st.calls += 1
                nested = settled.nested
                if nested is not None:
                    nested.calls += 1  # counted as NestedPlans.all_quiet counts a call
                st.last = settled.reported if found is True else found
                st.last_path = "as-written"
                module = self.module
                try:
                    out = type(module).forward(module, *args, **kwargs)
                except Exception as exc:
                    self._runner.annotate(exc)
                    raise
                if _generation._generation != generation:
                    st.follow_own_writes(generation)  # the forward assigned what it reads
                return out
            if (
                st.churned_until > st.calls
                and st.observer is None
                and self._runner.may_vary
                and "forward" not in self.module.__dict__  # (Runner.own_forward; attached: the entry)
            ):
                # The state the traces read changes call after call (Runner.retrace): the
                # forward as written, as Runner.churned runs it, where the model holds no
                # hook of its own (that call runs through the model's __call__).
                module = self.module
                if not (
                    module._forward_hooks
                    or module._forward_pre_hooks
                    or module._backward_hooks
                    or module._backward_pre_hooks
                ):
                    st.calls += 1
                    st.last = st.churned
                    st.last_path = "as-written"
                    try:
                        return type(module).forward(module, *args, **kwargs)
                    except Exception as exc:
                        self._runner.annotate(exc)
                        raise
            return self._entry(args, kwargs, False)
        return _module_call(self, *args, **kwargs)

    # Whether this class's forward is the wrapper's own (a subclass may override it; then
    # every call goes through nn.Module.__call__, which calls that forward).
    _plain_forward = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._plain_forward = cls.forward is StreamScheduledModule.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._entry_uncompiled(args, kwargs)
        return self._entry(args, kwargs, False)

    # The schedule is plain Python over generated code; dynamo tracing it only finds graph
    # breaks (and replays the fused-parameter re-pointing as an in-place op). To compile,
    # compile the branches: a torch.compile'd submodule runs as one opaque task. (Only
    # this path is excluded from dynamo: the exclusion wrapper costs microseconds on every
    # call, and ``forward`` reaches here only while dynamo traces it.)
    @torch.compiler.disable
    def _entry_uncompiled(self, args: tuple, kwargs: dict) -> Any:
        return self._entry(args, kwargs, False)

    def _entry(self, args: tuple, kwargs: dict, inside_model_call: bool) -> Any:
        st = self._ss
        if inside_model_call:
            settled, found = st.find_settled(args, kwargs)
            if found:
                return self._runner.settled(settled, found, args, kwargs)
        with st.lock:
            try:
                if st.observer is None:
                    return self._runner.call(args, kwargs, inside_model_call)
                out = self._runner.call(args, kwargs, inside_model_call)
            except Exception as exc:
                self._runner.annotate(exc)  # the submodule, unless a plan named its node
                raise
            # Observers that ask are told which schedule the call ran (timelines read its
            # program and task graph): the wrapper hands it over, nobody reaches in.
            ran = getattr(st.observer, "ran", None)
            if ran is not None:
                ran(st.last)
            return out

    def _revalidate(self) -> None:
        """Some module somewhere was re-wired, switched mode or had a flag set: drop the
        caches that no longer hold (``new_signatures.revalidate``)."""
        self._runner.revalidate()
