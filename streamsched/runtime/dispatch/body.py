"""Running a branch's body where its launch put it, with the checks every launch makes."""

from __future__ import annotations

import contextlib
import functools
import time
import typing
from typing import Any, Callable, Iterator, Optional

import torch

from ...frontend.leafcalls import branch_scope
from .calllog import _CallLog
from .dispatch_errors import EagerDispatchError
from .launch import _Launch, _TaskInfo
from .pending import resolve
from .values import _tensors, _version


@functools.lru_cache(maxsize=1024)
def _annotated_length(fn: Callable[..., Any]) -> Optional[int]:
    """The length a branch's return annotation promises (``-> tuple[Tensor, Tensor]``)."""
    try:
        returns = typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001 - an annotation we cannot evaluate promises nothing
        return None
    if typing.get_origin(returns) is not tuple:
        return None
    items = typing.get_args(returns)
    if not items or Ellipsis in items or items == ((),):
        return None
    return len(items)


class _BranchRunner:
    """Runs branch bodies for one call: resolves the producers' results, brackets the body
    for the observer, times it (``launch.cost_us``), checks what a launched branch must
    not do and logs the launch.

    Run inline, a branch may write to its arguments, as in eager. Launched (on a lane or
    a stream), it runs beside the code after its call, which may already have read them:
    a write is an :class:`EagerDispatchError`; so is a result that breaks the tuple length
    its annotation promised, as the caller may have unpacked it by that promise.
    """

    def __init__(self, model_name: str, observer: Any, log: _CallLog):
        self.model_name = model_name
        self.observer = observer
        self.log = log

    def run(self, launch: _Launch, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run the body on the current lane or stream; log its launch."""
        if launch.producers:
            args, kwargs = resolve(args), resolve(kwargs)
            launch.waits = sorted(p.id for p in launch.producers if p.kind != "inline" and p.stream != launch.stream)
        launched = launch.kind != "inline"
        versions = [(t, _version(t)) for t in _tensors((args, kwargs))] if launched else []
        start = time.perf_counter_ns()
        try:
            with self._observe(launch, launch.stream), branch_scope():
                result = fn(*args, **kwargs)
        finally:
            launch.cost_us = (time.perf_counter_ns() - start) / 1e3
        if launched:
            self._check_untouched(launch, versions)
            self._check_length(launch, result)
        if self.log.sync is not None:
            self.log.launched(launch, result)
        return result

    def _observe(self, launch: _Launch, stream: int) -> Any:
        observer = self.observer
        if observer is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def bracket() -> Iterator[None]:
            task = _TaskInfo(launch.id, launch.name, stream)
            observer.push(task, stream)
            try:
                yield
            finally:
                observer.pop(task, stream)

        return bracket()

    def _check_untouched(self, launch: _Launch, versions: list[tuple[torch.Tensor, Optional[int]]]) -> None:
        for i, (t, before) in enumerate(versions):
            if before is not None and t._version != before:
                raise EagerDispatchError(
                    f"streamsched eager dispatch: branch '{launch.name}' of {self.model_name} wrote in "
                    f"place to its tensor argument #{i} ({tuple(t.shape)}, {t.dtype}). A launched branch runs beside "
                    "the code after its call, which may already have read that tensor; write to a copy inside the "
                    "branch (x = x.clone()) or return the new value instead."
                )

    def _check_length(self, launch: _Launch, result: Any) -> None:
        n = launch.expected_len
        if n is not None and not (isinstance(result, tuple) and len(result) == n):
            got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
            raise EagerDispatchError(
                f"streamsched eager dispatch: branch '{launch.name}' of {self.model_name} is annotated "
                f"to return a tuple of {n} values but returned {got}; its result was unpacked by that promise"
            )
