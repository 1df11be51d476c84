"""Smoke test of the benchmark suite: every workload at a tiny size against the test session's
servers, checking the JSON results and the charts (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.context import BenchConfig
from bench.runner import run
from tests.harness import Servers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REQUIRED = (
    "rows bridge_rows_per_s baseline_rows_per_s ratio history_events_per_row handler_calls "
    "shards seconds temporal"
).split()
LATENCY_REQUIRED = (
    "p50_ms p99_ms poll_only_p50_ms poll_only_p99_ms events_per_row backlog_end"
).split()


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-results")


def tiny_config(servers: Servers, out: Path) -> BenchConfig:
    return BenchConfig(
        scale=0.003,
        out=out,
        database_url=servers.database_url,
        temporal_address=servers.temporal_address,
        idle_timeout=1.0,
        latency_seconds=3.0,
        latency_grace=1.0,
        latency_rate=20.0,
        latency_shards=10,
        budget=300.0,
        # Short timers so that shard workflows close quickly (lingering drains wait for rows
        # first); unknown fields are ignored by OutboxSettings.
        settings_overrides={"linger": 1.0},
    )


def load(out: Path, workload: str) -> list[dict[str, Any]]:
    result = json.loads((out / f"{workload}.json").read_text())
    assert result["workload"] == workload
    entries: list[dict[str, Any]] = result["entries"]
    assert [e["temporal"] for e in entries] == ["external"]
    for entry in entries:
        assert not [k for k in REQUIRED if k not in entry], entry
        assert entry["rows"] > 0 and entry["shards"] > 0 and entry["seconds"] > 0
        assert entry["bridge_rows_per_s"] > 0 and entry["baseline_rows_per_s"] > 0
        assert entry["ratio"] > 0
        assert entry["history_events_per_row"] > 0
        assert entry["completed"] is True
    return entries


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path


@pytest.mark.parametrize("workload", ["backlog", "hot-shard", "coalesce", "many-shards"])
async def test_throughput_workload(servers: Servers, out: Path, workload: str) -> None:
    await run([workload], tiny_config(servers, out))
    for entry in load(out, workload):
        expected = 10 if workload == "coalesce" else entry["groups"]
        assert entry["baseline_handler_calls"] == expected
        # At least once: under load a drain can be retried and call a handler again.
        assert entry["handler_calls"] == expected + entry["duplicate_handler_calls"]
        if workload == "coalesce":
            assert entry["handler_calls"] == 10
        assert entry["running_after_idle"] == 0
        if workload == "many-shards":
            assert entry["shards"] * 3 == entry["rows"]
            assert entry["peak_rss_mb"] > 0
    assert_png(out / "throughput.png")


async def test_latency_workload(servers: Servers, out: Path) -> None:
    await run(["latency"], tiny_config(servers, out))
    for entry in load(out, "latency"):
        assert not [k for k in LATENCY_REQUIRED if k not in entry], entry
        assert 0 < entry["p50_ms"] <= entry["p99_ms"]
        assert 0 < entry["poll_only_p50_ms"] <= entry["poll_only_p99_ms"]
        assert entry["backlog_end"] >= 0 and entry["events_per_row"] > 0
        assert entry["handler_calls"] >= entry["rows"]
        assert set(entry["samples"]) == {"listen", "poll_only", "baseline"}
    assert_png(out / "latency.png")
