"""The in-process drain of outbox_bridge.testing (drain_outbox, drain_outbox_async,
outbox_runner) against a real PostgreSQL: the worker's order, coalescing and deletion, inside the
caller's transaction, with failures raised or collected, deferred rows, one shard, regional
tables and held shards."""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox_bridge import (
    OutboxApp,
    OutboxMessage,
    OutboxTable,
    PayloadTooLargeError,
    RegistryError,
    UnknownCategoryError,
)
from outbox_bridge.db.schema import owners_of
from outbox_bridge.testing import (
    HandlerFailedError,
    OutboxRunner,
    drain_outbox,
    drain_outbox_async,
    outbox_runner,
)
from tests.harness import (
    SCOPES,
    Category,
    Recorder,
    create_tables,
    fast_settings,
    make_app,
    running_worker,
    table_empty,
    unique_table,
    wait_until,
)


def row(category: Category, shard: int, obj: int, **extra: Any) -> dict[str, Any]:
    return {"category": category, "shard_identifier": shard, "object_identifier": obj, **extra}


class Calls:
    """Plain-def handlers that record what they were given, and the thread they ran in."""

    def __init__(self) -> None:
        self.messages: list[OutboxMessage] = []
        self.threads: list[threading.Thread] = []
        self.fail_on: set[int] = set()  # object identifiers whose handler raises
        self.after: Callable[[OutboxMessage], None] | None = None  # runs after each call

    def __call__(self, message: OutboxMessage) -> None:
        self.threads.append(threading.current_thread())
        if message.object_identifier in self.fail_on:
            raise ValueError(f"cannot replicate object {message.object_identifier}")
        self.messages.append(message)
        if self.after is not None:
            self.after(message)

    def seen(self) -> list[tuple[str, int, int, int]]:
        """(shard, object, id, coalesced) of every call, in order."""
        return [
            (f"{int(m.shard_scope)}:{m.shard_identifier}", m.object_identifier, m.id, m.coalesced)
            for m in self.messages
        ]


async def sync_app(engine: AsyncEngine, *, regional: bool = False) -> tuple[Calls, OutboxApp]:
    calls = Calls()
    app = OutboxApp(
        scopes=SCOPES,
        categories=[Category],
        tables=[OutboxTable(unique_table(), regional=regional)],
    )
    app.handler(*Category)(calls)
    await create_tables(engine, app)
    return calls, app


def write(engine: Engine, app: OutboxApp, rows: list[dict[str, Any]]) -> list[int]:
    with engine.begin() as conn:
        return [app.write(conn, **values) for values in rows]


def count(engine: Engine, app: OutboxApp) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(app.table())).scalar_one())


# -- order, coalescing, deletion --------------------------------------------------------------------


async def test_handles_each_shard_in_order_coalescing_to_the_newest_row(
    engine, sync_engine
) -> None:
    calls, app = await sync_app(engine)
    ids = write(
        sync_engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 10),  # 0
            row(Category.USER_UPDATE, 2, 2),  # 1
            row(Category.ORGANIZATION_UPDATE, 1, 1),  # 2
            row(Category.PROJECT_UPDATE, 1, 10),  # 3: coalesces into 0's group
            row(Category.MEMBER_UPDATE, 1, 5),  # 4
            row(Category.USER_UPDATE, 2, 2),  # 5: coalesces into 1's group
            row(Category.PROJECT_UPDATE, 1, 10),  # 6: into 0's group too
        ],
    )
    report = drain_outbox(app, sync_engine)

    # Shard 1:1 first (its oldest row is the oldest); its groups in the order of their first
    # row, each handled once with its newest row and the count of rows it covers.
    assert calls.seen() == [
        ("1:1", 10, ids[6], 3),
        ("1:1", 1, ids[2], 1),
        ("1:1", 5, ids[4], 1),
        ("2:2", 2, ids[5], 2),
    ]
    assert report.handled == 4 and report.coalesced == 3 and report.rows_deleted == 7
    assert [(s.shard, s.handled, s.coalesced) for s in report.shards] == [
        ("ORGANIZATION:1", 3, 2),
        ("USER:2", 1, 1),
    ]
    assert report.shard("USER:2").ids == [ids[5]]
    assert [m.id for m in report.messages] == [ids[6], ids[2], ids[4], ids[5]]
    message = calls.messages[0]
    assert message.category is Category.PROJECT_UPDATE and message.payload is None
    assert count(sync_engine, app) == 0
    # The handlers ran in the calling thread.
    assert set(calls.threads) == {threading.current_thread()}
    # Nothing left: a second drain does nothing.
    assert drain_outbox(app, sync_engine).shards == []


async def test_deletes_exactly_the_rows_it_handled(engine, sync_engine) -> None:
    """A row written while a group's handler runs stays for the next read, even in the same
    group: only the ids read with the group are deleted."""
    calls, app = await sync_app(engine)
    write(sync_engine, app, [row(Category.PROJECT_UPDATE, 1, 10)])
    late: list[int] = []

    def commit_another(message: OutboxMessage) -> None:
        if not late:  # another process commits a row of the same group meanwhile
            late.extend(write(sync_engine, app, [row(Category.PROJECT_UPDATE, 1, 10)]))

    calls.after = commit_another
    report = drain_outbox(app, sync_engine)
    assert [m.id for m in report.messages] == [calls.messages[0].id, late[0]]
    assert [m.coalesced for m in report.messages] == [1, 1]
    assert count(sync_engine, app) == 0


async def test_rows_the_handlers_write_are_handled_in_the_same_drain(engine, sync_engine) -> None:
    calls, app = await sync_app(engine)

    def fan_out(message: OutboxMessage) -> None:
        if message.category is Category.ORGANIZATION_UPDATE:  # to a user's shard
            write(sync_engine, app, [row(Category.USER_UPDATE, 7, 7)])

    calls.after = fan_out
    write(sync_engine, app, [row(Category.ORGANIZATION_UPDATE, 1, 1)])
    report = drain_outbox(app, sync_engine)
    assert [s.shard for s in report.shards] == ["ORGANIZATION:1", "USER:7"]
    assert count(sync_engine, app) == 0


async def test_the_same_outcome_as_the_worker(servers, engine, sync_engine) -> None:
    """The same rows in two tables, one drained in-process, the other by a real worker: each
    shard sees the same calls (object, coalesced count) in the same order."""
    rows = [
        row(category, shard, obj)
        for shard in (1, 2)
        for category, obj in [
            (Category.PROJECT_UPDATE, 10),
            (Category.MEMBER_UPDATE, 3),
            (Category.PROJECT_UPDATE, 11),
            (Category.PROJECT_UPDATE, 10),
            (Category.ORGANIZATION_UPDATE, shard),
            (Category.MEMBER_UPDATE, 3),
            (Category.PROJECT_UPDATE, 10),
        ]
    ]
    calls, app = await sync_app(engine)
    write(sync_engine, app, rows)
    drain_outbox(app, sync_engine)

    recorder = Recorder()
    worker_app = make_app(unique_table(), recorder)
    await create_tables(engine, worker_app)
    write(sync_engine, worker_app, rows)
    async with running_worker(servers, worker_app, fast_settings()):
        await wait_until(lambda: table_empty(engine, worker_app), what="the worker's drain")

    def per_shard(seen: list[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
        shards: dict[str, list[tuple[int, int]]] = {}
        for shard, obj, coalesced in seen:
            shards.setdefault(shard, []).append((obj, coalesced))
        return shards

    in_process = per_shard([(s, o, c) for s, o, _, c in calls.seen()])
    worker = per_shard([(c.shard, c.object_identifier, c.coalesced) for c in recorder.calls])
    assert in_process == worker
    assert in_process["1:1"] == [(10, 3), (3, 2), (11, 1), (1, 1)]


# -- the caller's transaction ----------------------------------------------------------------------


async def test_runs_in_the_callers_transaction_and_rolls_back_with_it(engine, sync_engine) -> None:
    _calls, app = await sync_app(engine)
    committed = write(sync_engine, app, [row(Category.USER_UPDATE, 1, 1)])
    with sync_engine.connect() as conn:
        uncommitted = app.write(conn, **row(Category.USER_UPDATE, 2, 2))
        report = drain_outbox(app, conn)
        # It saw the transaction's own row, and deleted both in the transaction.
        assert sorted(report.shard(s).ids[0] for s in ("USER:1", "USER:2")) == sorted(
            [*committed, uncommitted]
        )
        assert conn.execute(select(func.count()).select_from(app.table())).scalar_one() == 0
        assert count(sync_engine, app) == 1  # not committed: another connection sees the row
        conn.rollback()
    assert count(sync_engine, app) == 1  # the committed row is back, the other never was


async def test_the_callers_transaction_keeps_its_settings(engine, sync_engine) -> None:
    """The worker's rounds commit their deletes asynchronously, each in a transaction of its
    own; a drain in the caller's transaction must not make the caller's commit asynchronous."""
    _calls, app = await sync_app(engine)
    write(sync_engine, app, [row(Category.USER_UPDATE, 1, 1)])
    with sync_engine.connect() as conn:
        before = conn.execute(text("SHOW synchronous_commit")).scalar_one()
        assert drain_outbox(app, conn).rows_deleted == 1
        assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == before
        conn.rollback()


async def test_a_session_is_flushed_and_its_transaction_used(engine, sync_engine) -> None:
    _calls, app = await sync_app(engine)
    with Session(sync_engine) as session:
        app.write(session, **row(Category.ORGANIZATION_UPDATE, 3, 3))
        report = drain_outbox(app, session)
        assert report.handled == 1
        session.rollback()
    assert count(sync_engine, app) == 0


async def test_outbox_runner_drains_when_the_block_ends(engine, sync_engine) -> None:
    calls, app = await sync_app(engine)
    with Session(sync_engine) as session:
        with outbox_runner(app, session) as runner:
            app.write(session, **row(Category.ORGANIZATION_UPDATE, 3, 3))
            assert calls.messages == []
        assert runner.report is not None and runner.report.handled == 1
        session.commit()
    assert count(sync_engine, app) == 0
    # A block that raises does not drain.
    with pytest.raises(KeyError), Session(sync_engine) as session:
        with outbox_runner(app, session):
            app.write(session, **row(Category.ORGANIZATION_UPDATE, 3, 3))
            raise KeyError("the test failed")
    assert len(calls.messages) == 1


# -- failures ----------------------------------------------------------------------------------------


async def test_a_failing_handler_raises_with_its_row_and_its_traceback(engine, sync_engine) -> None:
    calls, app = await sync_app(engine)
    calls.fail_on = {10}
    ids = write(
        sync_engine,
        app,
        [
            row(Category.ORGANIZATION_UPDATE, 1, 1),
            row(Category.PROJECT_UPDATE, 1, 10),
            row(Category.PROJECT_UPDATE, 1, 10),
            row(Category.MEMBER_UPDATE, 1, 5),
        ],
    )
    with pytest.raises(HandlerFailedError) as raised:
        drain_outbox(app, sync_engine)
    error = raised.value
    assert isinstance(error.__cause__, ValueError)
    assert error.failure.message.id == ids[2] and error.failure.row_ids == (ids[1], ids[2])
    assert error.failure.shard == "ORGANIZATION:1" and error.failure.category == "PROJECT_UPDATE"
    assert str(error) == (
        f"the handler of PROJECT_UPDATE failed on row {ids[2]} of {app.table().name} "
        "(shard ORGANIZATION:1, object 10, 2 rows coalesced): "
        "ValueError: cannot replicate object 10"
    )
    # The test's traceback goes down into the handler.
    printed = "".join(traceback.format_exception(error))
    assert "in __call__" in printed and "cannot replicate object 10" in printed
    # What came before was handled and deleted; the failed group and what follows are kept.
    assert error.report.handled == 1 and error.report.shard("ORGANIZATION:1").ids == [ids[0]]
    assert count(sync_engine, app) == 3


async def test_failures_collected_stop_their_shard_only(engine, sync_engine) -> None:
    calls, app = await sync_app(engine)
    calls.fail_on = {10}
    write(
        sync_engine,
        app,
        [
            row(Category.ORGANIZATION_UPDATE, 1, 1),
            row(Category.PROJECT_UPDATE, 1, 10),
            row(Category.MEMBER_UPDATE, 1, 5),
            row(Category.USER_UPDATE, 2, 2),
        ],
    )
    report = drain_outbox(app, sync_engine, raise_on_failure=False)
    [failure] = report.failures
    assert failure.shard == "ORGANIZATION:1" and isinstance(failure.error, ValueError)
    assert report.shard("ORGANIZATION:1").failure is failure
    assert [m.object_identifier for m in report.messages] == [1, 2]  # 5 waits behind 10
    assert count(sync_engine, app) == 2
    # Fixed, the shard goes on from its failed head.
    calls.fail_on = set()
    assert [m.object_identifier for m in drain_outbox(app, sync_engine).messages] == [10, 5]


async def test_a_row_without_a_handler_is_a_failure(engine, sync_engine) -> None:
    _calls, app = await sync_app(engine)
    with sync_engine.begin() as conn:
        conn.execute(
            insert(app.table()).values(
                shard_scope=1, shard_identifier=1, category=99, object_identifier=1
            )
        )
    with pytest.raises(HandlerFailedError) as raised:
        drain_outbox(app, sync_engine)
    assert isinstance(raised.value.__cause__, UnknownCategoryError)
    assert raised.value.failure.category == "UNKNOWN_CATEGORY_99"


async def test_a_payload_over_the_app_s_limit_is_a_failure_left_unread(engine, sync_engine) -> None:
    """As in the worker: a row written with SQL past the app's payload limit is not read."""
    calls, app = await sync_app(engine)
    with sync_engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {app.table().name} (shard_scope, shard_identifier, category, "
                "object_identifier, payload) VALUES (1, 1, :category, 1, "
                "jsonb_build_object('b', repeat('x', :chars)))"
            ),
            {"category": int(Category.PROJECT_UPDATE), "chars": app.max_payload_bytes},
        )
    with pytest.raises(HandlerFailedError) as raised:
        drain_outbox(app, sync_engine)
    assert isinstance(raised.value.__cause__, PayloadTooLargeError)
    assert "over the limit of 1 MiB" in str(raised.value.__cause__)
    assert raised.value.failure.message.payload is None and calls.messages == []


# -- deferred rows, one shard, held shards ----------------------------------------------------------


async def test_a_deferred_row_holds_its_shard_unless_run_deferred(engine, sync_engine) -> None:
    _calls, app = await sync_app(engine)
    ids = write(
        sync_engine,
        app,
        [
            row(Category.PROJECT_UPDATE, 1, 10),
            row(Category.PROJECT_UPDATE, 1, 11, scheduled_for=timedelta(hours=1)),
            row(Category.PROJECT_UPDATE, 1, 10),  # behind the deferred row: no coalescing
            row(Category.USER_UPDATE, 2, 2),
        ],
    )
    report = drain_outbox(app, sync_engine)
    held = report.shard("ORGANIZATION:1")
    assert held.ids == [ids[0]] and held.deferred_until is not None
    assert report.shard("USER:2").ids == [ids[3]]
    assert count(sync_engine, app) == 2

    report = drain_outbox(app, sync_engine, run_deferred=True)
    assert report.shard("ORGANIZATION:1").ids == [ids[1], ids[2]]
    assert report.shard("ORGANIZATION:1").deferred_until is None
    assert count(sync_engine, app) == 0


async def test_only_the_shard_asked_for(engine, sync_engine) -> None:
    _calls, app = await sync_app(engine)
    write(sync_engine, app, [row(Category.USER_UPDATE, 2, 2), row(Category.USER_UPDATE, 3, 3)])
    report = drain_outbox(app, sync_engine, shard="USER:3")
    assert [s.shard for s in report.shards] == ["USER:3"]
    assert count(sync_engine, app) == 1


async def test_regional_tables(engine, sync_engine) -> None:
    calls, app = await sync_app(engine, regional=True)
    write(
        sync_engine,
        app,
        [
            row(Category.USER_UPDATE, 2, 2, region="eu"),
            row(Category.USER_UPDATE, 2, 2, region="us"),
            row(Category.USER_UPDATE, 2, 2, region="eu:west"),
        ],
    )
    report = drain_outbox(app, sync_engine, shard="eu:west:USER:2")
    assert [(s.shard, s.handled) for s in report.shards] == [("eu:west:USER:2", 1)]
    assert calls.messages[0].region == "eu:west"
    report = drain_outbox(app, sync_engine)
    assert [s.shard for s in report.shards] == ["eu:USER:2", "us:USER:2"]
    assert [m.region for m in report.messages] == ["eu", "us"]


async def test_a_skipped_shard_is_left_alone_and_a_held_one_drained(engine, sync_engine) -> None:
    _calls, app = await sync_app(engine)
    write(sync_engine, app, [row(Category.USER_UPDATE, 2, 2), row(Category.USER_UPDATE, 3, 3)])
    owners = owners_of(app.table())
    with sync_engine.begin() as conn:
        conn.execute(
            insert(owners),
            [
                {"shard_scope": 2, "shard_identifier": 2, "held_for": "skipped"},
                {"shard_scope": 2, "shard_identifier": 3, "held_for": "workflow"},
            ],
        )
    report = drain_outbox(app, sync_engine)
    assert [(s.shard, s.skipped, s.handled) for s in report.shards] == [
        ("USER:2", True, 0),
        ("USER:3", False, 1),
    ]
    assert count(sync_engine, app) == 1


# -- async ------------------------------------------------------------------------------------------


async def async_app(engine: AsyncEngine) -> tuple[Recorder, OutboxApp]:
    recorder = Recorder()
    app = make_app(unique_table(), recorder)
    await create_tables(engine, app)
    return recorder, app


async def test_async_drain_with_an_engine(engine) -> None:
    recorder, app = await async_app(engine)
    async with engine.begin() as conn:
        ids = [
            await app.write_async(conn, **values)
            for values in [
                row(Category.PROJECT_UPDATE, 1, 10),
                row(Category.ORGANIZATION_UPDATE, 1, 1),
                row(Category.PROJECT_UPDATE, 1, 10),
            ]
        ]
    report = await drain_outbox_async(app, engine)
    assert [(c.id, c.coalesced) for c in recorder.calls] == [(ids[2], 2), (ids[1], 1)]
    assert report.handled == 2 and report.coalesced == 1
    assert await table_empty(engine, app)


async def test_async_drain_in_a_transaction_rolled_back(engine) -> None:
    recorder, app = await async_app(engine)
    async with engine.connect() as conn:
        await app.write_async(conn, **row(Category.USER_UPDATE, 4, 4))
        report = await drain_outbox_async(app, conn)
        assert report.handled == 1
        await conn.rollback()
    assert await table_empty(engine, app) and len(recorder.calls) == 1


async def test_async_drain_with_a_session_raises_on_failure(engine) -> None:
    recorder, app = await async_app(engine)

    async def fails(message: OutboxMessage) -> None:
        raise ConnectionError("replica unavailable")

    recorder.behaviour[Category.MEMBER_UPDATE] = fails
    async with AsyncSession(engine) as session:
        await app.write_async(session, **row(Category.ORGANIZATION_UPDATE, 1, 1))
        failed = await app.write_async(session, **row(Category.MEMBER_UPDATE, 1, 5))
        with pytest.raises(HandlerFailedError) as raised:
            await drain_outbox_async(app, session)
        assert isinstance(raised.value.__cause__, ConnectionError)
        assert raised.value.failure.message.id == failed
        assert [c.object_identifier for c in recorder.calls] == [1]
        report = await drain_outbox_async(app, session, raise_on_failure=False)
        assert [f.message.id for f in report.failures] == [failed]
        await session.rollback()


async def test_async_runner_and_plain_def_handlers_in_a_thread(engine) -> None:
    calls = Calls()
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    app.handler(*Category)(calls)
    await create_tables(engine, app)
    async with AsyncSession(engine) as session:
        async with outbox_runner(app, session) as runner:
            await app.write_async(session, **row(Category.USER_UPDATE, 4, 4))
        await session.commit()
    assert runner.report is not None and runner.report.handled == 1
    [thread] = calls.threads
    assert thread is not threading.current_thread()  # as the worker runs plain-def handlers


# -- misuse ----------------------------------------------------------------------------------------


async def test_the_wrong_kind_of_bind_says_which_drain_to_use(engine, sync_engine) -> None:
    _calls, app = await sync_app(engine)
    with pytest.raises(TypeError, match="drain_outbox_async"):
        drain_outbox(app, engine)
    with pytest.raises(TypeError, match=r"drain_outbox\(\)"):
        await drain_outbox_async(app, sync_engine)


async def test_an_async_handler_in_the_sync_drain(engine, sync_engine) -> None:
    recorder, app = await async_app(engine)
    write(sync_engine, app, [row(Category.USER_UPDATE, 4, 4)])
    # An event loop runs in this thread (an async test): the sync drain cannot run it.
    with pytest.raises(TypeError, match="drain_outbox_async"):
        drain_outbox(app, sync_engine)
    # In a thread without a loop, the drain runs it on a loop of its own.
    report = await asyncio.to_thread(drain_outbox, app, sync_engine)
    assert report.handled == 1 and len(recorder.calls) == 1


def test_an_unknown_shard_name_is_refused() -> None:
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    with pytest.raises(RegistryError, match="unknown scope"):
        drain_outbox(app, create_engine("postgresql+psycopg://"), shard="TEAM:1")


def test_a_misspelled_runner_option_is_refused_when_the_runner_is_made() -> None:
    """Not when its block ends, after the code under test ran."""
    app = OutboxApp(scopes=SCOPES, categories=[Category], tables=[OutboxTable(unique_table())])
    bind = create_engine("postgresql+psycopg://")
    for make in (outbox_runner, OutboxRunner):
        with pytest.raises(TypeError, match="shrad"):
            make(app, bind, shrad="ORGANIZATION:1")  # type: ignore[call-arg]


async def test_plain_sql_rows_are_handled(engine, sync_engine) -> None:
    """Rows written without the registry (another language's INSERT) are drained too."""
    calls, app = await sync_app(engine)
    with sync_engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO {app.table().name} (shard_scope, shard_identifier, category, "
                "object_identifier, payload) VALUES (2, 9, 10, 9, '{\"a\": 1}')"
            )
        )
    drain_outbox(app, sync_engine)
    assert [m.payload for m in calls.messages] == [{"a": 1}]
