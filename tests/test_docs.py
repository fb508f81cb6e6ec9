"""README.md and docs/*.md say what is there: their code runs as written, and every file,
test, ``make`` target and ``python -m streamsched`` command they name exists.

Python blocks. The ```` ```python ```` blocks of one page run in order in one namespace,
as a reader pastes them into one session, in a scratch directory (blocks that write
files write them there). A name a block uses without defining it stands for the
reader's own: the page starts with ``model`` (an ensemble of 8 MLPs, ``Linear(20, 10) ->
ReLU -> Linear(10, 1)`` each, in ``model.mlps``, concatenating their outputs), ``x`` (a
batch of 16 inputs), ``y`` (targets), ``example_batch`` (``x``), ``loader`` (a list of
``(x, y)`` batches) and ``loss_fn`` (``nn.MSELoss()``), with ``torch``, ``nn`` and
``ss`` (``streamsched``) imported. A block may carry a marker on the line before its
fence (an HTML comment, invisible on the rendered page):

- ``<!-- doc-check: cuda -->``: it needs a CUDA device. It runs on its own, with the
  names above on ``cuda`` (on a GPU, or on the emulated device without one, as the
  ``cuda``-marked tests do), and leaves the page's namespace alone.
- ``<!-- doc-check: skip: REASON -->``: not run (the reason says why: several
  processes under ``torchrun``, ...).
"""

from __future__ import annotations

import re
import shlex
import traceback
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!--\s*doc-check:\s*(cuda|skip)\s*(?::\s*(.*?))?\s*-->\s*$")


class Block(NamedTuple):
    page: Path
    line: int  # of the opening fence
    lang: str
    code: str
    mark: str | None  # "cuda", "skip" or None
    reason: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = [s for s in text[: m.start()].splitlines() if s.strip()]
        marker = MARKER.search(before[-1]) if before else None
        found.append(
            Block(page, line, m.group(1), m.group(2), marker and marker.group(1), (marker and marker.group(2)) or "")
        )
    return found


def _python_pages() -> list[Path]:
    return [p for p in PAGES if any(b.lang == "python" for b in blocks(p))]


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 10)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(10, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Ensemble(nn.Module):
    def __init__(self, n: int = 8):
        super().__init__()
        self.mlps = nn.ModuleList(_MLP() for _ in range(n))

    def forward(self, x):
        return torch.cat([m(x) for m in self.mlps], dim=1)


def _names(device: str = "cpu") -> dict:
    import streamsched as ss

    x, y = torch.randn(16, 20, device=device), torch.randn(16, 8, device=device)
    return {
        "__name__": "__doc_check__",
        "torch": torch,
        "nn": nn,
        "ss": ss,
        "model": _Ensemble().to(device),
        "x": x,
        "y": y,
        "example_batch": x,
        "loader": [(torch.randn(16, 20), torch.randn(16, 8)) for _ in range(3)],
        "loss_fn": nn.MSELoss(),
    }


def _run(block: Block, namespace: dict) -> None:
    where = f"{block.page.relative_to(ROOT)}:{block.line}"
    try:
        exec(compile(block.code, where, "exec"), namespace)
    except Exception:
        pytest.fail(f"the python block at {where} does not run as written:\n{traceback.format_exc()}")


@pytest.fixture
def _scratch(tmp_path, monkeypatch, one_intra_op_thread, capsys):
    monkeypatch.chdir(tmp_path)
    yield
    capsys.readouterr()  # what the blocks printed is theirs


@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: p.name)
def test_python_blocks_run_as_written(page, _scratch):
    namespace = _names()
    ran = 0
    for block in blocks(page):
        if block.lang == "python" and block.mark is None:
            _run(block, namespace)
            ran += 1
    assert ran, f"{page.name}: every python block is marked; nothing ran"


def _cuda_blocks() -> list[Block]:
    return [b for p in PAGES for b in blocks(p) if b.lang == "python" and b.mark == "cuda"]


@pytest.mark.cuda
@pytest.mark.parametrize("block", _cuda_blocks(), ids=lambda b: f"{b.page.name}:{b.line}")
def test_cuda_blocks_run_on_a_cuda_device(block, _scratch):
    _run(block, _names("cuda"))
    torch.cuda.synchronize()


def test_markers_are_read_and_skips_give_a_reason():
    every = [b for p in PAGES for b in blocks(p)]
    python = [b for b in every if b.lang == "python"]
    assert len(python) >= 15, [f"{b.page.name}:{b.line}" for b in python]
    assert {b.mark for b in python} >= {None, "cuda", "skip"}
    for b in every:
        assert b.mark is None or b.lang == "python", f"{b.page.name}:{b.line}: a marker on a {b.lang or 'plain'} block"
        if b.mark == "skip":
            assert len(b.reason) > 10, f"{b.page.name}:{b.line}: a skipped block says why"
    # Every marker in the pages sits right before a python fence (none is lost in prose).
    for page in PAGES:
        text = page.read_text()
        lines = re.findall(r"^\s*<!--\s*doc-check.*$", text, re.M)
        assert len(lines) == sum(1 for b in blocks(page) if b.mark), (page.name, lines)


# Files, tests, make targets and CLI commands the pages name.

_PATH = re.compile(r"(?<![\w/.<-])((?:\.ci|benchmarks|csrc|docs|examples|profiles|streamsched|tests)/[\w./*-]*[\w/*])")
_TEST = re.compile(r"(?<![\w/])((?:tests/(?:models/)?)?test_\w+\.py)(?:::(\w+)(\.\.\.)?)?")
_OUTPUT = re.compile(r"(?:--out|-o|path=)[ =\"]*$")  # what follows names a file to write


def _lines():
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            yield f"{page.relative_to(ROOT)}:{n}", line


def _test_file(name: str) -> Path | None:
    if name.startswith("tests/"):
        return ROOT / name if (ROOT / name).exists() else None
    for folder in (ROOT / "tests", ROOT / "tests" / "models"):
        if (folder / name).exists():
            return folder / name
    return None


def test_named_files_and_tests_exist():
    missing = []
    for where, line in _lines():
        for m in _PATH.finditer(line):
            path = m.group(1)
            if _OUTPUT.search(line[: m.start()]):
                continue
            exists = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
            if not exists:
                missing.append(f"{where}: {path}")
        for m in _TEST.finditer(line):
            file = _test_file(m.group(1))
            if file is None:
                missing.append(f"{where}: {m.group(1)}")
            elif m.group(2):
                name = re.escape(m.group(2)) + (r"\w*" if m.group(3) else r"\b")
                if not re.search(rf"def {name}", file.read_text()):
                    missing.append(f"{where}: {m.group(0)}")
    assert not missing, "named in the docs but not in the tree:\n" + "\n".join(missing)


def _commands() -> list[tuple[str, list[str]]]:
    """Every command line of the pages: the lines of their bash blocks and each inline
    code span that starts with ``make`` or ``python``."""
    found = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang in ("bash", "sh", "console"):
                for n, line in enumerate(b.code.splitlines(), b.line + 1):
                    line = line.split("#", 1)[0].strip().rstrip("\\").strip()
                    if line:
                        found.append((f"{page.name}:{n}", line))
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for span in re.findall(r"`((?:make|python) [^`]+)`", line):
                found.append((f"{page.name}:{n}", span))
    return found


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w. -]+):(?!=)", text, re.M) for t in line.split()}


def _cli_commands() -> set[str]:
    from streamsched.cli import _DELEGATES, _parsers

    return set(_parsers()[1]) | set(_DELEGATES)


def test_named_commands_exist():
    targets, cli = _make_targets(), _cli_commands()
    from streamsched.cli import _parsers

    flags = {name: set(p._option_string_actions) for name, p in _parsers()[1].items()}
    wrong = []
    seen = 0
    for where, line in _commands():
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        words = [w for w in words if "=" not in w or w.startswith("-")]  # VAR=value before a command
        if not words:
            continue
        if words[0] == "make":
            for target in (w for w in words[1:] if not w.startswith("-")):
                seen += 1
                if target not in targets:
                    wrong.append(f"{where}: make {target} (no such target)")
        elif words[0] == "python" and words[1:3] == ["-m", "streamsched"]:
            # `python -m streamsched info | plan | ...` lists several.
            names = [w for w in "".join(words[3:]).split("[")[0].split("|")] if "|" in words else words[3:4]
            for name in (n.strip() for n in names if not n.startswith("-")):
                seen += 1
                if name and name not in cli:
                    wrong.append(f"{where}: python -m streamsched {name} (no such command)")
            if len(names) == 1 and names[0] in flags:  # its options, where the line gives one command
                for flag in (w.split("=")[0] for w in words[4:] if w.startswith("--")):
                    if flag not in flags[names[0]]:
                        wrong.append(f"{where}: python -m streamsched {names[0]} {flag} (no such option)")
        elif words[0] == "python" and len(words) > 1 and words[1].endswith(".py"):
            seen += 1
            script = words[1]
            if script != "train.py" and not (ROOT / script).exists():  # train.py: the reader's own
                wrong.append(f"{where}: python {script} (no such file)")
    assert seen > 20, seen
    assert not wrong, "\n".join(wrong)


def test_docstring_examples_of_the_package_run(one_intra_op_thread):
    """What ``help()`` shows: every ``>>>`` example in the package's docstrings runs and
    prints what it says (fragments that need a model are marked ``# doctest: +SKIP``)."""
    import doctest
    import importlib
    import pkgutil

    import streamsched

    failed, attempted = [], 0
    for info in pkgutil.walk_packages(streamsched.__path__, "streamsched."):
        module = importlib.import_module(info.name)
        for test in doctest.DocTestFinder().find(module):
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            result = runner.run(test, out=lambda text: None)
            attempted += result.attempted
            if result.failed:
                failed.append(f"{test.name} ({test.filename}:{test.lineno}): {result.failed} failed")
    assert attempted >= 10, attempted
    assert not failed, "\n".join(failed)
