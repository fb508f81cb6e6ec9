"""The figures of README.md's benchmark tables are the committed profiles' figures: each
cell equals the cell of the same case and variant in the file the README names
(``profiles/cpu/bench.md``, ``profiles/cpu/stacked-optim/bench.md``,
``profiles/cpu/real-models/real_models.md``)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tables(text: str) -> list[list[list[str]]]:
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if current is None:
                current = [cells]
            elif not set("".join(cells)) <= set("-: "):
                current.append(cells)
        elif current:
            out.append(current)
            current = None
    if current:
        out.append(current)
    return out


def _readme_table(first_column: str, second: str) -> list[dict[str, str]]:
    for table in _tables((ROOT / "README.md").read_text()):
        if table[0][:2] == [first_column, second]:
            return [dict(zip(table[0], row)) for row in table[1:]]
    raise AssertionError(f"README.md has no table starting {first_column} | {second}")


def _profile_rows(path: str) -> list[dict[str, str]]:
    table = _tables((ROOT / path).read_text())[0]
    return [dict(zip(table[0], row)) for row in table[1:]]


def _by_case(rows: list[dict[str, str]], case: str) -> dict[str, str]:
    found = [r for r in rows if r["case"].startswith(case + " (")]
    assert len(found) == 1, (case, [r["case"] for r in rows])
    return found[0]


def _compare(readme_rows, match, columns, source) -> list[str]:
    wrong = []
    for row in readme_rows:
        other = match(row)
        for ours, theirs in columns.items():
            if row[ours] != other[theirs]:
                wrong.append(f"{row[next(iter(row))]} / {ours}: README {row[ours]!r}, {source} {other[theirs]!r}")
    return wrong


def test_the_inference_table_is_profiles_cpu_bench_md():
    rows = _readme_table("case", "eager ms")
    columns = {
        "eager ms": "eager ms",
        "jit.script": "torch.jit.script",
        "compile": "torch.compile",
        "vmap": "torch.func vmap",
        "grouped conv (hand)": "grouped conv (hand-written)",
        "stacked bmm (hand)": "stacked baddbmm (hand-written)",
        "streamsched": "streamsched",
        "no fusion": "streamsched serial, no fusion",
    }
    source = "profiles/cpu/bench.md"
    profile = _profile_rows(source)
    assert len(rows) >= 10
    wrong = _compare(rows, lambda r: _by_case(profile, r["case"]), columns, source)
    assert not wrong, "\n".join(wrong)


def test_the_training_table_is_profiles_cpu_stacked_optim():
    rows = _readme_table("case", "loop ms")
    columns = {
        "loop ms": "eager ms",
        "streamsched": "streamsched",
        '`grad_handoff="direct"`': "streamsched, grad_handoff=direct",
        "SGD over `sm.fused_parameters()`": "streamsched, fused_parameters()",
        "no fusion": "streamsched, no fusion",
    }
    source = "profiles/cpu/stacked-optim/bench.md"
    profile = _profile_rows(source)
    assert len(rows) == 2
    wrong = _compare(rows, lambda r: _by_case(profile, r["case"] + ", training step"), columns, source)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("column", ["eager ms", "eager (copy)", "streamsched", "torch.compile", "streamsched runs"])
def test_the_real_model_table_is_profiles_cpu_real_models(column):
    rows = _readme_table("model", "eager ms")
    source = "profiles/cpu/real-models/real_models.md"
    profile = _profile_rows(source)
    assert len(rows) == len(profile), "one README row per measured model, in the same order"
    for ours, theirs in zip(rows, profile):
        value = theirs[column]
        if column == "torch.compile":
            value = value.split(" (")[0]  # the README gives the ratio of medians only
        if column == "streamsched runs":
            value = value.split(" (")[0]  # what it settled on, without the trial's figures
            ours_value = ours[column].replace(", fused", "").replace(" (untraceable)", "")
        else:
            ours_value = ours[column]
        assert ours_value == value, (ours["model"], column, ours[column], theirs[column])
