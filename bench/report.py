"""Results: the printed tables, the JSON files and the PNG charts (matplotlib, Agg backend).

Each workload's result goes to ``<workload>.json``; the charts to ``throughput.png`` and
``latency.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

THROUGHPUT_COLUMNS = [
    ("temporal", "temporal", "{}"),
    ("rows", "rows", "{:,}"),
    ("rows_done", "bridge done", "{:,}"),
    ("baseline_rows_per_s", "baseline rows/s", "{:,.0f}"),
    ("bridge_rows_per_s", "bridge rows/s", "{:,.0f}"),
    ("ratio", "ratio", "{:.3f}"),
    ("history_events_per_row", "events/row", "{:.4f}"),
    ("shard_workflows_started", "shard wfs", "{:,}"),
    ("handler_calls", "handler calls", "{:,}"),
    ("seconds", "bridge s", "{:.1f}"),
    ("completed", "completed", "{}"),
]
LATENCY_COLUMNS = [
    ("temporal", "temporal", "{}"),
    ("rows", "rows", "{:,}"),
    ("p50_ms", "p50 ms", "{:.1f}"),
    ("p99_ms", "p99 ms", "{:.1f}"),
    ("warm_p99_ms", "warm p99 ms", "{:.1f}"),
    ("poll_only_p50_ms", "poll p50 ms", "{:.0f}"),
    ("poll_only_p99_ms", "poll p99 ms", "{:.0f}"),
    ("baseline_p50_ms", "baseline p50", "{:.0f}"),
    ("baseline_p99_ms", "baseline p99", "{:.0f}"),
    ("events_per_row", "events/row", "{:.4f}"),
    ("shard_workflows_started", "shard wfs", "{:,}"),
    ("backlog_end", "backlog end", "{}"),
    ("poll_only_backlog_end", "poll backlog", "{}"),
]
WORKERS_COLUMNS = [
    ("temporal", "temporal", "{}"),
    ("workers", "workers", "{}"),
    ("rows", "rows", "{:,}"),
    ("rows_per_s", "rows/s", "{:,.0f}"),
    ("ratio_to_one_worker", "× one worker", "{:.2f}"),
    ("drains_per_worker", "drains each", "{}"),
    ("worker_cpu_percent", "worker CPU %", "{}"),
    ("postgres_cpu_s", "PostgreSQL CPU s", "{:.1f}"),
    ("temporal_cpu_s", "Temporal CPU s", "{:.1f}"),
    ("seconds", "s", "{:.1f}"),
    ("completed", "completed", "{}"),
]
LIMITS_COLUMNS = [
    ("limit_per_s", "limit/s", "{}"),
    ("limited_rate_per_s", "limited rows/s", "{:.1f}"),
    ("other_rate_per_s_with_limit", "other rows/s", "{:,.0f}"),
    ("other_rate_per_s_without_limit", "other, no limit", "{:,.0f}"),
    ("other_rate_ratio", "other ratio", "{:.2f}"),
    ("quiet_p99_wait_s", "quiet p99 s", "{:.2f}"),
    ("quiet_p99_wait_s_with_flood", "with flood", "{:.2f}"),
    ("flood_p99_ratio", "ratio", "{:.2f}"),
]
KIND_COLUMNS = {"latency": LATENCY_COLUMNS, "workers": WORKERS_COLUMNS, "limits": LIMITS_COLUMNS}
EXTRA_COLUMNS = {
    "many-shards": [
        ("running_after_idle", "running after idle", "{}"),
        ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
    ],
    "wide": [
        ("worker_peak_rss_mb", "worker peak RSS MiB", "{:.0f}"),
        ("worker_cpu_s", "worker CPU s", "{:.1f}"),
    ],
    "coalesce": [("baseline_handler_calls", "baseline calls", "{}")],
    **{
        name: [
            ("peak_concurrent_calls", "calls at once", "{:,}"),
            ("baseline_completed", "baseline done", "{}"),
        ]
        for name in ("io-async", "io-plain")
    },
    **{
        name: [
            ("local_bridge_rows_per_s", "local rows/s", "{:,.0f}"),
            ("remote_ratio", "remote/local", "{:.3f}"),
            ("peak_concurrent_calls", "calls at once", "{:,}"),
            ("db_proxy_connections", "proxied conns", "{:,}"),
        ]
        for name in ("io-async-remote", "io-plain-remote")
    },
    "flaky": [
        ("shards_with_failing_group", "shards failing", "{:,}"),
        ("failing_groups", "groups failing", "{:,}"),
    ],
}


def _cell(entry: dict[str, Any], key: str, fmt: str) -> str:
    value = entry.get(key)
    return "-" if value is None else fmt.format(value)


def format_table(result: dict[str, Any]) -> str:
    """The result of one workload as a plain-text table."""
    columns = KIND_COLUMNS.get(result["kind"], THROUGHPUT_COLUMNS)
    columns = columns + EXTRA_COLUMNS.get(result["workload"], [])
    header = [title for _, title, _ in columns]
    rows = [[_cell(e, key, fmt) for key, _, fmt in columns] for e in result["entries"]]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"{result['workload']}: {result['description']} (scale {result['scale']})"]
    for row in [header, ["-" * w for w in widths], *rows]:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    for entry in result["entries"]:
        lines += [_verdict(entry["temporal"], target) for target in entry.get("targets", [])]
    return "\n".join(lines)


def _verdict(mode: str, target: dict[str, Any]) -> str:
    met = {True: "met", False: "missed", None: "not measured"}[target["met"]]
    return f"  target ({mode}): {target['figure']} {target['target']}: {target['value']}, {met}"


def write_json(out: Path, result: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['workload']}.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(result, indent=2, default=str) + "\n")
    temporary.replace(path)
    return path


def load_results(out: Path) -> list[dict[str, Any]]:
    results = []
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        # Results of 0.x's retired mode (a workflow for every shard) are left out.
        retired = isinstance(data, dict) and data.get("shard_workflows", "on-demand") != "on-demand"
        if isinstance(data, dict) and "entries" in data and "kind" in data and not retired:
            results.append(data)
    return results


def draw_charts(out: Path) -> list[Path]:
    """Redraw ``throughput.png`` from the throughput results in ``out`` and ``latency.png``
    from its latency result."""
    from bench import charts

    results = load_results(out)
    drawn = []
    throughput = [r for r in results if r["kind"] == "throughput"]
    if throughput:
        drawn.append(charts.throughput_chart(throughput, out / "throughput.png"))
    latency = [r for r in results if r["kind"] == "latency"]
    if latency:
        drawn.append(charts.latency_chart(latency[0], out / "latency.png"))
    return drawn
