"""The baseline: a direct drain in PostgreSQL, with no Temporal in the way.

``threads`` threads, each with its own psycopg 3 sync connection, own a fixed partition of the
shards (``mod(shard_identifier + shard_scope, threads)``), so a shard is never handled by two
threads and its rows are handled in order. Each coalescing group is one transaction: lock the
shard's head group (the group of its lowest id, every row of it, ``FOR UPDATE``), call the
handler with the group's newest row, delete the group's rows, commit. Bench rows are never
deferred, so ``scheduled_for`` is not consulted.

A handler that raises rolls its transaction back and blocks its shard (head-of-line blocking,
like the bridge): the thread leaves the shard and goes on with its other shards, and retries
the shard's head ``retry_interval`` seconds later (the bridge's ``initial_retry_interval``, 1 s
by default), at the first shard boundary after that, as often as it takes. This is the fair
counterpart of the bridge, where a failing head is retried at once by its shard's workflow,
then after 1 s, 2 s, 4 s...: for a handler that fails three times, both wait 3 s in all
before the call that succeeds, and neither holds back any other shard meanwhile.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import logging
import threading
import time
from collections import deque
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
        retry_interval: float = 1.0,
    ) -> None:
        self._url = database_url
        self._app = app
        self._table = app.table().name
        self._threads = threads
        self._until_empty = until_empty
        self._poll = poll_interval
        self._retry = retry_interval
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
        queue: deque[tuple[int, int]] = deque()  # this pass's shards, in order
        parked: list[tuple[float, tuple[int, int]]] = []  # (when to retry, shard): blocked
        blocked: set[tuple[int, int]] = set()
        try:
            with connect(self._url) as conn:
                while not self._stop.is_set():
                    if parked and parked[0][0] <= time.monotonic():
                        _, shard = heapq.heappop(parked)
                        blocked.discard(shard)
                    elif queue:
                        shard = queue.popleft()
                        if shard in blocked:
                            continue
                    else:
                        queue.extend(s for s in self._shards(conn, partition) if s not in blocked)
                        if queue:
                            continue
                        if parked:  # only blocked shards are left: wait for the first retry
                            self._stop.wait(max(0.0, parked[0][0] - time.monotonic()))
                        elif self._until_empty:
                            return
                        else:
                            self._stop.wait(self._poll)
                        continue
                    if not self._drain_shard(conn, loop, shard):
                        heapq.heappush(parked, (time.monotonic() + self._retry, shard))
                        blocked.add(shard)
        finally:
            loop.close()

    def _drain_shard(
        self, conn: psycopg.Connection, loop: asyncio.AbstractEventLoop, shard: tuple[int, int]
    ) -> bool:
        """Handle the shard's groups in order until it is empty (True) or its head failed."""
        scope, ident = shard
        while not self._stop.is_set():
            handled = self._handle_head(conn, loop, scope, ident)
            if handled is None:
                return False
            if not handled:
                return True
        return True

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
    ) -> bool | None:
        """Handle the head group of one shard in one transaction: False when the shard is
        empty, None when the handler failed."""
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
            log.debug("baseline handler failed for shard %s:%s; retrying later", scope, ident)
            conn.rollback()
            return None
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
