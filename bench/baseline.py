"""The baseline: a direct drain in PostgreSQL, with no Temporal in the way.

``threads`` threads, each with its own psycopg 3 sync connection, own a fixed partition of the
shards (``mod(shard_identifier + shard_scope, threads)``), so a shard is never handled by two
threads and its rows are handled in order. Each coalescing group is one transaction: lock the
shard's head group (the group of its lowest id, every row of it, ``FOR UPDATE``), call the
handler with the group's newest row, delete the group's rows, commit. A handler that raises
rolls the transaction back and the shard's head is retried (head-of-line blocking, like the
bridge). Bench rows are never deferred, so ``scheduled_for`` is not consulted.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any

import psycopg

from bench.rows import connect
from outbox_bridge import OutboxApp, OutboxMessage

log = logging.getLogger("bench.baseline")

_COLUMNS = (
    "id, shard_scope, shard_identifier, category, object_identifier, payload, date_added, "
    "scheduled_for"
)


class DirectDrain:
    """Drain ``table`` with ``app``'s handlers from ``threads`` threads.

    With ``until_empty`` each thread stops when its partition has no rows; otherwise it polls
    every ``poll_interval`` seconds until :meth:`stop` (steady traffic).
    """

    def __init__(
        self,
        database_url: str,
        app: OutboxApp,
        *,
        threads: int,
        until_empty: bool = True,
        poll_interval: float = 0.01,
    ) -> None:
        self._url = database_url
        self._app = app
        self._table = app.table().name
        self._threads = threads
        self._until_empty = until_empty
        self._poll = poll_interval
        self._stop = threading.Event()
        self._errors: list[BaseException] = []

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Run the threads to the end (blocking); re-raise the first unexpected error."""
        workers = [
            threading.Thread(target=self._guarded, args=(i,), name=f"baseline-{i}", daemon=True)
            for i in range(self._threads)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if self._errors:
            raise self._errors[0]

    def _guarded(self, partition: int) -> None:
        try:
            self._drain_partition(partition)
        except BaseException as exc:
            self._errors.append(exc)
            self._stop.set()

    def _drain_partition(self, partition: int) -> None:
        loop = asyncio.new_event_loop()
        try:
            with connect(self._url) as conn:
                while not self._stop.is_set():
                    shards = self._shards(conn, partition)
                    if not shards:
                        if self._until_empty:
                            return
                        self._stop.wait(self._poll)
                        continue
                    for scope, ident in shards:
                        while not self._stop.is_set() and self._handle_head(
                            conn, loop, scope, ident
                        ):
                            pass
        finally:
            loop.close()

    def _shards(self, conn: psycopg.Connection, partition: int) -> list[tuple[int, int]]:
        rows = conn.execute(
            f"SELECT DISTINCT shard_scope, shard_identifier FROM {self._table} "
            "WHERE mod(shard_identifier + shard_scope, %s) = %s",
            [self._threads, partition],
        ).fetchall()
        conn.commit()
        return sorted((int(r[0]), int(r[1])) for r in rows)

    def _handle_head(
        self, conn: psycopg.Connection, loop: asyncio.AbstractEventLoop, scope: int, ident: int
    ) -> bool:
        """Handle the head group of one shard in one transaction; False when it is empty."""
        table = self._table
        rows = conn.execute(
            f"SELECT {_COLUMNS} FROM {table} AS o JOIN ("
            f"  SELECT category, object_identifier FROM {table}"
            "   WHERE shard_scope = %(s)s AND shard_identifier = %(i)s ORDER BY id LIMIT 1"
            ") AS head USING (category, object_identifier) "
            "WHERE o.shard_scope = %(s)s AND o.shard_identifier = %(i)s "
            "ORDER BY o.id FOR UPDATE OF o",
            {"s": scope, "i": ident},
        ).fetchall()
        if not rows:
            conn.commit()
            return False
        try:
            self._call(loop, self._message(rows[-1], len(rows)))
        except Exception:
            log.warning("baseline handler failed for shard %s:%s; retrying", scope, ident)
            conn.rollback()
            self._stop.wait(0.1)
            return True
        conn.execute(f"DELETE FROM {table} WHERE id = ANY(%s)", [[r[0] for r in rows]])
        conn.commit()
        return True

    def _message(self, row: tuple[Any, ...], coalesced: int) -> OutboxMessage:
        id_, scope, ident, category, obj, payload, added, scheduled_for = row
        return OutboxMessage(
            id=id_,
            shard_scope=self._app.scope(scope) or scope,
            shard_identifier=ident,
            category=self._app.category(category) or category,
            object_identifier=obj,
            payload=payload,
            region=None,
            date_added=added,
            scheduled_for=scheduled_for,
            coalesced=coalesced,
        )

    def _call(self, loop: asyncio.AbstractEventLoop, message: OutboxMessage) -> None:
        handler = self._app.handler_for(int(message.category))
        assert handler is not None
        result = handler(message)
        if inspect.isawaitable(result):
            loop.run_until_complete(result)
