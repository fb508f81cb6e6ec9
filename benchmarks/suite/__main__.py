"""``python -m benchmarks.suite [args]``: the benchmark suite (same as ``python -m streamsched bench``)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
