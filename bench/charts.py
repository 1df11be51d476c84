"""The PNG charts, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported
import matplotlib.pyplot as plt

ORDER = [
    "backlog",
    "hot-shard",
    "coalesce",
    "flaky",
    "many-shards",
    "wide",
    "io-async",
    "io-plain",
    "io-async-remote",
    "io-plain-remote",
]
COLORS = {"baseline": "#7f7f7f", "file": "#1f77b4", "memory": "#ff7f0e", "external": "#2ca02c"}


def _series(
    results: list[dict[str, Any]],
) -> tuple[list[str], dict[str, list[float]], dict[str, list[bool]]]:
    """Workload names, rows/s per series (baseline, then bridge per server mode), and whether
    each bridge figure comes from a drain capped by the time budget."""
    results = sorted(
        results, key=lambda r: ORDER.index(r["workload"]) if r["workload"] in ORDER else len(ORDER)
    )
    names = [r["workload"] for r in results]
    modes = sorted(
        {e["temporal"] for r in results for e in r["entries"]},
        key=lambda m: list(COLORS).index(m) if m in COLORS else 99,
    )
    series: dict[str, list[float]] = {"baseline": []}
    series.update({m: [] for m in modes})
    capped: dict[str, list[bool]] = {m: [] for m in series}
    for result in results:
        entries = {e["temporal"]: e for e in result["entries"]}
        base = [e["baseline_rows_per_s"] for e in result["entries"]]
        series["baseline"].append(sum(base) / len(base) if base else 0.0)
        capped["baseline"].append(
            not all(e.get("baseline_completed", True) for e in entries.values())
        )
        for mode in modes:
            entry = entries.get(mode)
            series[mode].append(entry["bridge_rows_per_s"] if entry else 0.0)
            capped[mode].append(entry is not None and not entry.get("bridge_completed", True))
    return names, series, capped


def throughput_chart(results: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars per workload: baseline rows/s and bridge rows/s per server mode (log y); a
    figure from a drain capped by the time budget is marked with a star."""
    names, series, capped = _series(results)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(names)), 4.8))
    for index, (label, values) in enumerate(series.items()):
        xs = [i + (index - (len(series) - 1) / 2) * width for i in range(len(names))]
        title = "baseline (direct drain)" if label == "baseline" else f"bridge, Temporal {label}"
        bars = ax.bar(xs, values, width, label=title, color=COLORS.get(label))
        labels = [
            f"{v:,.0f}" + ("*" if cut else "") for v, cut in zip(values, capped[label], strict=True)
        ]
        ax.bar_label(bars, labels=labels, fontsize=7, rotation=90, padding=2)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("rows/s (log scale)")
    scales = sorted({r["scale"] for r in results})
    title = f"outbox-bridge vs direct drain, scale {', '.join(map(str, scales))}"
    if any(any(cut) for cut in capped.values()):
        title += "\n* capped by the time budget: the rate until the cap"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(series))
    ax.margins(y=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_chart(result: dict[str, Any], path: Path) -> Path:
    """Per server mode: latency over time (scatter) and latency by percentile, for the bridge
    with LISTEN, polling only, and the baseline."""
    entries = result["entries"]
    fig, axes = plt.subplots(len(entries), 2, figsize=(12, 4.2 * len(entries)), squeeze=False)
    styles = {"listen": "#1f77b4", "poll_only": "#ff7f0e", "baseline": "#7f7f7f"}
    for row, entry in zip(axes, entries, strict=True):
        over_time, by_percentile = row
        for name, samples in entry["samples"].items():
            if not samples:
                continue
            xs, ys = zip(*samples, strict=True)
            ms = sorted(ys)
            label = f"{name} (p50 {_pct(ms, 50):.0f} ms, p99 {_pct(ms, 99):.0f} ms)"
            over_time.scatter(xs, ys, s=3, alpha=0.5, color=styles.get(name), label=label)
            pcts = [100 * (i + 1) / len(ms) for i in range(len(ms))]
            by_percentile.plot(pcts, ms, color=styles.get(name), label=name)
        over_time.set_yscale("log")
        over_time.set_xlabel("commit time (s since the writer started)")
        over_time.set_ylabel("commit → handler start (ms, log)")
        over_time.set_title(
            f"latency over time, Temporal {entry['temporal']}, "
            f"{entry['rate']:.0f} rows/s over {entry['shards']} shards",
            fontsize=10,
        )
        over_time.legend(fontsize=8, markerscale=4)
        by_percentile.set_yscale("log")
        by_percentile.set_xlabel("percentile")
        by_percentile.set_ylabel("latency (ms, log)")
        by_percentile.set_title("latency by percentile")
        by_percentile.grid(True, which="both", alpha=0.3)
        by_percentile.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, max(0, round(p / 100 * len(values)) - 1))]
