"""What an install ships besides the code: the PEP 561 marker that makes type checkers
read the package's hints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_build_ships_py_typed(tmp_path):
    assert (REPO / "streamsched" / "py.typed").is_file()
    env = {**os.environ, "SKIP_EXT": "1"}
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "lib" / "streamsched" / "py.typed").is_file()
