"""``python -m streamsched COMMAND --help`` tells a new user what the command does and
shows a command line that works: each command has a description, the model commands an
example, and that example runs as printed (from the repository root). Every option of
the delegated ``stress`` command says what it is."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from streamsched.cli import main

REPO = Path(__file__).resolve().parents[1]


def _help(capsys, *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["info", "plan", "timeline", "profile"])
def test_each_command_says_what_it_does(capsys, command):
    text = _help(capsys, command)
    usage, _, rest = text.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert not description.startswith(("positional arguments", "options")), text
    assert len(description.split()) > 12, description


def _example(text: str) -> list[str]:
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("python -m streamsched ")]
    assert lines, text
    return shlex.split(lines[0])[3:]


@pytest.mark.slow
@pytest.mark.parametrize("command", ["plan", "timeline", "profile"])
def test_each_model_command_shows_an_example_that_runs(capsys, monkeypatch, tmp_path, command):
    text = _help(capsys, command)
    argv = _example(text)
    assert argv[0] == command, argv
    assert "MODULE:FACTORY is an importable callable" in text and "SchedulerConfig options" in text
    monkeypatch.chdir(REPO)  # where benchmarks.zoo is, as the help says
    if "--out" in argv:  # what it writes, in a scratch folder
        i = argv.index("--out") + 1
        argv[i] = str(tmp_path / Path(argv[i]).name)
    if command == "profile":
        # On a loaded machine the rounds spread wider than the default allows and the
        # profile is refused (as it should be): accept any spread here.
        argv += ["--max-spread", "1000"]
    assert main(argv) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "ParallelFCN" in out, out


def test_the_top_level_help_shows_examples_and_where_to_read_more(capsys):
    text = _help(capsys)
    assert re.search(r"^examples", text, re.M), text
    assert "COMMAND --help" in text and "docs/observability.md" in text
    assert (REPO / "docs" / "observability.md").exists()


def test_every_stress_option_says_what_it_is(capsys):
    assert main(["stress", "--help"]) == 0
    text = capsys.readouterr().out
    options = text.split("options:", 1)[1]
    bare = [line for line in options.splitlines() if re.fullmatch(r"\s+--[\w-]+( [A-Z_]+)?", line)]
    assert not bare, bare
