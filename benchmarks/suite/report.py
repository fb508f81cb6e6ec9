"""The benchmark's outputs: ``bench.json`` (environment, options, every raw sample) and
``bench.md`` (ratios against eager, per case and in one summary table).

The JSON schema (``"schema": "streamsched.bench/1"``)::

    {
      "schema": "streamsched.bench/1",
      "environment": {"device", "device_name", "torch", "streamsched", "runtime_info",
                      "date", "threads", "interop_threads", "python", "platform", "cpu_count"},
      "options": {...the command-line options...},
      "cases": [{"id", "family", "label", "kind", "params", "input_shapes", "rounds",
                 "warmup", "correctness", "eager_median_ms", "notes",
                 "rows": [{"name", "status", "reason", "detail", "max_abs_err",
                           "max_abs_err_is_inf", "tolerance", "setup_s", "setup_what",
                           "stats": {"median_ms", "min_ms", "p10_ms", "p90_ms", "spread_ms"},
                           "speedup_vs_eager", "calls_per_sample", "samples_ms", "info"}]}],
      "wrong": ["case id: variant", ...],
      "errors": ["case id: variant", ...]
    }
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from streamsched import __version__, runtime_info
from streamsched.envinfo import cpu_name

from .results import CaseResult

__all__ = ["SCHEMA", "environment", "build_report", "markdown", "write_report", "json_output_path"]

SCHEMA = "streamsched.bench/1"


def environment(device: torch.device) -> dict[str, Any]:
    """Where and with what the numbers were taken."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_name()
    return {
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "streamsched": __version__,
        "runtime_info": runtime_info(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def build_report(env: dict[str, Any], options: dict[str, Any], cases: Sequence[CaseResult]) -> dict[str, Any]:
    data = [case.to_dict() for case in cases]
    wrong = [f"{c['id']}: {r['name']}" for c in data for r in c["rows"] if r["status"] == "WRONG"]
    errors = [f"{c['id']}: {r['name']}" for c in data for r in c["rows"] if r["status"] == "error"]
    return {"schema": SCHEMA, "environment": env, "options": options, "cases": data, "wrong": wrong, "errors": errors}


# --- Markdown ---------------------------------------------------------------------


def _ms(value: Optional[float]) -> str:
    if value is None:
        return ""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _ratio(value: Optional[float]) -> str:
    if value is None:
        return ""
    return f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def _err(row: dict[str, Any]) -> str:
    if row["max_abs_err_is_inf"]:
        return "inf"
    if row["max_abs_err"] is None:
        return ""
    return f"{row['max_abs_err']:.1e}"


def _cell(text: str) -> str:
    # Error messages may hold pipes and newlines, which would break the table.
    return " ".join(text.split()).replace("|", "\\|")


def _status_text(row: dict[str, Any]) -> str:
    status = row["status"]
    if status == "ok":
        return "ok"
    reason = _cell(row["reason"] or "")
    return f"**{status}** ({reason})" if status == "WRONG" else f"{status} ({reason})"


def _summary_cell(row: Optional[dict[str, Any]]) -> str:
    if row is None:
        return ""
    status = row["status"]
    if status == "ok":
        return _ratio(row["speedup_vs_eager"])
    if status == "WRONG":
        return f"**WRONG** {_ratio(row['speedup_vs_eager'])}".strip()
    return status


def _setup(row: dict[str, Any]) -> str:
    if row["setup_s"] is None:
        return ""
    return f"{row['setup_what']}: {row['setup_s']:.2f} s"


def _case_table(case: dict[str, Any]) -> list[str]:
    lines = [
        f"### {case['label']}: {case['kind']}",
        "",
        f"Input {' , '.join(str(s) for s in case['input_shapes'])}; {case['rounds']} rounds; "
        f"correctness: {case['correctness']}.",
        "",
        "| variant | median ms | min ms | spread ms (p90-p10) | speedup vs eager | max abs err | status "
        "| one-off cost |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in case["rows"]:
        stats = row["stats"] or {}
        lines.append(
            "| "
            + " | ".join(
                [
                    _cell(row["name"]),
                    _ms(stats.get("median_ms")),
                    _ms(stats.get("min_ms")),
                    _ms(stats.get("spread_ms")),
                    _ratio(row["speedup_vs_eager"]),
                    _err(row),
                    _status_text(row),
                    _setup(row),
                ]
            )
            + " |"
        )
    for note in case["notes"]:
        lines.append(f"\nNote: {note}")
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: a summary of speedups, then one table per case."""
    env = report["environment"]
    rt = env["runtime_info"]
    lines = [
        "# streamsched benchmarks",
        "",
        f"- device: {env['device']} ({env['device_name']}), {env['threads']} intra-op threads, "
        f"{env['cpu_count']} CPUs visible",
        f"- torch {env['torch']}, streamsched {env['streamsched']} (runtime: {rt['runtime']}), "
        f"Python {env['python']}, {env['platform']}",
        f"- date: {env['date']}",
        "- speedup = eager median / variant median (higher is faster); time per call, median over the rounds;"
        " all variants of a case timed in the same interleaved rounds, on the same inputs",
        "",
        "## Speedup over eager",
        "",
    ]
    columns: list[str] = []
    for case in report["cases"]:
        for row in case["rows"]:
            if row["name"] != "eager" and row["name"] not in columns:
                columns.append(row["name"])
    lines.append("| case | eager ms | " + " | ".join(columns) + " |")
    lines.append("|---|---:|" + "---:|" * len(columns))
    for case in report["cases"]:
        by_name = {row["name"]: row for row in case["rows"]}
        cells = [_summary_cell(by_name.get(name)) for name in columns]
        lines.append(
            f"| {case['label']} ({case['kind']}) | {_ms(case['eager_median_ms'])} | " + " | ".join(cells) + " |"
        )
    if report["wrong"]:
        lines += ["", "**WRONG results** (disagree with eager): " + "; ".join(report["wrong"])]
    if report["errors"]:
        lines += ["", "Errors: " + "; ".join(report["errors"])]
    lines += ["", "## Per case", ""]
    for case in report["cases"]:
        lines += _case_table(case) + [""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``bench.md`` into ``out_dir`` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench.json"
    md_path = out_dir / "bench.md"
    json_path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    md_path.write_text(markdown(report) + "\n")
    return json_path, md_path


def json_output_path(out: Path, default_name: str) -> Path:
    """Where a benchmark script writes its JSON: ``out`` itself when it names a ``.json``
    file, else ``out/default_name``; the folder is created."""
    path = out if out.suffix == ".json" else out / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
