"""The user's options: a frozen, validated :class:`SchedulerConfig`.

The config is what the user asked for; what the library decided (streams, fused groups,
the executor it picked and why) lives in the :class:`~streamsched.planning.plan.Plan`, a separate
object. The config never changes after construction.

Example::

    >>> from streamsched import SchedulerConfig
    >>> cfg = SchedulerConfig(num_streams=4, executor="streams")
    >>> cfg.num_streams
    4
    >>> SchedulerConfig(nmu_streams=4)              # doctest: +ELLIPSIS
    Traceback (most recent call last):
    streamsched.config.ConfigValidationError: unknown option 'nmu_streams'; did you mean 'num_streams'? ...

A bad option raises :class:`~streamsched.errors.ConfigError` with one line per option
(never pydantic's per-union-member errors or documentation links); the error is also a
``pydantic.ValidationError``, for code that catches that.
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from typing_extensions import TypedDict

from .errors import ConfigError

__all__ = ["SchedulerConfig", "SchedulerOptions", "ConfigValidationError", "make_config"]

MAX_STREAMS = 32

ExecutorName = Literal["auto", "serial", "streams", "threads"]


class ConfigValidationError(ConfigError, ValidationError):
    """A :class:`~streamsched.errors.ConfigError` (a ``ValueError``) that is also the
    ``pydantic.ValidationError`` a pydantic model raises, so that code catching either
    works. Its message says, in one line per option, what is wrong and what is valid;
    ``errors()`` keeps pydantic's structured list."""

    def __str__(self) -> str:
        return getattr(self, "_message", None) or "invalid streamsched configuration"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    @classmethod
    def with_message(cls, message: str, errors: Optional[list] = None) -> ConfigValidationError:
        error = cls.from_exception_data("SchedulerConfig", [])
        error._message = message
        error._details = errors or []
        return error

    def errors(self, *args: Any, **kwargs: Any) -> list:  # type: ignore[override]
        return list(getattr(self, "_details", []))

    def error_count(self) -> int:
        return len(getattr(self, "_details", [])) or 1


def _describe(exc: ValidationError) -> str:
    """pydantic's errors as one clause per option: a union field fails once per member
    (``num_streams=100`` is neither ``'auto'`` nor an int up to 32), which pydantic lists
    as separate errors with documentation links; here they become one clause."""
    clauses: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    for error in exc.errors(include_url=False):
        message = str(error.get("msg", ""))
        for prefix in ("Value error, ", "Assertion failed, "):
            if message.startswith(prefix):
                message = message[len(prefix) :]
        if message.startswith("Input should"):
            message = "should" + message[len("Input should") :]
        if error.get("type") == "literal_error" and isinstance(error.get("input"), str):
            # A misspelt choice (executor='thread'): name the closest one.
            choices = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
            close = difflib.get_close_matches(error["input"], choices, n=1)
            if close and close[0] != error["input"]:
                message += f" (did you mean {close[0]!r}?)"
            if error["input"] == "eager" and (error.get("loc") or ("",))[0] == "executor":
                # plan.executor can read 'eager' (auto's trial chose the model's own forward),
                # so a reader of a plan may ask for it: say what it means and how to get it.
                message += (
                    " ('eager' is what executor='auto' reports when the model's own forward measured"
                    " faster; to run the model as written, call the model itself)"
                )
        loc = error.get("loc") or ()
        field = str(loc[0]) if loc else ""
        if field:
            values.setdefault(field, error.get("input"))
        found = clauses.setdefault(field, [])
        if message not in found:
            found.append(message)
    parts = []
    for field, messages in clauses.items():
        if "should be a valid number" in messages and "should be a valid integer" in messages:
            messages.remove("should be a valid integer")  # (a number includes the integers)
        value = values.get(field)
        if isinstance(value, str) and any(m.startswith("should be a valid") for m in messages):
            try:
                number = float(value) if "." in value or "e" in value.lower() else int(value)
            except ValueError:
                pass
            else:  # a number written as a string (from a command line or a config file)
                messages = [*messages[:-1], f"{messages[-1]}, not a string (pass {number!r}, not {value!r})"]
        if field:
            parts.append(f"{field}={values[field]!r}: {' or '.join(messages)}")
        else:
            parts.extend(messages)
    return "; ".join(parts) or str(exc)


class SchedulerOptions(TypedDict, total=False):
    """The keyword options of :class:`~streamsched.StreamScheduledModule` (the fields of
    :class:`SchedulerConfig`), typed for IDEs and type checkers."""

    num_streams: Union[Literal["auto"], int]
    executor: Literal["auto", "serial", "streams", "threads"]
    fuse: bool
    fuse_min_size: int
    fuse_params: Literal["alias", "copy"]
    grad_handoff: Literal["autograd", "direct"]
    cuda_graph: Union[bool, Literal["auto"]]
    clone_outputs: bool
    graph_cache_size: int
    nvtx: bool
    leaf_modules: Any
    strict: bool
    min_task_cost: float
    plan_cache_size: int
    sync_log: bool
    chaos: Optional[int]
    profile: Optional[Union[str, Path]]


class SchedulerConfig(BaseModel):
    """How :class:`~streamsched.StreamScheduledModule` traces, fuses, plans and runs a model.

    Every field has a default that suits most models; a misspelt option or a value out of
    range raises :class:`~streamsched.errors.ConfigError` (a ``ValueError``, and a
    ``pydantic.ValidationError``) naming the option, with the closest valid name for a
    misspelt one. The config is frozen: assigning a field raises the same error.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ConfigValidationError:
            raise
        except ValidationError as exc:
            raise ConfigValidationError.with_message(_describe(exc), exc.errors(include_url=False)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> SchedulerConfig:  # type: ignore[override]
        """As pydantic's, with this class's error messages for a mapping of options (pydantic
        would call ``__init__`` and report its error as "0 validation errors")."""
        if isinstance(obj, Mapping) and not args and not kwargs:
            return cls(**obj)
        return super().model_validate(obj, *args, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, *args: Any, **kwargs: Any) -> SchedulerConfig:  # type: ignore[override]
        """As pydantic's, with this class's error messages (see :meth:`model_validate`)."""
        if args or kwargs:
            return super().model_validate_json(json_data, *args, **kwargs)
        try:
            options = json.loads(json_data)
        except ValueError as exc:
            raise ConfigValidationError.with_message(f"SchedulerConfig JSON is not valid JSON: {exc}") from None
        if not isinstance(options, dict):
            raise ConfigValidationError.with_message(
                f"SchedulerConfig JSON must be an object of options, got {type(options).__name__}"
            )
        return cls(**options)

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigValidationError.with_message(
            f"SchedulerConfig is frozen: cannot set {name}; make a new one with the options you want "
            f"(SchedulerConfig(..., {name}=...), or StreamScheduledModule(model, {name}=...))"
        )

    num_streams: Union[Literal["auto"], Annotated[StrictInt, Field(ge=1, le=MAX_STREAMS)]] = "auto"
    """Upper bound on the CUDA streams (or CPU lanes) one forward may use. ``"auto"`` uses
    as many as the model's width needs, at most 8. The caller's current stream is stream 0."""

    executor: ExecutorName = "auto"
    """``"serial"`` runs tasks one after another (the reference); ``"streams"`` runs them on
    a pool of CUDA streams; ``"threads"`` on a pool of CPU threads. ``"auto"`` picks
    ``streams`` on CUDA and ``threads`` on CPU only where the plan says it pays, else
    ``serial``."""

    fuse: StrictBool = True
    """Batch structurally identical independent submodules into one kernel (horizontal
    fusion): an ``nn.ModuleList`` of N small MLPs becomes one batched matmul per layer."""

    fuse_min_size: Annotated[StrictInt, Field(ge=2)] = 2
    """Smallest group of identical branches worth fusing."""

    fuse_params: Literal["alias", "copy"] = "alias"
    """How fused members' parameters are read. ``"alias"`` (zero-copy) moves each
    member's parameter storage into one stacked tensor (the same ``Parameter`` objects,
    names and values; tensors taken with ``.data`` before the first call keep the old
    storage). ``"copy"`` leaves parameters alone and stacks them on every call: slower,
    for frameworks that manage parameter storage themselves (FSDP)."""

    grad_handoff: Literal["autograd", "direct"] = "autograd"
    """How a fused group's stacked gradient reaches its members' ``.grad``.
    ``"autograd"`` gives every member parameter its own autograd edge: exact for every
    way of asking for gradients, about 3 µs per member parameter per backward.
    ``"direct"`` writes all members' ``.grad`` in one native call (one ``add_`` when
    accumulating), several times cheaper for thousands of members, and is meant for
    ``loss.backward()`` training loops: of each fused group only the first trainable
    member stays in the autograd graph, so ``torch.autograd.grad`` or
    ``backward(inputs=...)`` naming it raises, and naming only other members does not
    reach them. Members with gradient hooks (``register_hook``, DDP) take the autograd
    path automatically; without the native extension ``"direct"`` acts as
    ``"autograd"``. Only ``fuse_params="alias"`` stacks are affected."""

    cuda_graph: Union[StrictBool, Literal["auto"]] = False
    """Capture the whole multi-stream schedule into one CUDA graph and replay it.
    ``"auto"`` captures where it can and falls back to plain streams (with one warning
    naming the reason) where it cannot."""

    clone_outputs: StrictBool = True
    """With ``cuda_graph``: return fresh tensors the caller owns. ``False`` returns the
    graph's static output buffers, which the next call overwrites."""

    graph_cache_size: Annotated[StrictInt, Field(ge=1, le=1024)] = 8
    """CUDA graphs kept per module, one per input signature (least recently used first out)."""

    nvtx: StrictBool = True
    """Mark each task with an NVTX range (``<module path> [s<k>]``, domain ``streamsched``)
    so Nsight Systems shows the schedule. Costs nothing measurable when no profiler is
    attached; ``NVTX_DISABLE=1`` turns it off everywhere."""

    leaf_modules: tuple[Any, ...] = ()
    """Module types and functions to treat as opaque tasks instead of tracing through them
    (in addition to ``torch.nn`` built-ins, classes decorated with ``@streamsched.branch``
    and the modules and functions a library registers as untraceable, such as timm's).
    A function named here runs as one task wherever a module's ``forward`` calls it by a
    global name, so library code the user cannot decorate can still be made opaque."""

    strict: StrictBool = False
    """What happens when the model's own ``forward`` cannot be traced (a submodule that
    cannot be traced never matters: it becomes an opaque task by itself). ``False`` (the
    default): the model runs its own ``forward`` with its ``@streamsched.branch`` calls
    scheduled (eager dispatch), and one warning says where tracing failed and how to fix
    it. ``True``: that error is raised instead."""

    min_task_cost: Annotated[Union[StrictFloat, StrictInt], Field(ge=0)] = 10.0
    """Estimated cost (microseconds) under which a branch is not worth its own stream: it
    stays on its neighbour's stream rather than paying for an event."""

    plan_cache_size: Annotated[StrictInt, Field(ge=1, le=4096)] = 16
    """Plans kept per module, one per input signature (shapes, dtypes, devices, mode)."""

    sync_log: StrictBool = False
    """Record every synchronisation action (launch, record, wait, record_stream) of each
    call in ``module.last_sync_log``, for :func:`streamsched.testing.check_happens_before`."""

    chaos: Optional[StrictInt] = None
    """Testing aid: a seed for random delays before tasks (sleeps on CPU lanes, spin
    kernels on CUDA streams), so that a missing wait produces a wrong answer."""

    profile: Optional[Union[str, Path]] = None
    """Path of a schedule profile (``python -m streamsched profile``): measured task costs
    the planner uses instead of its estimates."""

    @model_validator(mode="before")
    @classmethod
    def _name_unknown_options(cls, data: Any) -> Any:
        # pydantic's own message for extra="forbid" does not suggest the intended name.
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                parts = []
                for key in unknown:
                    close = difflib.get_close_matches(str(key), list(cls.model_fields), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    parts.append(f"unknown option {key!r}{hint}")
                valid = ", ".join(cls.model_fields)
                raise ValueError("; ".join(parts) + f" (valid options: {valid})")
        return data

    @field_validator("leaf_modules", mode="before")
    @classmethod
    def _leaf_modules_are_module_types(cls, value: Any) -> tuple[Any, ...]:
        if isinstance(value, type) or inspect.isfunction(value) or inspect.isbuiltin(value):
            value = (value,)
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise ValueError(
                f"leaf_modules must be a tuple of nn.Module subclasses or functions, got {type(value).__name__}"
            )
        out = []
        for item in value:
            is_module_type = isinstance(item, type) and issubclass(item, torch.nn.Module)
            is_function = inspect.isfunction(item) or inspect.isbuiltin(item)
            if not (is_module_type or is_function):
                raise ValueError(f"leaf_modules must hold nn.Module subclasses or functions, got {item!r}")
            out.append(item)
        return tuple(out)

    @model_validator(mode="after")
    def _check_combinations(self) -> SchedulerConfig:
        if self.chaos is not None and self.cuda_graph is True:
            raise ValueError(
                "chaos and cuda_graph=True cannot be combined: chaos inserts random host "
                f"delays, which a replayed CUDA graph cannot contain (chaos={self.chaos}, "
                "cuda_graph=True)"
            )
        return self

    def resolved_streams(self, width: int) -> int:
        """The stream bound to plan with, for a task graph of the given width."""
        if self.num_streams == "auto":
            return max(1, min(8, width))
        return int(self.num_streams)


def make_config(config: Optional[SchedulerConfig], overrides: dict[str, Any], owner: str) -> SchedulerConfig:
    """Merge a config object and keyword overrides into one validated config.

    ``owner`` names the model being wrapped, so that the error says which wrapper was
    misconfigured.
    """
    if config is not None and not isinstance(config, SchedulerConfig):
        example = "num_streams=4"
        if isinstance(config, Mapping) and config:
            example = ", ".join(f"{k}={v!r}" for k, v in config.items())
        raise ConfigError(
            f"config must be a streamsched.SchedulerConfig, got {type(config).__name__} {config!r} (wrapping "
            f"{owner}): pass options as keywords, StreamScheduledModule(model, {example}), or "
            f"StreamScheduledModule(model, SchedulerConfig({example}))"
        )
    try:
        if config is None:
            return SchedulerConfig(**overrides)
        if not overrides:
            return config
        # model_copy(update=...) would skip validation; rebuild instead.
        merged = {name: getattr(config, name) for name in config.model_fields_set}
        merged.update(overrides)
        return SchedulerConfig(**merged)
    except ValidationError as exc:
        errors = exc.errors() if isinstance(exc, ConfigValidationError) else []
        raise ConfigValidationError.with_message(
            f"invalid streamsched configuration for {owner}: {exc}", errors
        ) from None
