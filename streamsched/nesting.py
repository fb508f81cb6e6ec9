"""Nested plans: the submodule calls of a forward that runs as written get plans of their own.

One untraceable spot in a forward (control flow on a tensor's value, ``len`` of an
argument, a library's mask builder) makes the whole forward run as written: eager
dispatch, which schedules only ``@streamsched.branch`` calls. Its submodules are often
traceable on their own: a decoder's layers, a detection model's backbone and heads. So,
while such a forward runs, each of its child modules that has something to schedule
(two or more leaf modules below it) is called through a wrapper of its own: a
:class:`~streamsched.StreamScheduledModule` of the child, with the parent's
configuration. The child's wrapper traces, plans and trials the child exactly as it
would if the user had wrapped it, and where the child cannot be traced either, its own
children are nested in turn, down to the leaves (``torch.compile``'s graph breaks, at
module granularity).

How a call reaches the child's wrapper: for the duration of the parent's forward, the
child gets an instance attribute ``forward`` (as :meth:`StreamScheduledModule.attach`
does for the root), so the child's own ``__call__`` (its hooks) runs as in eager and
its forward runs through the wrapper. The attribute is removed when the forward
returns or raises: outside the parent's calls the child is the user's module, unchanged.

The same holds for a forward run as written because an argument is an object (a KV
cache, torchvision's ``ImageList``): its children, passed tensors, are nested.

A child whose wrapper ran it as written for :data:`_QUIET_CALLS` calls in a row (a
decoding step's new sizes, a trial that found the child faster as written; a child run
as written for an object none of whose own children scheduled anything) stops being
nested: the wrapper's own per-call cost is then all it adds. Every :data:`_RETRY_EVERY`
calls of the parent the quiet children are tried again (the workload may have changed).

What a child's own trial cannot see, the cost of the wrappers above it that are called
through only because it is nested, the outermost wrapper measures on its whole calls
(nesting_trial.py): where nesting is not faster than the forward as written, every child
stops being nested until the retry.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from . import _generation
from .branch import runs_as_branch
from .frontend.hooks import has_hooks
from .frontend.trace import is_compiled_module
from .nesting_trial import NestingTrial

__all__ = ["NestedPlans"]

# A nested child run as written this many calls in a row stops being nested.
_QUIET_CALLS = 16
# Parent calls after which the children that stopped are nested again.
_RETRY_EVERY = 512
# After each verdict in a row of the trial of nesting that nesting does not pay, the
# retry comes twice as late (each costs calls nested for nothing), up to this many times.
_MAX_SPACING = 16
# More children than this to nest (an ensemble of a thousand small models behind an
# untraceable forward) and none is: each would pay its own trace, plan and trial, and
# siblings nested apart are never batched together (only the parent's trace could).
MAX_SITES = 128
# Paths whose call scheduled something (a plan, a CUDA graph, the recording call, eager
# dispatch of @branch calls): ``streamsched.testing.last_path``.
_SCHEDULED = ("plan:", "graph", "recorded", "eager-dispatch")


# The nested calls under way on this thread, outermost first: what the leaf-call count
# of a parent's call charges each call to (streamsched.frontend.leafcalls).
_calling = threading.local()


def _calls_under_way() -> list:
    stack = getattr(_calling, "sites", None)
    if stack is None:
        stack = _calling.sites = []
    return stack


def _leaf_count(module: nn.Module, limit: int) -> int:
    """Leaf modules below ``module`` (itself if it has no children), counting to ``limit``."""
    count = 0
    for m in module.modules():
        if not m._modules:
            count += 1
            if count >= limit:
                break
    return count


def _hooked(module: nn.Module) -> bool:
    """Whether a module in ``module``'s subtree has a hook: forward hooks of any kind
    (transformers' output-capture hooks, which a wrapper traces into the values it
    returns, would collect into the parent's call as eager does only if they run), and
    the other hooks ``has_hooks`` counts. Such a child runs as written, as before."""
    return any(m._forward_hooks or has_hooks(m) for m in module.modules())


def _is_container(module: nn.Module) -> bool:
    """A module with no forward of its own (``ModuleList``, ``ModuleDict``): its children
    are what the parent calls."""
    return type(module).forward is nn.Module.forward


def _settled_as_written(st: Any) -> bool:
    """Whether a child's wrapper has settled to run it as written at this signature: its
    trial decided for the model as written, or (a call passing an object) every child of
    its own stopped being nested. Unlike a new size run as written, the next calls with
    these arguments would run as written too."""
    last = st.last
    if getattr(last, "program", None) is not None:
        return bool(last.as_written) and last.trial is None
    inner = st.nested
    return bool(getattr(last, "nests", False)) and inner is not None and inner.all_inactive()


class _Site:
    """One child module of the parent's forward, nested while the parent runs."""

    __slots__ = ("module", "path", "wrapper", "forward", "quiet", "active", "owner", "hooked", "hooks_seen")

    def __init__(self, module: nn.Module, path: str, owner: NestedPlans):
        self.module = module
        self.path = path
        self.owner = owner
        self.wrapper: Any = None  # made on the child's first call
        self.forward = _NestedForward(self)
        self.quiet = 0
        self.active = True
        # Whether its subtree has hooks (_hooked), as of hook registration count hooks_seen.
        self.hooked = False
        self.hooks_seen = -1


class _NestedForward:
    """The ``forward`` a nested child has while its parent's forward runs."""

    __slots__ = ("site",)
    # A forward that enters a wrapper, not one of the user's (Runner.call, trace flags).
    enters_wrapper = True

    def __init__(self, site: _Site):
        self.site = site

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        site = self.site
        if _generation.hook_registrations() != site.owner.hooks_at_entry:
            # The parent's forward registered (or removed) module hooks while it runs
            # (transformers' output capturing does, around the call): what they see of
            # the children must be eager's, so for the rest of this call they run as
            # written. Not a quiet call: the next call may nest them again.
            return type(site.module).forward(site.module, *args, **kwargs)
        wrapper = site.wrapper
        if wrapper is None:
            wrapper = site.wrapper = site.owner.make(site.module)
        st = wrapper._ss
        inner_calls = st.nested.calls if st.nested is not None else 0
        under_way = _calls_under_way()
        under_way.append(site)
        try:
            out = wrapper._entry(args, kwargs, True)
        finally:
            under_way.pop()
        # Something scheduled: the child's own plan, or (its forward ran as written) one
        # of its nested children during this very call.
        inner = st.nested
        below = inner is not None and inner.calls != inner_calls and inner.scheduled
        scheduled = st.last_path.startswith(_SCHEDULED) or below
        # The call that settles the child (its trial's last call, which may have run a
        # schedule) hands it back at once too.
        settled = site.owner.hand_back and _settled_as_written(st)
        if scheduled:
            site.owner.scheduled = True
        if scheduled and not settled:
            site.quiet = 0
        else:
            site.quiet += 1
            if site.quiet >= _QUIET_CALLS or settled:
                site.active = False
        return out

    def __reduce__(self) -> Any:
        raise TypeError("a module nested in a StreamScheduledModule's call cannot be pickled while the call runs")


class NestedPlans:
    """The nested children of one wrapped model (module docstring).

    ``make(child)`` returns the wrapper a child's calls go through; ``is_wrapper(module)``
    tells a module that is a wrapper already (never nested again).
    """

    def __init__(
        self,
        model: nn.Module,
        make: Callable[[nn.Module], Any],
        is_wrapper: Callable[[nn.Module], bool],
        leaf_types: tuple = (),
    ):
        self.model = model
        self.make = make
        self.is_wrapper = is_wrapper
        self.leaf_types = leaf_types
        self._sites: Optional[list[_Site]] = None
        # Every site made, by module identity: children found again keep their wrappers.
        self._known: dict[int, _Site] = {}
        self.calls = 0
        # Module hook registrations when the current call began (_generation).
        self.hooks_at_entry = -1
        # Whether a nested child scheduled something during the current call.
        self.scheduled = False
        # Whether the current call hands settled children back at once (installed()).
        self.hand_back = False
        # The outermost wrapper's measurement of nesting against the forward as written
        # (nesting_trial.py); None in a nested child's wrapper, and under fixed executors.
        self.trial: Optional[NestingTrial] = None
        # The retry's period, in _RETRY_EVERY calls (stop_nesting doubles it).
        self.spacing = 1

    def sites(self) -> list[_Site]:
        """The children nested while the model's forward runs (found once per structure)."""
        if self._sites is None:
            self._sites = self._find_sites()
        return self._sites

    def sites_at(self, paths: list[str]) -> list[_Site]:
        """The sites of the modules at ``paths`` that have something to schedule: the opaque
        calls of a traced plan (a module whose forward fx could not go through runs as
        written inside its task)."""
        sites = []
        for path in paths:
            try:
                module = self.model.get_submodule(path)
            except AttributeError:
                continue
            if self._worth_nesting(module):
                sites.append(self._site(module, path))
        return sites if len(sites) <= MAX_SITES else []

    def _worth_nesting(self, module: nn.Module) -> bool:
        return not (
            self.is_wrapper(module)
            or runs_as_branch(module)  # eager dispatch launches its calls itself
            or is_compiled_module(module)
            or (self.leaf_types and isinstance(module, self.leaf_types))
            or _leaf_count(module, 2) < 2
        )

    def _site(self, module: nn.Module, path: str) -> _Site:
        site = self._known.get(id(module))
        if site is None or site.module is not module:
            site = self._known[id(module)] = _Site(module, path, self)
        return site

    def _find_sites(self) -> list[_Site]:
        sites: list[_Site] = []
        stack = [(name, child) for name, child in self.model.named_children()]
        stack.reverse()
        while stack:
            path, child = stack.pop()
            if isinstance(child, torch.jit.ScriptModule):
                continue  # TorchScript runs as written: nothing in it to trace or nest
            if _is_container(child):
                inner = [(f"{path}.{name}", grandchild) for name, grandchild in child.named_children()]
                stack.extend(reversed(inner))
                continue
            if self._worth_nesting(child):
                sites.append(self._site(child, path))
        return sites if len(sites) <= MAX_SITES else []

    def refresh(self) -> None:
        """The model was re-wired: find the children again (wrappers of children still in
        place are kept, and re-check their own plans)."""
        live = {id(m) for m in self.model.modules()}
        self._known = {k: s for k, s in self._known.items() if k in live}
        if self._sites is not None:
            self._sites = self._find_sites()
        self.spacing = 1
        if self.trial is not None:
            self.trial.restart()

    def invalidate(self) -> None:
        """Drop every nested child's plans (the parent's were dropped)."""
        for site in self._known.values():
            if site.wrapper is not None:
                site.wrapper.invalidate()
            site.quiet, site.active = 0, True
        self._sites = None
        self.spacing = 1
        if self.trial is not None:
            self.trial.restart()

    def stop_nesting(self) -> None:
        """Every child runs as written until the retry (the trial found nesting does not
        pay); the retry after this one comes twice as late, up to :data:`_MAX_SPACING`."""
        for site in self.sites():
            site.active = False
        self.spacing = min(self.spacing * 2, _MAX_SPACING)

    def nesting_pays(self) -> None:
        """The trial found nesting faster: retries come every :data:`_RETRY_EVERY` calls."""
        self.spacing = 1

    def _period(self) -> int:
        return _RETRY_EVERY * self.spacing

    def current_path(self) -> Optional[str]:
        """The path of this model's nested child being called on this thread, if any."""
        for site in _calls_under_way():
            if site.owner is self:
                return site.path
        return None

    def scheduled_calls(self, calls: dict[str, int]) -> int:
        """Of ``calls`` (leaf calls made inside each nested child, by path), how many ran
        as tasks of the children's most recent plans (theirs nested in turn included)."""
        total = 0.0
        sites = {s.path: s for s in self._known.values()}
        for path, n in calls.items():
            site = sites.get(path)
            if site is None or site.wrapper is None or not site.active:
                continue  # not nested (yet, or any more): the child runs as written
            plan = site.wrapper.plan
            if plan is not None:
                total += n * plan.coverage
        return round(total)

    def plans(self) -> dict[str, Any]:
        """The most recent plan of each nested child (and of theirs), by module path."""
        out: dict[str, Any] = {}
        for site in self._known.values():
            wrapper = site.wrapper
            if wrapper is None or wrapper.plan is None:
                continue
            out[site.path] = wrapper.plan
            inner = wrapper._ss.nested
            if inner is not None:
                out.update({f"{site.path}.{path}": plan for path, plan in inner.plans().items()})
        return out

    def all_inactive(self) -> bool:
        """Whether every child found stopped being nested (none found: also true)."""
        return self._sites is not None and not any(site.active for site in self._sites)

    def all_quiet(self) -> bool:
        """Whether the next call has nothing to nest: every child stopped being nested
        and no retry is due. Counted as a call; the caller runs the forward without
        :meth:`installed` (a call that passes an object: its per-call cost is all the
        wrapper adds once the children went quiet)."""
        sites = self.sites()
        if (self.calls + 1) % self._period() == 0:
            return False
        for site in sites:
            if site.active:
                return False
        self.calls += 1
        self.scheduled = False
        return True

    def quiet_calls_ahead(self) -> int:
        """After :meth:`all_quiet` said true: how many calls in a row may run without
        asking it again (each adding one to ``calls``, as it does), before a retry is due."""
        period = self._period()
        return period - 1 - self.calls % period

    @contextlib.contextmanager
    def installed(self, sites: Optional[list[_Site]] = None, hand_back: bool = False) -> Iterator[None]:
        """The block in which the model's forward (``sites``: a plan) runs: the calls of the
        nested modules (the forward's children by default) go through their wrappers.
        ``hand_back``: a child that has settled to run as written stops being nested at
        once (:func:`_settled_as_written`), not after :data:`_QUIET_CALLS` calls."""
        self.calls += 1
        self.scheduled = False
        self.hand_back = hand_back
        self.hooks_at_entry = _generation.hook_registrations()
        if sites is None:
            sites = self.sites()
        if self.calls % self._period() == 0:
            for site in sites:
                site.quiet, site.active = 0, True
            if self.trial is not None:
                self.trial.restart()  # measured again once the children settle
        placed: list[_Site] = []
        try:
            registrations = self.hooks_at_entry
            for site in sites:
                if not site.active:
                    continue
                if site.hooks_seen != registrations:
                    site.hooked, site.hooks_seen = _hooked(site.module), registrations
                if site.hooked:
                    continue
                attrs = site.module.__dict__
                if "forward" in attrs:
                    continue  # the user's own (or an attached wrapper's), or placed by an outer call
                attrs["forward"] = site.forward
                placed.append(site)
            yield
        finally:
            for site in placed:
                attrs = site.module.__dict__
                if attrs.get("forward") is site.forward:
                    del attrs["forward"]
