"""A worker process that logged an unexpected exception fails its test, although the bridge
restarted and its sweeps repaired what it left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.harness import WorkerProcess

BRIDGE_FAILED = (
    "2026-11-22T14:26:17.585436Z [error    ] bridge failed; restarting in 1s "
    "[outbox_bridge.runtime.bridge]\nTraceback (most recent call last):\n  ...\nKeyError: 'x'\n"
)
STOPPED = "2026-11-22T14:26:17Z [error    ] outbox-bridge stopped on an unexpected error\n"
CLEAN = (
    "2026-11-22T14:26:07Z [info     ] bridge active for tables f_1 [outbox_bridge.runtime.bridge]\n"
)


def worker_with_output(logs: Path, name: str, stderr: str) -> WorkerProcess:
    worker = WorkerProcess({}, logs, name)  # never started: only its output files
    worker.stdout_path.write_text("outbox-bridge is running\n")
    worker.stderr_path.write_text(CLEAN + stderr)
    return worker


@pytest.mark.parametrize(
    ("stderr", "line"),
    [(BRIDGE_FAILED, "bridge failed"), (STOPPED, "outbox-bridge stopped on an unexpected error")],
)
def test_a_worker_that_logged_an_unexpected_exception_fails(
    tmp_path: Path, stderr: str, line: str
) -> None:
    worker = worker_with_output(tmp_path, "worker", stderr)
    with pytest.raises(AssertionError, match=f"worker logged '{line}'"):
        worker.check_output()


def test_the_workers_of_a_test_are_checked_after_it_unless_checked_already(tmp_path: Path) -> None:
    checked = worker_with_output(tmp_path, "checked", "")
    checked.check_output()  # what Scenario.finish does
    checked.stderr_path.write_text(BRIDGE_FAILED)  # not reported a second time
    failing = worker_with_output(tmp_path, "failing", BRIDGE_FAILED)
    with pytest.raises(AssertionError, match="failing logged 'bridge failed'"):
        WorkerProcess.check_outputs()
    assert failing.output_checked  # so the conftest's check after this test passes
