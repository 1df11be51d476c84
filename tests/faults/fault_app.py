"""The OutboxApp that the fault scenarios run in a real worker process
(``--app tests.faults.fault_app:app``).

Its table is ``$FAULT_OUTBOX_TABLE``. Every handler call is recorded in ``fault_calls`` (see
:mod:`tests.faults.history`) on the handler's own connection, committed before the handler
returns or raises, with what the message told it (the row's id, shard, group, and a digest of
its payload), the calling process and a per-process sequence number. What a handler
does is steered by the test through ``fault_control`` (read at most every 0.2 s): a random share
of calls fails, the shards listed as poison always fail, the objects listed as hanging hang
once, past the handler timeout (the process that took each hang is noted), and every call in a shard listed as slow takes a while (so that
a test can act while a drain is in the middle of that shard).

ORGANIZATION categories have plain ``def`` handlers (run in a thread by the worker), the USER
category an ``async def`` one.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import random
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import IntEnum

import psycopg

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.config import libpq_url, sqlalchemy_url

# Written into every payload and every injected error message: personal data that must never
# reach Temporal history (the error message only with OUTBOX_REDACT_ERRORS).
PAYLOAD_CANARY = "payload-canary-5e1f"
ERROR_CANARY = "error-canary-9b2d"


class FaultScope(IntEnum):
    ORGANIZATION = 1
    USER = 2


class FaultCategory(IntEnum):
    ORGANIZATION_UPDATE = 1
    PROJECT_UPDATE = 2
    MEMBER_UPDATE = 3
    USER_UPDATE = 10


# Annotated: a dict of the app's own enums is not a Mapping[IntEnum, ...] to mypy (Mapping's
# key type is invariant), see tests/test_lint.py.
SCOPES: Mapping[IntEnum, Iterable[IntEnum]] = {
    FaultScope.ORGANIZATION: [
        FaultCategory.ORGANIZATION_UPDATE,
        FaultCategory.PROJECT_UPDATE,
        FaultCategory.MEMBER_UPDATE,
    ],
    FaultScope.USER: [FaultCategory.USER_UPDATE],
}


class InjectedFault(RuntimeError):
    """A handler failure injected at random."""


class PoisonError(RuntimeError):
    """A handler failure of a poison shard: fails until the test fixes it."""


@dataclass
class Control:
    failure_rate: float = 0.0
    poison_shards: frozenset[int] = frozenset()
    hang_objects: frozenset[int] = frozenset()
    hang_seconds: float = 0.0
    slow_shards: frozenset[int] = frozenset()
    slow_seconds: float = 0.0
    read_at: float = field(default=-1.0)


_local = threading.local()
_process_seq = itertools.count(1)
RECORDER_NAME = "fault-recorder"  # application_name of the handlers' recording connections
_seq_lock = threading.Lock()
_control = Control()
_control_lock = threading.Lock()


def _database_url() -> str:
    url = os.environ.get("OUTBOX_DATABASE_URL")
    if not url:
        raise RuntimeError("tests.faults.fault_app records its calls in OUTBOX_DATABASE_URL")
    return libpq_url(sqlalchemy_url(url))


def _connection() -> psycopg.Connection[tuple[object, ...]]:
    """This thread's own connection (autocommit), opened again after a failure."""
    conn: psycopg.Connection[tuple[object, ...]] | None = getattr(_local, "conn", None)
    if conn is None or conn.closed or conn.broken:
        # Named apart from the worker's own connections, which a scenario may terminate.
        conn = psycopg.connect(
            _database_url(), autocommit=True, connect_timeout=5, application_name=RECORDER_NAME
        )
        _local.conn = conn
    return conn


def _execute(statement: str, params: tuple[object, ...]) -> list[tuple[object, ...]]:
    try:
        cursor = _connection().execute(statement, params)
        return cursor.fetchall() if cursor.description else []
    except psycopg.Error:
        conn = getattr(_local, "conn", None)
        if conn is not None:
            conn.close()
        _local.conn = None
        raise


def control(table: str) -> Control:
    """The test's current instructions, read again at most every 0.2 s."""
    global _control
    with _control_lock:
        if time.monotonic() - _control.read_at < 0.2:
            return _control
        rows = _execute(
            "SELECT failure_rate, poison_shards, hang_objects, hang_seconds, slow_shards, "
            "slow_seconds FROM fault_control WHERE outbox_table = %s",
            (table,),
        )
        if rows:
            rate, poison, hang, seconds, slow, slow_seconds = rows[0]
            _control = Control(
                float(rate),  # type: ignore[arg-type]
                frozenset(poison),  # type: ignore[call-overload]
                frozenset(hang),  # type: ignore[call-overload]
                float(seconds),  # type: ignore[arg-type]
                frozenset(slow),  # type: ignore[call-overload]
                float(slow_seconds),  # type: ignore[arg-type]
                time.monotonic(),
            )
        else:
            _control = Control(read_at=time.monotonic())
        return _control


def _take_hang(table: str, object_identifier: int) -> bool:
    """Whether this call is the one that hangs for ``object_identifier`` (each hangs once)."""
    rows = _execute(
        "UPDATE fault_control SET hang_objects = array_remove(hang_objects, %s), "
        "hung_pids = array_append(hung_pids, %s) "
        "WHERE outbox_table = %s AND %s = ANY(hang_objects) RETURNING 1",
        (object_identifier, os.getpid(), table, object_identifier),
    )
    with _control_lock:
        _control.read_at = -1.0
    return bool(rows)


def payload_digest(payload: object) -> str:
    """A digest of a JSON payload that does not depend on how it was encoded (key order,
    spacing): the handler records it for the payload it was given, the check computes it for
    the payload each row was committed with."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def record(message: OutboxMessage, handler: str, started: float, outcome: str) -> int:
    """Log one handler call, committed before the handler returns (or raises); returns its
    ``seq``."""
    with _seq_lock:
        process_seq = next(_process_seq)
    payload = message.payload
    [(seq,)] = _execute(
        "INSERT INTO fault_calls (outbox_table, row_id, shard_scope, shard_identifier, "
        "category, object_identifier, coalesced, pid, process_seq, started, finished, "
        "outcome, handler, region, payload_type, payload_bytes, payload_digest) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
        "RETURNING seq",
        (
            TABLE,
            message.id,
            int(message.shard_scope),
            message.shard_identifier,
            int(message.category),
            message.object_identifier,
            message.coalesced,
            os.getpid(),
            process_seq,
            started,
            time.time(),
            outcome,
            handler,
            message.region,
            type(payload).__name__,
            len(json.dumps(payload)) if payload is not None else None,
            payload_digest(payload),
        ),
    )
    assert isinstance(seq, int)
    return seq


_recorder = ThreadPoolExecutor(8, thread_name_prefix="fault-record")


async def record_async(message: OutboxMessage, started: float, outcome: str) -> None:
    """:func:`record` for an async handler, in a thread. The handler still runs while the
    thread records: if its attempt is cancelled meanwhile, the handler raises CancelledError
    (what the library sees) instead of ending as recorded, so the call is marked cancelled,
    or a successful-looking call would cover rows that the library did not consider handled."""
    recording = _recorder.submit(record, message, "async", started, outcome)
    try:
        await asyncio.shield(asyncio.wrap_future(recording))
    except asyncio.CancelledError:
        seq = recording.result()  # blocking, but the call must not be recorded wrongly
        _execute("UPDATE fault_calls SET outcome = 'cancelled' WHERE seq = %s", (seq,))
        raise


def _decide(message: OutboxMessage) -> tuple[float, BaseException | None]:
    """How long this call hangs (or takes, in a slow shard), and what it raises."""
    current = control(TABLE)
    hang = 0.0
    if message.object_identifier in current.hang_objects and _take_hang(
        TABLE, message.object_identifier
    ):
        hang = current.hang_seconds
    elif message.shard_identifier in current.slow_shards:
        hang = current.slow_seconds
    if message.shard_identifier in current.poison_shards:
        return hang, PoisonError(f"poison shard {message.shard_identifier} ({ERROR_CANARY})")
    if current.failure_rate and random.random() < current.failure_rate:
        return hang, InjectedFault(f"injected failure of row {message.id} ({ERROR_CANARY})")
    return hang, None


def handle_sync(message: OutboxMessage) -> None:
    started = time.time()
    hang, error = _decide(message)
    if hang:
        time.sleep(hang)  # a thread cannot be interrupted: the stale attempt keeps running
    record(message, "sync", started, "failed" if error else "ok")
    if error is not None:
        raise error


async def handle_async(message: OutboxMessage) -> None:
    started = time.time()
    hang, error = await asyncio.to_thread(_decide, message)
    try:
        if hang:
            await asyncio.sleep(hang)  # cancelled when its attempt times out
    except asyncio.CancelledError:
        record(message, "async", started, "cancelled")  # blocking, but it must not be lost
        raise
    await record_async(message, started, "failed" if error else "ok")
    if error is not None:
        raise error


def make_app(table: str) -> OutboxApp:
    app = OutboxApp(scopes=SCOPES, categories=[FaultCategory], tables=[OutboxTable(table)])
    app.handler(
        FaultCategory.ORGANIZATION_UPDATE,
        FaultCategory.PROJECT_UPDATE,
        FaultCategory.MEMBER_UPDATE,
    )(handle_sync)
    app.handler(FaultCategory.USER_UPDATE)(handle_async)
    return app


TABLE = os.environ.get("FAULT_OUTBOX_TABLE", "fault_outbox")
app = make_app(TABLE)
