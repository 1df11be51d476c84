"""Order and coalescing (the design contract, invariants 2 and 3), as a property: a model of a
shard's pending rows against the real drains, on a real PostgreSQL.

The model (:func:`tests.harness.coalesced_calls`): within a shard, the coalescing groups in
ascending order of their lowest pending id, each handled once, with its highest-id row (its
payload) and the count of rows it covers; every row deleted. Hypothesis writes interleaved shards whose groups' lowest and highest ids
order differently, and drains them with the worker's rounds (a few head groups per round: a
shard takes several rounds, and groups go on past a round's window of 16 rows) and with the
testing toolkit's drain.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge import OutboxApp, OutboxMessage
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.testing import drain_outbox_async
from outbox_bridge.workflows.models import ShardRef
from tests.harness import (
    Category,
    Recorder,
    coalesced_calls,
    create_tables,
    make_app,
    unique_table,
)

CATEGORIES = (Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE, Category.MEMBER_UPDATE)
SHARDS = (1, 2, 3)
# A row: its shard, category and object. Few of each, so that groups coalesce and interleave.
ROW = st.tuples(st.sampled_from(SHARDS), st.sampled_from(CATEGORIES), st.integers(0, 2))


class Calls:
    """The app's handler: records each call by shard (its row's id and the rows it covers),
    and the id that each call's payload names."""

    def __init__(self) -> None:
        self.by_shard: dict[int, list[tuple[int, int]]] = defaultdict(list)
        self.payloads: list[tuple[int, object]] = []

    def __call__(self, message: OutboxMessage) -> None:
        self.by_shard[message.shard_identifier].append((message.id, message.coalesced))
        payload = message.payload
        self.payloads.append(
            (message.id, payload.get("row") if isinstance(payload, dict) else None)
        )


@dataclass
class Outbox:
    engine: AsyncEngine
    app: OutboxApp
    calls: Calls

    @property
    def table(self) -> str:
        return self.app.table().name

    async def write(self, rows: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        """Commit ``rows`` in one statement, ids ascending in their order; each row's payload
        names its own id."""
        shards, categories, objects = (list(column) for column in zip(*rows, strict=True))
        async with self.engine.begin() as conn:
            inserted = await conn.execute(
                text(
                    f"INSERT INTO {self.table} (shard_scope, shard_identifier, category, "
                    "object_identifier) "
                    "SELECT 1, s, c, o FROM unnest(CAST(:shards AS bigint[]), "
                    "CAST(:categories AS int[]), CAST(:objects AS bigint[])) "
                    "WITH ORDINALITY AS r(s, c, o, n) ORDER BY n RETURNING id"
                ),
                {"shards": shards, "categories": [int(c) for c in categories], "objects": objects},
            )
            ids = sorted(inserted.scalars())
            await conn.execute(
                text(f"UPDATE {self.table} SET payload = jsonb_build_object('row', id)")
            )
        return [
            (row_id, shard, int(category), obj)
            for row_id, (shard, category, obj) in zip(ids, rows, strict=True)
        ]

    async def pending(self) -> int:
        async with self.engine.connect() as conn:
            result = await conn.execute(text(f"SELECT count(*) FROM {self.table}"))
            return int(result.scalar_one())

    async def reset(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(text(f"DELETE FROM {self.table}"))
        self.calls.by_shard.clear()
        self.calls.payloads.clear()


@pytest.fixture(scope="module")
async def outbox(engine: AsyncEngine) -> Outbox:
    calls = Calls()
    app = make_app(unique_table(), Recorder(), handle_all=False)
    app.handler(*Category)(calls)
    await create_tables(engine, app)
    return Outbox(engine, app, calls)


@pytest.fixture(scope="module")
def handler_calls(outbox: Outbox) -> Iterator[HandlerCalls]:
    calls = HandlerCalls(outbox.app, redact_errors=False, threads=2)
    yield calls
    calls.close()


Drain = Callable[[Outbox, HandlerCalls, int], Awaitable[None]]


async def drain_in_rounds(outbox: Outbox, calls: HandlerCalls, max_groups: int) -> None:
    """The worker's rounds over every shard (each takes ``max_groups`` head groups at most)
    until the table is empty."""
    drains = DrainEngine(outbox.engine, outbox.app, calls=calls)
    table = outbox.app.table()
    shards = [ShardRef(table.name, 1, "ORGANIZATION", shard) for shard in SHARDS]
    for _ in range(200):
        if not await outbox.pending():
            return
        async with drains.locked(table, shards) as round_:
            heads = await drains.read_heads(round_, max_groups=max_groups, skip_held=True)
            await drains.run(round_, heads, deadline=math.inf)
    raise AssertionError("the rounds did not empty the table")


async def drain_with_the_toolkit(outbox: Outbox, calls: HandlerCalls, max_groups: int) -> None:
    await drain_outbox_async(outbox.app, outbox.engine)


@pytest.mark.parametrize("drain", [drain_in_rounds, drain_with_the_toolkit])
@settings(
    max_examples=30,
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rows=st.lists(ROW, min_size=1, max_size=60), max_groups=st.integers(1, 4))
async def test_a_drain_handles_each_shard_as_the_model_says(
    outbox: Outbox,
    handler_calls: HandlerCalls,
    drain: Drain,
    rows: list[tuple[int, int, int]],
    max_groups: int,
) -> None:
    await outbox.reset()
    written = await outbox.write(rows)
    await drain(outbox, handler_calls, max_groups)
    assert dict(outbox.calls.by_shard) == coalesced_calls(written)
    # Each call was given its own row's payload: the group's newest.
    assert all(row_id == named for row_id, named in outbox.calls.payloads)
    assert await outbox.pending() == 0


def test_the_model_orders_groups_by_their_lowest_id_not_their_highest() -> None:
    """Object 1 at ids 1 and 5, object 2 at 3: object 1's group comes first, with row 5."""
    one, two = int(Category.PROJECT_UPDATE), int(Category.MEMBER_UPDATE)
    written = [(1, 7, one, 1), (3, 7, two, 2), (5, 7, one, 1)]
    assert coalesced_calls(written) == {7: [(5, 2), (3, 1)]}
