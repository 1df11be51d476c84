"""``python -m bench.summary DIR [DIR ...]``: the figures of several runs side by side.

Each ``DIR`` is the ``--out`` of one ``python -m bench`` invocation. For every workload and
Temporal server mode found, it prints one Markdown row with the median of
each figure over the runs that measured it, and its range (min–max) when there is more than
one. Runs measured on a shared machine vary: a single figure says little, a median and its
spread say more.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.report import load_results

# (key in an entry, column title, format) per kind of workload.
THROUGHPUT = [
    ("baseline_rows_per_s", "baseline rows/s", "{:,.0f}"),
    ("bridge_rows_per_s", "bridge rows/s", "{:,.0f}"),
    ("ratio", "ratio", "{:.2f}"),
    ("history_events_per_row", "events/row", "{:.4f}"),
    ("shard_workflows_started", "shard workflows", "{:,.0f}"),
]
WORKERS = [
    ("rows_per_s", "rows/s", "{:,.0f}"),
    ("ratio_to_one_worker", "× one worker", "{:.2f}"),
    ("postgres_cpu_s", "PostgreSQL CPU s", "{:.1f}"),
    ("temporal_cpu_s", "Temporal CPU s", "{:.1f}"),
]
LATENCY = [
    ("p50_ms", "p50 ms", "{:.1f}"),
    ("p99_ms", "p99 ms", "{:.1f}"),
    ("baseline_p99_ms", "baseline p99 ms", "{:.1f}"),
    ("events_per_row", "events/row", "{:.4f}"),
    ("shard_workflows_started", "shard workflows", "{:,.0f}"),
]


def spread(values: Sequence[float], fmt: str) -> str:
    """``median`` or ``median (min–max)``."""
    if not values:
        return "-"
    middle = fmt.format(statistics.median(values))
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return middle if low == high else f"{middle} ({low}–{high})"


def _notes(entries: list[dict[str, Any]]) -> str:
    notes = []
    for side in ("bridge", "baseline"):
        capped = sum(not e.get(f"{side}_completed", True) for e in entries)
        if capped:
            notes.append(f"{side} capped by the budget in {capped} of {len(entries)}")
    calls = sorted({int(e["handler_calls"]) for e in entries if e.get("handler_calls") is not None})
    if entries[0].get("workload_kind") != "latency" and len(calls) == 1:
        notes.append(f"{calls[0]:,} handler calls")
    failing = {
        int(e["shards_with_failing_group"]) for e in entries if "shards_with_failing_group" in e
    }
    if failing:
        notes.append(f"shards with a failing group: {', '.join(map(str, sorted(failing)))}")
    notes += _targets(entries)
    return "; ".join(notes)


def _targets(entries: list[dict[str, Any]]) -> list[str]:
    """Each target of the workload: its figure (median and range) and how many runs met it."""
    notes = []
    for target in entries[0].get("targets", []):
        figure = target["figure"]
        verdicts = [t for e in entries for t in e.get("targets", []) if t["figure"] == figure]
        values = [float(t["value"]) for t in verdicts if t["value"] is not None]
        met = sum(t["met"] is True for t in verdicts)
        notes.append(
            f"{figure} {spread(values, '{:,.2f}')} (target {target['target']}: "
            f"met in {met} of {len(verdicts)})"
        )
    return notes


def table(dirs: Sequence[Path]) -> str:
    """One Markdown table over the results in ``dirs``."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    kinds: dict[str, str] = {}
    for directory in dirs:
        for result in load_results(directory):
            kinds[result["workload"]] = result["kind"]
            for entry in result["entries"]:
                server = entry["temporal"]
                if "workers" in entry:  # one line per number of workers
                    server = f"{server}, {entry['workers']} workers"
                key = (result["workload"], server)
                grouped.setdefault(key, []).append({**entry, "workload_kind": result["kind"]})
    lines = []
    for kind, columns in (("throughput", THROUGHPUT), ("latency", LATENCY), ("workers", WORKERS)):
        keys = sorted(k for k in grouped if kinds[k[0]] == kind)
        if not keys:
            continue
        titles = ["workload", "server", "runs", *(t for _, t, _ in columns), "notes"]
        lines += ["", "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
        for workload, server in keys:
            entries = grouped[(workload, server)]
            cells = [workload, server, str(len(entries))]
            for field, _, fmt in columns:
                values = [float(e[field]) for e in entries if e.get(field) is not None]
                cells.append(spread(values, fmt))
            cells.append(_notes(entries))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines).lstrip("\n") + "\n"


def main(argv: list[str] | None = None, write: Callable[[str], object] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.summary", description=__doc__)
    parser.add_argument("dirs", nargs="+", type=Path, help="results directories (--out)")
    args = parser.parse_args(argv)
    write(table(args.dirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
