"""The six checks, run by ``test_vision_models.py`` and ``test_transformers_models.py``
(each supplies the ``model`` fixture: ``(spec, model)`` for its family of models).

Every check is parametrised by the wrapper's options (``checks.OPTIONS``): ``default``
(``StreamScheduledModule(model)``, as users run it), ``serial`` and ``threads`` (the
compiled plan on that executor, with no trial that could run the model as written).
Every call asserts its path (``Lockstep.call``). Under ``threads`` only
``test_eval_train_eval`` and ``test_output_types`` are collected (``THREADS_CHECKS``,
applied in ``conftest.py``): together they cover outputs, gradients, state and types on
that executor, and the tier stays within its time.
"""

from __future__ import annotations

import pytest

from .checks import OPTIONS, Lockstep, has_batchnorm, ran_plan
from .zoo import NO_BATCHNORM

THREADS_CHECKS = {"test_eval_train_eval", "test_output_types"}


@pytest.fixture(params=list(OPTIONS))
def lockstep(request, model) -> Lockstep:
    spec, base = model
    return Lockstep(spec, base, OPTIONS[request.param])


def _scheduled_or_untraceable(lockstep: Lockstep) -> None:
    """Under an explicit executor a traceable model's calls after the recording call ran
    the plan (asserted call by call); here: that there were such calls."""
    if lockstep.explicit and lockstep.paths[0] != "eager-dispatch":
        assert lockstep.scheduled, f"no call ran the plan: {lockstep.paths}"


def test_eval_outputs(lockstep: Lockstep) -> None:
    """Eval-mode outputs on fresh inputs, three calls (the first runs the trace)."""
    lockstep.eval()
    for _ in range(3):
        lockstep.call("eval", backward=False)
    _scheduled_or_untraceable(lockstep)


def test_training_grads(lockstep: Lockstep) -> None:
    """Train-mode outputs and every parameter's .grad after loss.backward(), three steps."""
    lockstep.train()
    for _ in range(3):
        lockstep.call("train", backward=True)
    _scheduled_or_untraceable(lockstep)


def test_training_state(lockstep: Lockstep) -> None:
    """The full state_dict (BatchNorm running statistics, num_batches_tracked) after each
    of three training calls."""
    if lockstep.spec.name in NO_BATCHNORM:  # the list that deselects test_frozen_batchnorm
        assert not has_batchnorm(lockstep.ref), f"{lockstep.spec.name} has BatchNorm: remove it from NO_BATCHNORM"
    lockstep.train()
    for _ in range(3):
        lockstep.call("train", backward=True, values=False)
        lockstep.check_state("train")


def test_eval_train_eval(lockstep: Lockstep) -> None:
    """One wrapper switched eval -> train -> eval: outputs, grads and state at each phase."""
    lockstep.eval()
    for _ in range(2):
        lockstep.call("eval (first phase)", backward=False)
    lockstep.check_state("eval (first phase)")
    lockstep.train()
    for _ in range(2):
        lockstep.call("train (second phase)", backward=True)
        lockstep.check_state("train (second phase)")
    lockstep.eval()
    for _ in range(2):
        lockstep.call("eval (third phase)", backward=False)
    lockstep.check_state("eval (third phase)")
    _scheduled_or_untraceable(lockstep)


def test_frozen_batchnorm(lockstep: Lockstep) -> None:
    """Fine-tuning with frozen BatchNorm: a training step, then model.train() with every
    BatchNorm module .eval(): outputs, grads and state of two more steps."""
    # Collected only for models with BatchNorm (conftest.py, zoo.NO_BATCHNORM).
    assert has_batchnorm(lockstep.ref), f"{lockstep.spec.name} has no BatchNorm: add it to zoo.NO_BATCHNORM"
    lockstep.train()
    lockstep.call("train", backward=True)
    lockstep.check_state("train")
    lockstep.freeze_batchnorm()
    for _ in range(2):
        lockstep.call("train with frozen BatchNorm", backward=True)
        lockstep.check_state("train with frozen BatchNorm")


def test_output_types(lockstep: Lockstep) -> None:
    """The wrapper returns what eager returns: the same types at every level (ModelOutput
    subclasses, with attribute access), on the first call and on later ones, in eval and
    in train mode; under an explicit executor, on calls that ran the plan (its output
    rebuild), not only on the recording call."""
    lockstep.eval()
    for _ in range(3):
        lockstep.call("eval", backward=False, values=False, structure=True)
    lockstep.train()
    for _ in range(2):
        lockstep.call("train", backward=True, values=False, structure=True)
    if lockstep.explicit and lockstep.paths[0] != "eager-dispatch":
        assert any(ran_plan(p) for p in lockstep.structure_paths), lockstep.structure_paths
