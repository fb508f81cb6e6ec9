"""The benchmark suite: streamsched against eager PyTorch and its peers, in one run.

Every case (a model at one size, batch and input shape) is run by every applicable
variant: eager, ``torch.jit.script``, ``torch.compile`` (and ``reduce-overhead`` on
CUDA), a ``torch.func`` vmap ensemble, the hand-written rewrites of the reference case,
a CUDA graph of the eager model, and streamsched with each executor, with and without
fusion. All variants of a case are checked against eager on the same inputs and timed
in the same interleaved rounds; the report gives ratios against eager.

Run it with ``python -m streamsched bench`` (or ``make bench``)::

    >>> from benchmarks.suite import main
    >>> main(["--quick", "--models", "critic_ensemble", "--out", "/tmp/bench"])  # doctest: +SKIP
    0

See ``docs/benchmarks.md`` for the method and how to read the tables.
"""

from __future__ import annotations

from .cli import main
from .suite import SuiteOptions, run_suite

__all__ = ["main", "run_suite", "SuiteOptions"]
