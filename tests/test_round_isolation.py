"""Shards share a drain round, never a fate: whatever one row or one shard does (a payload the
worker cannot decode, an exception at any step of the round), the round's other shards are
handled in that round, and the failing shard is held by its own workflow with a specific
reason, its rows kept.

First a partition's rounds against a real PostgreSQL with a failure injected at each step for
one shard among several; then a real worker with an undecodable payload among 300 healthy
shards, as ``status`` and ``shards`` show it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import text

from outbox_bridge import OutboxMessage
from outbox_bridge.db.locks import lock_key
from outbox_bridge.db.ownership import read_held_shards
from outbox_bridge.db.writes import DriverWrites
from outbox_bridge.observability.observe import RoundObserver
from outbox_bridge.runtime import calls as calls_module
from outbox_bridge.runtime import heads as heads_module
from outbox_bridge.runtime import rounds as rounds_module
from outbox_bridge.runtime.calls import HandlerCalls
from outbox_bridge.runtime.hub import ShardHub
from outbox_bridge.runtime.partition_drain import PartitionDrain
from outbox_bridge.runtime.rounds import DrainEngine
from outbox_bridge.workflows.models import (
    HeldFor,
    PartitionDrainInput,
    PartitionOptions,
    PartitionRef,
    ShardRef,
)
from tests.harness import (
    Category,
    fast_settings,
    fresh_app,
    lock_holders,
    running_worker,
    sql,
    wait_until,
    write_rows,
)
from tests.otel import span_exporter
from tests.test_cli_shards import cli
from tests.test_rounds import RecordedHandovers

# Nested deeper than Python's JSON decoder goes: PostgreSQL stores it, json.loads raises
# RecursionError.
DEEP = 10_000
HEALTHY_SHARDS = 300
BAD_SHARD = 7_000


async def test_an_undecodable_payload_blocks_its_shard_and_300_others_drain(
    servers, engine
) -> None:
    """A row whose payload PostgreSQL stores and Python cannot decode (JSON nested 10,000
    deep), committed before 300 healthy shards' rows: every healthy row is handled, and the
    bad shard is blocked on its row with a clear reason that ``status`` and ``shards`` show
    (never the payload), its row kept."""
    recorder, table, app = await fresh_app(engine)
    deep = "[" * DEEP + "]" * DEEP
    async with running_worker(servers, app, fast_settings()):
        await sql(
            engine,
            f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier, "
            "payload) VALUES (1, :shard, :category, 1, CAST(:payload AS jsonb))",
            shard=BAD_SHARD,
            category=int(Category.PROJECT_UPDATE),
            payload=deep,
        )
        await sql(
            engine,
            f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier, "
            "payload) SELECT 1, n, :category, 1, jsonb_build_object('n', n) "
            "FROM generate_series(1, :shards) AS n",
            category=int(Category.PROJECT_UPDATE),
            shards=HEALTHY_SHARDS,
        )
        await wait_until(
            lambda: len({c.shard for c in recorder.calls}) == HEALTHY_SHARDS,
            timeout=60,
            what="every healthy shard",
        )

        shown: dict[str, Any] = {}

        async def shown_blocked() -> bool:
            code, out, _ = await cli(
                servers, table, "status", f"ORGANIZATION:{BAD_SHARD}", "--json"
            )
            if code == 0:
                shown.update(json.loads(out))
            return code == 0 and shown["state"] == "blocked" and bool(shown["last_error"])

        await wait_until(shown_blocked, timeout=60, interval=0.5, what="the bad shard blocked")
        status = shown
        error = status["last_error"]
        assert error["error_type"] == "PayloadDecodeError"
        assert "payload of row" in error["message"] and "RecursionError" in error["message"]
        assert "[[[" not in error["message"]  # never the payload itself
        code, out, err = await cli(servers, table, "shards", "--json")
        assert code == 0, err
        listed = {entry["shard"]: entry for entry in json.loads(out)}
        assert listed[f"ORGANIZATION:{BAD_SHARD}"]["state"] == "blocked"
        assert listed[f"ORGANIZATION:{BAD_SHARD}"]["rows"] == 1
        async with engine.connect() as conn:
            left = (await conn.execute(text(f"SELECT shard_identifier FROM {table}"))).scalars()
            assert list(left) == [BAD_SHARD]  # its row is kept, every healthy row handled
    assert all(c.shard != f"1:{BAD_SHARD}" for c in recorder.calls)


# -- a failure injected at each step of a round -----------------------------------------------------

BAD = 99  # the shard the failure is injected for
HEALTHY = range(1, 6)
BAD_ROWS = 20  # over 3 objects: more than the round's window, and more groups than it takes


class InjectedFault(Exception):
    """What the test makes one step of the round raise for the bad shard."""


@dataclass(frozen=True)
class Step:
    name: str
    error_type: str  # of the failure the bad shard is handed over with
    says: str  # in its message
    rows_left: str = "all"  # of the bad shard's rows: "all", or "unhandled" (a group left)


STEPS = [
    Step("read windows", "ShardFaultError", "its rows cannot be read: InjectedFault"),
    Step("read tails", "ShardFaultError", "its rows cannot be read: InjectedFault"),
    Step("read payload sizes", "ShardFaultError", "its rows cannot be read: InjectedFault"),
    Step("read rows", "ShardFaultError", "its rows cannot be read: InjectedFault"),
    Step("decode", "PayloadDecodeError", "cannot be decoded: RecursionError"),
    Step("read trace contexts", "ShardFaultError", "its calls cannot be observed"),
    Step("build message", "ShardFaultError", "its head groups cannot be prepared"),
    Step("call handler", "InjectedFault", "the handler of shard 99 failed"),
    Step("observe call", "InjectedFault", "injected into RoundObserver.call"),
    Step("delete", "ShardFaultError", "its handled rows cannot be deleted: InjectedFault"),
    Step("unlock", "ShardFaultError", "its lock cannot be released: InjectedFault", "unhandled"),
]


def failing(original: Callable[..., Any], bad: Callable[..., bool]) -> Callable[..., Any]:
    """``original`` (a function or a coroutine function), raising InjectedFault whenever
    ``bad(*args)``."""

    def check(args: tuple[Any, ...]) -> None:
        if bad(*args):
            raise InjectedFault(f"injected into {original.__qualname__}")

    if inspect.iscoroutinefunction(original):

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            check(args)
            return await original(*args, **kwargs)

        return functools.wraps(original)(wrapper)

    def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
        check(args)
        return original(*args, **kwargs)

    return functools.wraps(original)(sync_wrapper)


def inject(step: str, monkeypatch: pytest.MonkeyPatch, bad_ids: set[int]) -> None:
    """Make ``step`` fail for the bad shard alone (whatever else its statement reads)."""

    def any_bad(shards: Any) -> bool:
        return any(s.shard_identifier == BAD for s in shards)

    def bad_id(ids: Any) -> bool:
        return bool(set(ids) & bad_ids)

    # step: where its function is looked up, its name there, and when it fails (given the
    # function's positional arguments)
    where: dict[str, tuple[object, str, Callable[..., bool]]] = {
        "read windows": (heads_module, "read_windows", lambda c, t, shards: any_bad(shards)),
        "read tails": (
            heads_module,
            "read_group_tails",
            lambda c, t, tails: any_bad(tail.shard for tail in tails),
        ),
        "read payload sizes": (heads_module, "read_payload_sizes", lambda c, t, ids: bad_id(ids)),
        "read rows": (heads_module, "read_rows", lambda c, t, ids: bad_id(ids)),
        "read trace contexts": (
            rounds_module,
            "read_trace_contexts",
            lambda c, t, ids: bad_id(ids),
        ),
        "build message": (
            calls_module,
            "_message",
            lambda app, group, row, *_: row.shard_identifier == BAD,
        ),
        "observe call": (
            RoundObserver,
            "call",
            lambda observer, *_: observer.shard.shard_identifier == BAD,
        ),
        "delete": (DriverWrites, "delete_handled", lambda writes, driver, ids: bad_id(ids)),
        "unlock": (DriverWrites, "unlock_shards", lambda writes, driver, shards: any_bad(shards)),
    }
    if step in where:
        owner, name, bad = where[step]
        monkeypatch.setattr(owner, name, failing(getattr(owner, name), bad))


@pytest.mark.parametrize("step", STEPS, ids=[step.name for step in STEPS])
async def test_a_failure_at_any_step_of_a_round_holds_only_its_shard(
    engine, monkeypatch, step: Step
) -> None:
    """Five healthy shards and one bad shard in one partition round, a failure injected for
    the bad shard alone at one step: that round handles every healthy row, and hands the bad
    shard over to its workflow, held, with why (never its payload), its rows kept."""
    recorder, table, app = await fresh_app(engine)
    healthy = await write_rows(
        engine,
        app,
        [
            {
                "category": Category.PROJECT_UPDATE,
                "shard_identifier": shard,
                "object_identifier": obj,
            }
            for shard in HEALTHY
            for obj in (1, 2)
        ],
    )
    bad = await write_rows(
        engine,
        app,
        [
            {
                "category": Category.PROJECT_UPDATE,
                "shard_identifier": BAD,
                "object_identifier": n % 3 + 1,
                "payload": {"n": n},
            }
            for n in range(BAD_ROWS)
        ],
    )
    first_group = [i for n, i in enumerate(bad) if n % 3 == 0]
    unhandled = [i for n, i in enumerate(bad) if n % 3 == 2]  # the group the round leaves
    if step.name == "decode":
        deep = "[" * 10_000 + "]" * 10_000
        await sql(
            engine,
            f"UPDATE {table} SET payload = CAST(:deep AS jsonb) WHERE id = :id",
            deep=deep,
            id=first_group[-1],  # the newest row of the first group: its handler's
        )

    async def fail_the_bad_shard(message: OutboxMessage) -> None:
        if message.shard_identifier == BAD:
            raise InjectedFault(f"the handler of shard {BAD} failed")

    if step.name == "call handler":
        recorder.behaviour[int(Category.PROJECT_UPDATE)] = fail_the_bad_shard
    inject(step.name, monkeypatch, set(bad))
    shards = [ShardRef(table, 1, "ORGANIZATION", n) for n in [*HEALTHY, BAD]]
    calls = HandlerCalls(app, redact_errors=False, threads=2)
    starter = RecordedHandovers()
    drain = PartitionDrain(
        DrainEngine(engine, app, calls=calls),
        starter,  # type: ignore[arg-type]
        ShardHub(),
        # A round of all six shards, two groups of each.
        PartitionDrainInput(
            PartitionRef(table, 0, 1), PartitionOptions(max_shards=6, max_groups=2)
        ),
    )
    tracing = span_exporter() if step.name == "read trace contexts" else contextlib.nullcontext()
    try:
        with tracing:
            await drain._round(shards)
    finally:
        calls.close()

    # Every healthy row was handled and deleted in that one round.
    handled = {call.id for call in recorder.calls if call.shard != f"1:{BAD}"}
    assert handled == set(healthy)
    async with engine.connect() as conn:
        left = set((await conn.execute(text(f"SELECT id FROM {table}"))).scalars())
        held = {s.shard_identifier: s.held_for for s in await read_held_shards(conn, app.table())}
    # The bad shard's rows are kept (with the unlock, the round had handled two groups).
    assert left == (set(bad) if step.rows_left == "all" else set(unhandled))
    assert held == {BAD: HeldFor.FAILED}
    [(shard, handover)] = starter.handovers
    assert shard == shards[-1] and handover.held_for == HeldFor.FAILED
    assert handover.failure is not None
    assert handover.failure.error_type == step.error_type
    assert step.says in handover.failure.message
    assert "[[" not in handover.failure.message  # never the payload
    if step.name != "unlock":  # the unlock fails once the shard's groups are done
        assert handover.head is not None and handover.head.first_id == first_group[0]
    assert await lock_holders(engine, lock_key(shards[-1])) == []
