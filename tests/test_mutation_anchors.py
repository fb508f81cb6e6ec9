"""Every planted mutant of ``make mutation`` (``.ci/mutation.py``: the synchronisation calls)
and ``make mutation-lite`` (``tests/mutation_lite.py``: known breakages) still finds the
one line it edits. A refactor that moves such a line leaves its mutant unapplied, and an
unapplied mutant proves nothing about the tests meant to catch it."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_every_synchronisation_mutant_finds_its_line():
    mutation = _load(ROOT / ".ci" / "mutation.py", "_ss_mutation")
    missing = []
    for mutant in mutation.MUTANTS:
        text = (ROOT / mutant.path).read_text()
        for old, _new in mutant.edits:
            if text.count(old) != 1:
                missing.append(f"{mutant.name}: {old.strip()[:80]!r} occurs {text.count(old)} times in {mutant.path}")
    assert not missing, "\n".join(missing)


def test_every_known_breakage_mutant_applies(tmp_path):
    lite = _load(ROOT / "tests" / "mutation_lite.py", "_ss_mutation_lite")
    missing = []
    for mutant in lite.MUTANTS:
        tree = tmp_path / mutant.name
        skip = shutil.ignore_patterns("*.so", "__pycache__")
        shutil.copytree(ROOT / "streamsched", tree / "streamsched", ignore=skip)
        try:
            mutant.edit(tree)
        except lite.AnchorMissing as exc:
            missing.append(f"{mutant.name}: {exc}")
    assert not missing, "\n".join(missing)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
