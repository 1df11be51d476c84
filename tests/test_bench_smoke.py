"""Smoke test of the benchmark suite: every workload at a tiny size against the test session's
servers, checking the JSON results and the charts (no timing assertions).

Handler calls are bounded on both sides: every coalescing group is handled, and repeats stay
under a ceiling. Each run must draw its own charts: the chart functions are watched, and the
chart of each workload must be drawn from results that include it, and be written anew.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from bench import charts, report
from bench import workers as workers_module
from bench.context import BenchConfig
from bench.proxy import DelayProxy, Upstream, proxied_database
from bench.runner import run
from bench.worker_process import peak_rss_mb
from outbox_bridge.config import libpq_url, sqlalchemy_url
from tests.harness import Servers

ROOT = Path(__file__).resolve().parents[1]
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


def tiny_config(servers: Servers, out: Path, **changes: Any) -> BenchConfig:
    config = BenchConfig(
        scale=0.003,
        out=out,
        database_url=servers.database_url,
        temporal_address=servers.temporal_address,
        latency_seconds=1.5,  # 30 rows per phase at 20 rows/s over 10 shards
        latency_grace=1.0,
        latency_rate=20.0,
        latency_shards=10,
        budget=300.0,
    )
    return dataclasses.replace(config, **changes)


# Workloads run smaller than the smoke's 0.003 where that keeps every check meaningful:
# ``flaky`` at 0.002 has 200 rows in 2 shards with one failing group each (at 0.003, 9 groups
# fail, up to 5 in one shard, and each waits out 3 s of retries on both sides, in series);
# ``wide`` at 0.001 has 200 shards of a row each, its worker still in a process of its own;
# ``io`` (and ``workers``, on the same rows) at 0.001 has 8 shards × 10 rows: calls still
# overlap (up to 8 at once) while each drain waits through 80 rows of 50 ms calls, not 240.
SCALES = {"flaky": 0.002, "wide": 0.001}
IO_SCALE = 0.001


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


@dataclass
class Drawn:
    """The charts drawn during one run: chart file name -> the workloads it was drawn from."""

    charts: dict[str, list[set[str]]] = field(default_factory=dict)

    def watch(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        original: Callable[[Any, Path], Path] = getattr(charts, name)

        def drawing(results: Any, path: Path) -> Path:
            listed = results if isinstance(results, list) else [results]
            self.charts.setdefault(path.name, []).append({r["workload"] for r in listed})
            return original(results, path)

        monkeypatch.setattr(charts, name, drawing)


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> Iterator[Drawn]:
    watched = Drawn()
    watched.watch(monkeypatch, "throughput_chart")
    watched.watch(monkeypatch, "latency_chart")
    yield watched


def assert_drawn_anew(out: Path, chart: str, workload: str, drawn: Drawn, before: int) -> None:
    """``chart`` was drawn in this run from results that include ``workload``, and its file
    was written after the run began (not left by an earlier workload)."""
    assert any(workload in names for names in drawn.charts.get(chart, [])), drawn.charts
    path = out / chart
    assert path.stat().st_mtime_ns > before, f"{chart} was not written by the {workload} run"
    assert_png(path)


def mtime(path: Path) -> int:
    return path.stat().st_mtime_ns if path.exists() else -1


def assert_targets(entry: dict[str, Any], figures: list[str]) -> None:
    """Each target of the entry names its figure, that figure's value, and a verdict."""
    assert [t["figure"] for t in entry["targets"]] == figures
    for target in entry["targets"]:
        assert target["value"] == entry[target["figure"]]
        assert target["met"] in (True, False)


@pytest.mark.parametrize(
    "workload", ["backlog", "hot-shard", "coalesce", "many-shards", "wide", "flaky"]
)
async def test_throughput_workload(
    servers: Servers, out: Path, workload: str, drawn: Drawn
) -> None:
    before = mtime(out / "throughput.png")
    await run([workload], tiny_config(servers, out, scale=SCALES.get(workload, 0.003)))
    for entry in load(out, workload):
        expected = 10 if workload == "coalesce" else entry["groups"]
        if workload == "flaky":
            # Each failing group is called 3 times more, on both sides.
            assert entry["failing_groups"] > 0 and entry["failures_per_group"] == 3
            expected += 3 * entry["failing_groups"]
            assert entry["expected_handler_calls"] == expected
            assert (
                entry["baseline_failed_calls"]
                == entry["failed_calls"]
                == expected - entry["groups"]
            )
            # The partitions retried the failing groups themselves: no workflow of their own.
            assert entry["shards_with_failing_group"] > 0 and entry["partition_attempts"] == 4
            assert entry["shard_workflows_started"] == entry["expected_shard_workflows"] == 0
        else:
            assert entry["failed_calls"] == 0
        assert entry["baseline_handler_calls"] == expected
        assert entry["rows_done"] == entry["rows"]
        calls, repeats = entry["handler_calls"], entry["duplicate_handler_calls"]
        assert calls == expected + repeats
        # Every group handled (at least once) and, since nothing fails here, hardly any twice:
        # a drain deletes what it handled on its way out, even when cancelled, so a repeat
        # needs an attempt that was retried between a handler call and that delete. At most
        # one such per shard is allowed for a loaded machine.
        assert expected <= calls <= expected + entry["shards"], entry
        if workload == "coalesce":
            assert calls == 10
        assert entry["running_after_idle"] == 0
        if workload == "many-shards":
            assert entry["shards"] * 3 == entry["rows"]
            assert entry["peak_rss_mb"] > 0
        if workload == "wide":
            assert entry["shards"] == entry["rows"] == entry["groups"]
            # The worker ran in a process of its own: the handler calls counted above are
            # the ones it reported, with its own memory and CPU.
            assert entry["worker_process"] == "own"
            assert entry["worker_peak_rss_mb"] > 0 and entry["worker_cpu_s"] > 0
            assert_targets(entry, ["ratio", "worker_peak_rss_mb"])
        else:
            assert entry["worker_process"] == "bench" and "worker_peak_rss_mb" not in entry
    assert_drawn_anew(out, "throughput.png", workload, drawn, before)


async def run_io(
    servers: Servers, out: Path, drawn: Drawn, workload: str, variants: tuple[str, str]
) -> list[dict[str, Any]]:
    """Run an ``io`` workload; check what every variant of it must hold; return its entries."""
    before = mtime(out / "throughput.png")
    await run([workload], tiny_config(servers, out, scale=IO_SCALE))
    entries = []
    for variant in variants:
        [entry] = load(out, variant)
        assert entry["rows"] == 10 * entry["shards"] == entry["rows_done"]
        assert entry["baseline_handler_calls"] == entry["groups"]
        assert entry["groups"] <= entry["handler_calls"] <= entry["groups"] + entry["shards"]
        # Calls that wait overlap in the worker, one per thread in the baseline's 4 threads.
        assert 1 < entry["peak_concurrent_calls"] <= entry["shards"], entry
        assert 1 <= entry["baseline_peak_concurrent_calls"] <= entry["baseline_threads"]
        entries.append(entry)
    assert_drawn_anew(out, "throughput.png", variants[-1], drawn, before)
    return entries


async def test_io_workload(servers: Servers, out: Path, drawn: Drawn) -> None:
    entries = await run_io(servers, out, drawn, "io", ("io-async", "io-plain"))
    assert all("remote_ratio" not in entry for entry in entries)


async def test_io_remote_workload(servers: Servers, out: Path, drawn: Drawn) -> None:
    variants = ("io-async-remote", "io-plain-remote")
    for entry in await run_io(servers, out, drawn, "io-remote", variants):
        # The worker drained through the proxy, and the same rows directly just before.
        assert entry["db_delay_ms"] == 2.0 and entry["db_proxy_connections"] > 0
        assert entry["local_bridge_completed"] is True
        # Both rates are rounded to 0.1 row/s and the ratio to 4 places: at the smoke's small
        # rates that rounding alone moves the quotient by more than 0.1 %.
        remote, local = entry["bridge_rows_per_s"], entry["local_bridge_rows_per_s"]
        low, high = (remote - 0.05) / (local + 0.05), (remote + 0.05) / (local - 0.05)
        assert low - 5e-5 <= entry["remote_ratio"] <= high + 5e-5, (entry, low, high)
        assert entry["baseline_database"] == "local"
        assert_targets(entry, ["remote_ratio"])


def test_a_worker_process_reports_its_own_peak_memory_not_its_parent_s() -> None:
    # Linux keeps a parent's peak in a child's ru_maxrss; the worker's figure must not be it.
    ballast = b"\x01" * (256 * 2**20)  # every page written, so resident
    parent = psutil.Process().memory_info().rss / 2**20
    # The function itself, without the imports of its module (seconds of CPU in the child).
    source = inspect.getsource(peak_rss_mb)
    code = f"from pathlib import Path\n{source}\nprint(peak_rss_mb())"
    child = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert 0 < float(child.stdout) < parent - 200, (child.stdout, parent)
    del ballast


DELAY = 0.05


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1000):
        writer.write(data)
        await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_proxy_delays_each_way_and_keeps_the_bytes_in_order() -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    upstream = Upstream("127.0.0.1", int(server.sockets[0].getsockname()[1]))
    try:
        async with DelayProxy(upstream, DELAY) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            began = time.monotonic()
            writer.write(b"?")
            assert await reader.readexactly(1) == b"?"
            # Through the proxy to the echo server and back: delayed once each way.
            assert time.monotonic() - began >= 2 * DELAY
            # Chunks written while earlier ones are still held arrive whole and in order.
            sent = b"".join(i.to_bytes(4, "big") for i in range(50_000))
            for start in range(0, len(sent), 3_000):
                writer.write(sent[start : start + 3_000])
                await writer.drain()
            writer.write_eof()
            assert await reader.read() == sent
            writer.close()
            await writer.wait_closed()
            # A connection still open when the proxy closes is ended, not leaked.
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"open")
            assert await reader.readexactly(4) == b"open"
        assert await reader.read() == b""
        assert proxy.connections == 2
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


async def test_proxied_database_leads_through_a_delaying_process(servers: Servers) -> None:
    async with proxied_database(servers.database_url, DELAY * 1000) as proxied:
        url = libpq_url(sqlalchemy_url(proxied.url))
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            began = time.monotonic()
            cursor = await conn.execute("SELECT 41 + 1")
            assert await cursor.fetchone() == (42,)
            assert time.monotonic() - began >= 2 * DELAY
    # The proxy process stopped cleanly (or the block raised) and says what it forwarded.
    assert proxied.connections == 1


async def test_a_proxy_process_that_dies_is_an_error(servers: Servers) -> None:
    with pytest.raises(RuntimeError, match="did not stop cleanly"):
        async with proxied_database(servers.database_url, 1.0) as proxied:
            os.kill(proxied.pid, signal.SIGKILL)


async def test_latency_workload(servers: Servers, out: Path, drawn: Drawn) -> None:
    before = mtime(out / "latency.png")
    await run(["latency"], tiny_config(servers, out))
    for entry in load(out, "latency"):
        assert not [k for k in LATENCY_REQUIRED if k not in entry], entry
        assert 0 < entry["p50_ms"] <= entry["p99_ms"]
        assert 0 < entry["poll_only_p50_ms"] <= entry["poll_only_p99_ms"]
        assert entry["backlog_end"] >= 0 and entry["events_per_row"] > 0
        # Every row written was handled, and (as above) at most one repeat per shard.
        assert entry["rows"] <= entry["handler_calls"] <= entry["rows"] + entry["shards"], entry
        assert set(entry["samples"]) == {"listen", "poll_only", "baseline"}
    assert_drawn_anew(out, "latency.png", "latency", drawn, before)


async def test_workers_workload(
    servers: Servers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker process, then two on one task queue: both ran a partition drain, every row
    was handled, and each entry reports the CPU of each worker and of the servers."""
    monkeypatch.setattr(workers_module, "WORKER_COUNTS", (1, 2))
    # Its results alone in their folder: this workload has no chart, and the runner would
    # redraw the other workloads' charts after it.
    await run(["workers"], tiny_config(servers, tmp_path, scale=IO_SCALE))
    result = json.loads((tmp_path / "workers.json").read_text())
    one, two = result["entries"]
    assert (one["workers"], two["workers"]) == (1, 2)
    for entry in (one, two):
        assert entry["completed"] is True and entry["rows_done"] == entry["rows"] > 0
        assert len(entry["drains_per_worker"]) == len(entry["worker_cpu_s"]) == entry["workers"]
        assert min(entry["drains_per_worker"]) >= 1, entry["drains_per_worker"]
        assert sum(entry["handler_calls_per_worker"]) >= entry["rows"]
        assert all(cpu > 0 for cpu in entry["worker_cpu_s"])
    assert one["ratio_to_one_worker"] == 1.0
    assert_targets(two, ["ratio_to_one_worker"])
    assert "× one worker" in report.format_table(result)
