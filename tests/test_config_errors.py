"""Configuration errors: one clear ``ConfigError`` per mistake, typed options for IDEs.

A misspelt option names the option and the closest valid name; a value out of range is
one clause per option (a union field is not one error per union member); no pydantic
error counts or documentation links. ``SchedulerConfig(...)`` called directly raises the
same ``ConfigError``, which is also the ``pydantic.ValidationError`` code may catch.
"""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError
from torch import nn

import streamsched as ss
from streamsched.config import SchedulerConfig, SchedulerOptions


def _noise(message: str) -> list[str]:
    return [s for s in ("errors.pydantic.dev", "validation error", "For further information", "type=") if s in message]


def test_misspelt_option_is_one_clear_config_error():
    with pytest.raises(ss.ConfigError) as info:
        SchedulerConfig(nmu_streams=4)
    message = str(info.value)
    assert message.startswith("unknown option 'nmu_streams'; did you mean 'num_streams'?")
    assert not _noise(message), message
    assert isinstance(info.value, ValidationError) and isinstance(info.value, ValueError)
    with pytest.raises(ss.ConfigError) as info:
        ss.StreamScheduledModule(nn.Linear(2, 2), exector="serial")
    message = str(info.value)
    assert "Linear" in message and "unknown option 'exector'; did you mean 'executor'?" in message
    assert message.count("exector") == 1 and not _noise(message), message


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"num_streams": 100}, "num_streams=100: should be 'auto' or should be less than or equal to 32"),
        ({"executor": "gpu"}, "executor='gpu': should be 'auto', 'serial', 'streams' or 'threads'"),
        ({"fuse": 3}, "fuse=3: should be a valid boolean"),
        ({"min_task_cost": "10"}, "min_task_cost='10': should be a valid number, not a string (pass 10, not '10')"),
        ({"min_task_cost": "x"}, "min_task_cost='x': should be a valid number"),
        (
            {"num_streams": "4"},
            "num_streams='4': should be 'auto' or should be a valid integer, not a string (pass 4, not '4')",
        ),
        ({"chaos": 1, "cuda_graph": True}, "chaos and cuda_graph=True cannot be combined"),
    ],
)
def test_bad_values_give_one_clause_per_option(options, expected):
    with pytest.raises(ss.ConfigError) as info:
        SchedulerConfig(**options)
    message = str(info.value)
    assert message.startswith(expected), message
    assert not _noise(message), message
    assert message.count(";") == 0  # one option, one clause
    assert info.value.errors()  # pydantic's structured list is still there
    assert repr(info.value) == f"ConfigValidationError({message!r})"


def test_frozen_config_refuses_assignment_with_a_config_error():
    cfg = SchedulerConfig(num_streams=2)
    with pytest.raises(ss.ConfigError, match="frozen: cannot set num_streams"):
        cfg.num_streams = 4
    assert cfg.num_streams == 2


def test_typed_options_match_the_config_fields():
    assert set(SchedulerOptions.__annotations__) == set(SchedulerConfig.model_fields)
    annotation = inspect.signature(ss.StreamScheduledModule.__init__).parameters["overrides"].annotation
    assert "Unpack[SchedulerOptions]" in str(annotation)


def test_executor_eager_says_what_eager_means_in_a_plan():
    """``sm.plan`` reads ``executor eager`` when ``auto`` kept the model's own forward, so a
    reader of a plan asks for it: the error says it is not a choice and how to get it."""
    with pytest.raises(ss.ConfigError) as info:
        ss.StreamScheduledModule(nn.Linear(2, 2), executor="eager")
    message = str(info.value)
    assert "Linear" in message and "executor='eager'" in message, message
    assert "call the model itself" in message and not _noise(message), message
    with pytest.raises(ss.ConfigError) as info:
        ss.StreamScheduledModule(nn.Linear(2, 2), executor="thread")
    assert "call the model itself" not in str(info.value)
