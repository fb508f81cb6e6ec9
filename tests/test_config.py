import pytest
import torch
from pydantic import ValidationError
from torch import nn

import streamsched as ss
from streamsched.config import SchedulerConfig


def test_defaults_are_valid_and_frozen():
    cfg = SchedulerConfig()
    assert cfg.num_streams == "auto" and cfg.executor == "auto" and cfg.fuse is True
    with pytest.raises(ValidationError):
        cfg.num_streams = 4


@pytest.mark.parametrize("value", [0, 33, -1, True, 2.5, "four"])
def test_num_streams_out_of_range_names_the_field(value):
    with pytest.raises(ValidationError) as info:
        SchedulerConfig(num_streams=value)
    assert "num_streams" in str(info.value)


def test_misspelt_option_suggests_the_right_one():
    with pytest.raises(ValidationError) as info:
        SchedulerConfig(nmu_streams=4)
    msg = str(info.value)
    assert "nmu_streams" in msg and "did you mean 'num_streams'" in msg


def test_bad_executor_and_leaf_modules():
    with pytest.raises(ValidationError, match="executor"):
        SchedulerConfig(executor="gpu")
    with pytest.raises(ValidationError, match="leaf_modules"):
        SchedulerConfig(leaf_modules=(int,))
    assert SchedulerConfig(leaf_modules=nn.Linear).leaf_modules == (nn.Linear,)


def test_cross_field_rule_names_both_fields():
    with pytest.raises(ValidationError) as info:
        SchedulerConfig(chaos=1, cuda_graph=True)
    assert "chaos" in str(info.value) and "cuda_graph" in str(info.value)


def test_wrapper_accepts_config_and_overrides():
    model = nn.Linear(4, 4)
    base = SchedulerConfig(num_streams=4, fuse=False)
    sm = ss.StreamScheduledModule(model, base, executor="serial")
    assert sm.config.num_streams == 4 and sm.config.fuse is False and sm.config.executor == "serial"
    assert base.executor == "auto"  # the user's config is never modified


def test_wrapper_config_error_names_model_and_field():
    with pytest.raises(ss.ConfigError) as info:
        ss.StreamScheduledModule(nn.Linear(2, 2), num_streams=100)
    assert "Linear" in str(info.value) and "num_streams" in str(info.value)
    with pytest.raises(ss.ConfigError, match="did you mean 'executor'"):
        ss.StreamScheduledModule(nn.Linear(2, 2), exector="serial")
    with pytest.raises(ss.ConfigError, match="SchedulerConfig"):
        ss.StreamScheduledModule(nn.Linear(2, 2), config={"num_streams": 2})


def test_resolved_streams():
    assert SchedulerConfig().resolved_streams(3) == 3
    assert SchedulerConfig().resolved_streams(50) == 8
    assert SchedulerConfig(num_streams=2).resolved_streams(50) == 2


def test_wrapping_twice_or_wrapping_a_non_module_is_refused():
    sm = ss.StreamScheduledModule(nn.Linear(2, 2))
    with pytest.raises(ss.ConfigError, match="already wrapped"):
        ss.StreamScheduledModule(sm)
    with pytest.raises(TypeError, match="nn.Module"):
        ss.StreamScheduledModule(torch.randn(2))


@pytest.mark.parametrize("parse", ["model_validate", "model_validate_json"])
def test_model_validate_gives_the_same_clear_error(parse):
    """pydantic's model_validate calls the config's __init__, whose error it would report
    as "0 validation errors": the classmethods give the constructor's message."""
    import json

    options = {"num_streams": -1, "executor": "fast"}
    arg = options if parse == "model_validate" else json.dumps(options)
    with pytest.raises(ss.ConfigError, match=r"num_streams=-1: .*executor=.fast.: should be .auto.") as info:
        getattr(SchedulerConfig, parse)(arg)
    assert isinstance(info.value, ValidationError) and info.value.errors()
    good = SchedulerConfig(num_streams=3, executor="serial")
    assert SchedulerConfig.model_validate(good.model_dump(exclude={"leaf_modules"})) == good
    assert SchedulerConfig.model_validate_json(good.model_dump_json(exclude={"leaf_modules"})) == good
