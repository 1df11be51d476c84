"""mypy --strict over the tree (``test_mypy_strict_finds_nothing`` in tests/test_lint.py) starts as
soon as the tests are collected, as a program of its own beside the test processes, and the test
reads its result. It is the suite's longest single test (about 50 s of CPU with no mypy cache),
and pytest-xdist hands out the small lint file among the last: run then, it would be the run's
tail instead of overlapping the other tests.

One process starts it: ``gw0`` under pytest-xdist (the files carry the run's id, which every test
process shares), or the only one. The program writes its output, then its exit code; it outlives
the process that started it, which may end first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MYPY_TEST = (ROOT / "tests" / "test_lint.py", "test_mypy_strict_finds_nothing")
# The run's id outside pytest-xdist.
LOCAL_RUN = uuid.uuid4().hex
# In the background (the shell itself ends at once, leaving no child to wait for): mypy's output
# to $1, then its exit code to $2 (renamed into place: read whole or not at all).
SCRIPT = '("$0" -m scripts.typecheck >"$1" 2>&1; echo $? >"$2.part"; mv "$2.part" "$2") &'


def paths(config: pytest.Config) -> tuple[Path, Path]:
    """Where this run's mypy writes its output and its exit code."""
    workerinput = getattr(config, "workerinput", None)
    run = LOCAL_RUN if workerinput is None else workerinput["testrunuid"]
    base = Path(tempfile.gettempdir()) / f"outbox-mypy-{run}"
    return base.with_suffix(".out"), base.with_suffix(".code")


def pytest_collection_finish(session: pytest.Session) -> None:
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None and workerinput["workerid"] != "gw0":
        return
    if not any((item.path, item.name) == MYPY_TEST for item in session.items):
        return
    out, code = paths(session.config)
    subprocess.run(
        ["sh", "-c", SCRIPT, sys.executable, str(out), str(code)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not stopped with the test process that started it
        check=True,
    )


def result(config: pytest.Config, timeout: float) -> tuple[int, str]:
    """The exit code and output of this run's mypy, once it ended (at most ``timeout`` s)."""
    out, code = paths(config)
    deadline = time.monotonic() + timeout
    while not code.exists():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"mypy, started when the tests were collected, gave no result in {timeout} s "
                f"(load average {os.getloadavg()[0]:.1f})"
            )
        time.sleep(0.5)
    try:
        return int(code.read_text()), out.read_text()
    finally:
        out.unlink(missing_ok=True)
        code.unlink(missing_ok=True)
