"""The six checks, run by ``test_vision_models.py`` and ``test_transformers_models.py``
(each supplies the ``model`` fixture: ``(spec, model)`` for its family of models).

Every check is parametrised by the wrapper's options: ``default``
(``StreamScheduledModule(model)``), and ``nonstrict`` (``strict=False``), which runs only
for models whose default wrapping raises ``TraceError`` and skips elsewhere.
"""

from __future__ import annotations

import pytest

from .checks import OPTIONS, Lockstep, has_batchnorm, needs_nonstrict

_traceable: dict = {}


@pytest.fixture(params=list(OPTIONS))
def lockstep(request, model) -> Lockstep:
    spec, base = model
    if request.param == "nonstrict" and not needs_nonstrict(spec, base, _traceable):
        pytest.skip("the default options trace this model; strict=False runs only where they raise TraceError")
    return Lockstep(spec, base, OPTIONS[request.param])


def test_eval_outputs(lockstep: Lockstep) -> None:
    """Eval-mode outputs on fresh inputs, three calls (the first runs the trace)."""
    lockstep.eval()
    for _ in range(3):
        lockstep.call("eval", backward=False)


def test_training_grads(lockstep: Lockstep) -> None:
    """Train-mode outputs and every parameter's .grad after loss.backward(), three steps."""
    lockstep.train()
    for _ in range(3):
        lockstep.call("train", backward=True)


def test_training_state(lockstep: Lockstep) -> None:
    """The full state_dict (BatchNorm running statistics, num_batches_tracked) after each
    of three training calls."""
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


def test_frozen_batchnorm(lockstep: Lockstep) -> None:
    """Fine-tuning with frozen BatchNorm: a training step, then model.train() with every
    BatchNorm module .eval(): outputs, grads and state of two more steps."""
    if not has_batchnorm(lockstep.ref):
        pytest.skip("no BatchNorm in this model")
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
    in train mode."""
    lockstep.eval()
    for _ in range(3):
        lockstep.call("eval", backward=False, values=False, structure=True)
    lockstep.train()
    for _ in range(2):
        lockstep.call("train", backward=True, values=False, structure=True)
