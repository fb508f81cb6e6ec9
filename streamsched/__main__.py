"""``python -m streamsched``: see :mod:`streamsched.cli` (``python -m streamsched --help``)."""

from .cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
