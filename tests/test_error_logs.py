"""An ERROR record of the library fails the test that was running (see tests/conftest.py),
unless the test is marked as provoking it."""

from __future__ import annotations

import pytest

from tests.conftest import ERROR_LOGS_MARKER

INNER_TESTS = """
import logging

import pytest


def test_an_error_of_the_library():
    logging.getLogger("outbox_bridge.runtime.bridge").error("bridge failed; restarting in 1s")


def test_an_exception_of_the_library():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("outbox_bridge").exception("outbox-bridge stopped")


@pytest.mark.logs_errors
def test_an_error_on_purpose():
    logging.getLogger("outbox_bridge.observability.health").error("cannot serve the health endpoints")


def test_a_warning_of_the_library():
    logging.getLogger("outbox_bridge.runtime.shard_drain").warning("handler failed")


def test_an_error_of_another_logger():
    logging.getLogger("temporalio.worker").error("not the library's")
"""


@pytest.mark.logs_errors  # the inner tests log into this process's loggers
def test_an_error_record_of_the_library_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("from tests.conftest import no_library_error_logs  # noqa: F401\n")
    pytester.makeini(
        "[pytest]\n"
        "asyncio_default_fixture_loop_scope = function\n"
        f"markers = {ERROR_LOGS_MARKER}: errors on purpose\n"
    )
    pytester.makepyfile(test_inner=INNER_TESTS)
    # Without pytest-django: this process set Django up already, and the inner run has no
    # Django tests.
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-p", "no:django", "--strict-markers"
    )
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_an_error_of_the_library*",
            "*the library logged 1 error record(s) during the test*",
            "*ERROR outbox_bridge.runtime.bridge: bridge failed; restarting in 1s*",
            "*ERROR at teardown of test_an_exception_of_the_library*",
            "*ERROR outbox_bridge: outbox-bridge stopped [[]RuntimeError: boom[]]*",
        ]
    )
