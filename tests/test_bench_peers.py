"""``python -m bench peers`` without the other systems installed: the one checker on made-up
call logs, the command's parsing, how it names a system that cannot run, the report it renders
(tables, JSON, chart), and one run of outbox-bridge through it on the session's servers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bench.__main__ import main as bench_main
from bench.peers import PEERS, cli, load, report
from bench.peers.base import Peer, RunSpec
from bench.peers.calls import Call, CallReader
from bench.peers.checker import Row, check
from bench.peers.database import libpq
from bench.peers.progress import Coverage
from bench.peers.run import Options, measure
from bench.peers.workloads import WORKLOADS
from tests.harness import Servers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def call(key: int, seq: int, obj: int, start: float, end: float, ok: bool = True) -> Call:
    return Call(key, seq, 1, obj, start, end, pid=7, ok=ok)


ROWS = [Row(1, 1, 1, 10), Row(2, 1, 1, 20), Row(3, 1, 1, 10), Row(4, 2, 1, 30)]


def test_a_clean_ordered_run_has_no_problem_and_one_call_per_row() -> None:
    calls = [
        call(1, 1, 10, 0.0, 1.0),
        call(1, 2, 20, 1.0, 2.0),
        call(1, 3, 10, 2.0, 3.0),
        call(2, 4, 30, 0.5, 1.5),
    ]
    verdict = check(ROWS, calls, coalescing=False)
    assert verdict.clean
    assert verdict.calls_per_row == 1.0
    assert set(verdict.covered_at) == {1, 2, 3, 4}


def test_coalescing_covers_a_groups_older_rows_in_order_of_their_lowest_pending_row() -> None:
    # Rows 1 and 3 are one group: handled once with row 3, before row 2 (the group's lowest
    # pending row, 1, comes first): no violation, three rows, two calls.
    calls = [call(1, 3, 10, 0.0, 1.0), call(1, 2, 20, 1.0, 2.0), call(2, 4, 30, 0.0, 1.0)]
    verdict = check(ROWS, calls, coalescing=True)
    assert verdict.clean, verdict.examples
    assert verdict.calls_per_row == 0.75
    assert verdict.covered_at[1] == verdict.covered_at[3] == 0.0


def test_a_row_handled_before_an_earlier_row_of_its_key_is_an_order_violation() -> None:
    calls = [call(1, 2, 20, 0.0, 1.0), call(1, 1, 10, 1.0, 2.0), call(1, 3, 10, 2.0, 3.0)]
    verdict = check(ROWS, calls, coalescing=False)
    assert verdict.order_violations == 1
    assert verdict.lost == 1  # row 4 was never handled
    assert "key 1: row 2 handled before row 1" in verdict.examples


def test_overlaps_duplicates_failures_and_unknown_calls_are_counted() -> None:
    calls = [
        call(1, 1, 10, 0.0, 1.0, ok=False),  # failed: covers nothing
        call(1, 1, 10, 0.5, 1.5),  # overlaps the failed call, then covers row 1
        call(1, 1, 10, 2.0, 3.0),  # row 1 again: a duplicate
        call(1, 2, 20, 3.0, 4.0),
        call(1, 3, 10, 4.0, 5.0),
        call(2, 4, 30, 0.0, 1.0),
        call(9, 99, 1, 0.0, 1.0),  # a key the run never wrote
    ]
    verdict = check(ROWS, calls, coalescing=False)
    figures = verdict.figures()
    assert (figures["overlaps"], figures["duplicates"], figures["lost"]) == (1, 1, 0)
    assert (figures["failed_calls"], figures["unknown_calls"], figures["calls"]) == (1, 1, 7)
    assert figures["order_violations"] == 0


def test_coverage_tracks_what_the_checker_covers() -> None:
    for coalescing in (True, False):
        coverage = Coverage(ROWS, coalescing=coalescing)
        calls = [call(1, 3, 10, 0, 1), call(1, 2, 20, 1, 2), call(2, 4, 30, 0, 1)]
        for c in calls:
            coverage.add(c)
        assert coverage.covered == len(check(ROWS, calls, coalescing=coalescing).covered_at)
        assert coverage.complete() is coalescing  # without coalescing, row 1 is still due


def test_calls_are_read_whole_lines_at_a_time_from_every_process(tmp_path: Path) -> None:
    first, second = call(1, 1, 10, 0.0, 1.0), call(1, 2, 20, 1.0, 2.0)
    (tmp_path / "calls-1.tsv").write_text(first.line() + second.line()[:5])
    reader = CallReader(tmp_path)
    assert reader.new_calls() == [first]
    with (tmp_path / "calls-1.tsv").open("a") as file:
        file.write(second.line()[5:])
    (tmp_path / "calls-2.tsv").write_text(first.line())
    assert reader.new_calls() == [second, first]
    assert reader.new_calls() == []


class Absent(Peer):
    name = "absent"
    distributions = ("outbox-bridge-no-such-distribution",)
    module = "outbox_bridge_no_such_module"
    ordered = True
    coroutines = True
    setting: ClassVar[str] = "nothing"

    def install_schema(self, spec: RunSpec) -> None:
        raise AssertionError

    def producer(self, spec: RunSpec) -> Any:
        raise AssertionError

    def serve(self, spec: RunSpec, role: str) -> None:
        raise AssertionError


def test_a_system_that_is_not_installed_says_how_to_install_it() -> None:
    assert Absent().missing() == (
        "not installed (outbox-bridge-no-such-distribution, outbox_bridge_no_such_module): "
        "pip install -e '.[bench]'"
    )
    if sys.version_info < (3, 12):
        assert str(load("oban").missing()).startswith("needs Python >= 3.12 (this is 3.11")
        assert "--interpreter oban=PATH" in str(load("oban").missing())
    assert load("outbox-bridge").missing() is None  # the bridge needs only the package


def test_every_system_loads_without_its_library() -> None:
    for name in PEERS:
        peer = load(name)
        assert peer.name == name
        assert set(peer.describe()) == {"name", "ordered", "coalescing", "handler", "setting"}


def test_the_command_parses_its_systems_workloads_and_scale(
    capsys: pytest.CaptureFixture[str],
) -> None:
    peers, workloads, args = cli.parse(["--peers", "pgqueuer,outbox-bridge", "--scale", "0.1"])
    assert peers == ["pgqueuer", "outbox-bridge"]
    assert workloads == ["backlog", "io", "latency", "hot-key", "flaky"]
    assert args.scale == 0.1 and args.concurrency == 50
    _, _, args = cli.parse(["--interpreter", "oban=/opt/py312/bin/python"])
    assert args.interpreter == {"oban": "/opt/py312/bin/python"}
    assert load("oban", args.interpreter["oban"]).interpreter == "/opt/py312/bin/python"
    with pytest.raises(SystemExit):
        cli.parse(["--interpreter", "kafka=/usr/bin/python3"])
    assert "--interpreter takes SYSTEM=PYTHON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse(["--peers", "kafka"])
    assert "unknown peers or workloads: kafka" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["peers", "--scale", "0"])
    assert "--scale must be positive" in capsys.readouterr().err


def entry(peer: str, **figures: Any) -> dict[str, Any]:
    base = {
        "peer": peer,
        "status": "completed",
        "rows_done": 5000,
        "rows_per_s": 1234.5,
        "p50_ms": 12.0,
        "p99_ms": 340.0,
        "cpu_s_per_1000_rows": {"workers": 0.5, "postgres": 0.25, "temporal": None},
        "statements_per_row": 3.2,
        "transactions_per_row": 1.1,
        "check": {"calls_per_row": 1.0, "lost": 0, "order_violations": 2, "duplicates": 0,
                  "overlaps": 0},
        "loadavg": [3.5, 2.0, 1.0],
    }  # fmt: skip
    return {**base, **figures}


def test_the_report_renders_tables_json_and_a_chart(tmp_path: Path) -> None:
    peers, workloads, args = cli.parse(
        ["--peers", "outbox-bridge,oban", "--workloads", "backlog,hot-key", "--out", str(tmp_path)]
    )
    result = cli.new_report(peers, workloads, args)
    result["systems"]["absent"] = {**Absent().describe(), "reason": Absent().missing()}
    result["workloads"]["backlog"]["entries"] = [
        entry("outbox-bridge"),
        {"peer": "absent", "status": "missing", "reason": Absent().missing()},
    ]
    result["workloads"]["hot-key"]["entries"] = [entry("outbox-bridge", status="capped")]
    paths = report.write(tmp_path, result)
    assert json.loads(paths[0].read_text())["workloads"]["backlog"]["entries"][0]["p99_ms"] == 340
    text = paths[1].read_text()
    assert (
        "| outbox-bridge | completed | 5,000 | 1,234 | 12.0 | 340 | 0.50 | 0.25 | - | 3.20" in text
    )
    assert "| absent | not run |" in text
    assert "- absent: missing: not installed (outbox-bridge-no-such-distribution, " in text
    if sys.version_info < (3, 12):
        assert "| oban | needs Python >= 3.12" in text
    assert report.chart(tmp_path, result).read_bytes().startswith(PNG_MAGIC)


async def test_outbox_bridge_drains_through_the_peers_bench(servers: Servers, tmp_path: Path):
    """The whole path of one run, for the system that needs nothing but this package: its own
    database, schema, producer and worker processes, the calls logged and checked."""
    options = Options(
        # 200 rows over 2 keys, a group of each failing 3 times (at 0.005, 5 groups of 2 keys
        # do, and a key waits out the retries of each of its failing groups in turn)
        scale=0.002,
        concurrency=5,
        base_dir=tmp_path,
        admin_url=libpq(servers.database_url),
        temporal_address=servers.temporal_address,
        cap=120.0,
    )
    entry = await measure("outbox-bridge", WORKLOADS["flaky"], options)
    assert entry["status"] == "completed", entry
    check = entry["check"]
    assert (check["lost"], check["order_violations"], check["duplicates"]) == (0, 0, 0), check
    assert check["overlaps"] == 0
    assert entry["failing_groups"] > 0
    assert check["failed_calls"] == 3 * entry["failing_groups"]
    assert check["calls_per_row"] < 1  # coalesced: fewer calls than rows
    assert entry["rows_done"] == entry["rows"] == 200
    assert entry["rows_per_s"] > 0 and entry["cpu_s"]["workers"] > 0
    assert entry["transactions_per_row"] > 0
