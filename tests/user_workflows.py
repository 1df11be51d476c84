"""A team's own Temporal workflow, for the tests that run the outbox in that team's worker
(tests/test_plugin.py). It runs in the worker's default sandbox, which re-imports this module
for every run: it imports nothing but Temporal's SDK."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from temporalio import workflow

# The activity, registered by the test, writes the order's outbox row in its transaction.
PLACE_ORDER = "place_order"


@dataclass
class OrderPlaced:
    row_id: int  # the outbox row the activity wrote
    sandboxed: bool  # whether the workflow ran in Temporal's sandbox


@workflow.defn
class OrderWorkflow:
    @workflow.run
    async def run(self, order_id: int) -> OrderPlaced:
        row_id: int = await workflow.execute_activity(
            PLACE_ORDER,
            order_id,
            result_type=int,
            start_to_close_timeout=timedelta(seconds=30),
        )
        return OrderPlaced(row_id, workflow.unsafe.in_sandbox())
