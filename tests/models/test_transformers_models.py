"""Hugging Face transformers models (tiny configurations, random weights), wrapped vs eager
(the checks are in ``suite.py``)."""

import pytest

pytest.importorskip("transformers")

from .suite import (  # noqa: E402, F401 - collected here
    lockstep,
    test_eval_outputs,
    test_eval_train_eval,
    test_frozen_batchnorm,
    test_output_types,
    test_training_grads,
    test_training_state,
)
from .zoo import build, specs  # noqa: E402

SPECS = specs("transformers")


@pytest.fixture(scope="module", params=[pytest.param(s, marks=s.marks, id=s.name) for s in SPECS])
def model(request):
    return request.param, build(request.param)
