"""The peers report: ``peers.json`` (every figure), ``peers.md`` (the tables) and
``peers.png`` (rows/s and p99 latency per workload and system) in the results directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = [
    ("peer", "system", "{}"),
    ("status", "run", "{}"),
    ("rows_done", "rows done", "{:,}"),
    ("rows_per_s", "rows/s", "{:,.0f}"),
    ("p50_ms", "p50 ms", "ms"),
    ("p99_ms", "p99 ms", "ms"),
    ("cpu_workers", "worker CPU s/1k", "{:.2f}"),
    ("cpu_postgres", "PG CPU s/1k", "{:.2f}"),
    ("cpu_temporal", "Temporal CPU s/1k", "{:.2f}"),
    ("statements_per_row", "stmts/row", "{:.2f}"),
    ("transactions_per_row", "xacts/row", "{:.2f}"),
    ("calls_per_row", "calls/row", "{:.3f}"),
    ("lost", "lost", "{:,}"),
    ("order_violations", "order viol.", "{:,}"),
    ("duplicates", "dupes", "{:,}"),
    ("overlaps", "overlaps", "{:,}"),
    ("loadavg", "load avg", "{}"),
]


def _flat(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry with its nested figures at the top, as the table shows them."""
    flat = {**entry, **entry.get("check", {})}
    per_1000 = entry.get("cpu_s_per_1000_rows") or {}
    for name in ("workers", "postgres", "temporal"):
        flat[f"cpu_{name}"] = per_1000.get(name)
    if entry.get("loadavg"):
        flat["loadavg"] = f"{entry['loadavg'][0]:.1f}"
    if entry.get("status") == "missing":
        flat["status"] = "not run"
    return flat


def _cell(entry: dict[str, Any], key: str, fmt: str) -> str:
    value = entry.get(key)
    if value is None:
        return "-"
    if fmt == "ms":  # a latency of a few milliseconds keeps its tenths
        fmt = "{:,.1f}" if value < 100 else "{:,.0f}"
    return fmt.format(value)


def markdown_table(workload: dict[str, Any]) -> str:
    """One workload's entries as a markdown table, then why a system did not run."""
    entries = [_flat(e) for e in workload["entries"]]
    header = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [f"**{workload['name']}**: {workload['summary']}", "", header, rule]
    for entry in entries:
        cells = [_cell(entry, key, fmt) for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"- {e['peer']}: {e['status']}: {e.get('reason', '')}".rstrip(": ")
        for e in workload["entries"]
        if e.get("status") in ("missing", "crashed", "hung") or e.get("reason")
    ]
    return "\n".join(lines + (["", *notes] if notes else []))


def systems_table(report: dict[str, Any]) -> str:
    lines = ["| system | versions | order per key | handler | setting |", "|---|---|---|---|---|"]
    for name, system in report["systems"].items():
        versions = ", ".join(f"{k} {v}" for k, v in system.get("versions", {}).items()) or (
            system.get("reason") or "-"
        )
        ordered = "kept" if system["ordered"] else "not offered: run unordered"
        lines.append(
            f"| {name} | {versions} | {ordered} | {system['handler']} | {system['setting']} |"
        )
    return "\n".join(lines)


def render(report: dict[str, Any]) -> str:
    parts = [
        f"# outbox-bridge and its peers (scale {report['scale']})",
        "",
        f"{report['machine']}; statements counted with {report['statements_source']}.",
        "",
        systems_table(report),
    ]
    for workload in report["workloads"].values():
        parts += ["", markdown_table(workload)]
    return "\n".join(parts) + "\n"


def write(out: Path, report: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "peers.json", out / "peers.md"]
    for path, text in zip(
        paths, [json.dumps(report, indent=2) + "\n", render(report)], strict=True
    ):
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_text(text)
        temporary.replace(path)
    return paths


def chart(out: Path, report: dict[str, Any]) -> Path:
    """Grouped bars per workload: rows/s (log scale) and p99 latency, one bar per system."""
    import matplotlib.pyplot as plt

    import bench.charts  # noqa: F401 - selects matplotlib's Agg backend

    workloads = list(report["workloads"].values())
    systems = [name for name, s in report["systems"].items() if not s.get("reason")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(systems))
    for axis, figure, label in (
        (axes[0], "rows_per_s", "rows/s (log)"),
        (axes[1], "p99_ms", "p99 commit → handler start, ms (log)"),
    ):
        for index, system in enumerate(systems):
            values, marks = [], []
            for workload in workloads:
                entry: dict[str, Any] = next(
                    (e for e in workload["entries"] if e["peer"] == system), {}
                )
                values.append(entry.get(figure) or 0.0)
                marks.append("" if entry.get("status") == "completed" else "*")
            xs = [i + (index - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
            bars = axis.bar(xs, values, width, label=system)
            texts = [f"{v:,.0f}{m}" if v else "" for v, m in zip(values, marks, strict=True)]
            axis.bar_label(bars, labels=texts, fontsize=6, rotation=90, padding=2)
        axis.set_xticks(range(len(workloads)), [w["name"] for w in workloads])
        axis.set_yscale("log")
        axis.set_ylabel(label)
        axis.margins(y=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"outbox-bridge and its peers, scale {report['scale']} (* not completed: capped, "
        "hung or crashed)",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / "peers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
