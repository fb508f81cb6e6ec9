"""What ships beside the library in the source tree, not in the package: the benchmark
suite (:mod:`benchmarks.suite`, ``python -m streamsched bench`` or ``python -m
benchmarks.suite``), the stress driver (:mod:`benchmarks.stress`, ``python -m streamsched
stress``), the branchy reference models of the examples, tests and benchmarks
(:mod:`benchmarks.zoo`), and standalone scripts (``python benchmarks/<name>.py``).

Import it from the repository root (``python -m`` and pytest put the root on
``sys.path``); ``pip install`` installs ``streamsched`` alone.
"""
