"""The broad tier (``broad.py``): torchvision, timm and transformers models beyond the
main zoo, each through one lockstep cycle with a fresh wrapper: eval calls, the state;
training steps with every gradient and the state after each; eval again; the output
types throughout. Detection models (their training forward needs targets) run eval
only.

The wrapper names its executor (``serial``): no trial replaces the schedule with the
model's own forward, so every call after a signature's recording call runs the compiled
plan (asserted call by call), and the output types are compared on such calls. The
default options (the ``auto`` trial) run in the main tier. A model whose forward cannot
be traced runs under eager dispatch on every call, and the run's summary says so.

Gradients of plans that fuse nothing are held to the float64 rule here, not bitwise:
on some models (coatnet_pico_rw_224, gcvit_xxtiny) a serial plan's bias gradients differ
from eager's in the last bits on every other training call, as a reduction summed in
another order would (L2 distance from float64 within 0.9-1.05x of eager's).
"""

import pytest

pytest.importorskip("timm")
pytest.importorskip("transformers")

from .broad import SPECS  # noqa: E402
from .checks import OPTIONS, Lockstep, ran_plan  # noqa: E402
from .zoo import build  # noqa: E402


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_lockstep_cycle(spec):
    # Gradients of unfused plans are held to the float64 rule here (exact_grads=False):
    # this tier looks for semantic errors across many models; the main suite holds the
    # bitwise rule.
    lockstep = Lockstep(spec, build(spec), OPTIONS["serial"], exact_grads=False)
    lockstep.eval()
    for _ in range(2):
        lockstep.call("eval", backward=False)
    lockstep.call("eval", backward=False, values=False, structure=True)
    lockstep.check_state("eval")
    untraceable = lockstep.paths[0] == "eager-dispatch"
    assert untraceable or ran_plan(lockstep.structure_paths[-1]), lockstep.paths
    if spec.family.endswith("-eval"):
        return
    lockstep.train()
    for _ in range(2):
        lockstep.call("train", backward=True)
        lockstep.check_state("train")
    lockstep.call("train", backward=True, values=False, structure=True)
    assert untraceable or ran_plan(lockstep.structure_paths[-1]), lockstep.paths
    lockstep.eval()
    lockstep.call("eval (after training)", backward=False)
    lockstep.check_state("eval (after training)")
