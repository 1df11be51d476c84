"""The connection that holds a round's shard locks, and the fence it makes: once it is lost,
every lock of the round is gone, and so is every later statement of the round."""

from __future__ import annotations

import asyncio
import logging
import select
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
from sqlalchemy import Table
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.writes import driver_writes
from outbox_bridge.workflows.models import ShardRef

log = logging.getLogger(__name__)

# poll() events of a socket the peer has closed (POLLRDHUP: Linux only).
HANGUP = (
    getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR
    if hasattr(select, "poll")
    else 0
)

# A statement of a round: awaited with the connection that holds the round's locks.
Work = Callable[[AsyncConnection], Awaitable[Any]]


class ShardLocks:
    """Shards locked on one connection, and whether that connection (the fence) still stands."""

    def __init__(self, conn: AsyncConnection, table: Table, locked: list[ShardRef]) -> None:
        self.conn = conn
        self.table = table
        # The shards still locked, in locking order (a dict: membership tests stay cheap).
        self.locked: dict[ShardRef, None] = dict.fromkeys(locked)
        self.stuck: set[ShardRef] = set()  # locks only closing the connection releases
        self.lost = False
        self.suspect = False  # something arrived between statements: take no further group
        self._statements = 0  # odd while a statement is under way
        self._socket: psycopg.AsyncConnection[Any] | None = None
        self._busy = asyncio.Lock()  # one statement at a time on the connection

    async def attach(self) -> None:
        raw = await self.conn.get_raw_connection()
        driver = raw.driver_connection
        self._socket = driver if isinstance(driver, psycopg.AsyncConnection) else None

    def alive(self) -> bool:
        """Whether the connection (and every lock of the round) still seems to stand; asked
        before each handler call, also from handler threads. An idle connection that is not
        listening receives nothing unless the server is closing it. The socket is only polled,
        never read (psycopg may be awaiting an answer on it); the next statement is the fence."""
        if self.lost or self.suspect:
            return False
        driver = self._socket
        if driver is None:
            return True
        statements = self._statements
        try:
            if driver.pgconn.status != psycopg.pq.ConnStatus.OK:
                self._lose("the connection is closed")
                return False
            if statements % 2:  # an answer may be arriving: only a hang-up says anything
                return not self._closed_by_server(driver.pgconn.socket)
            readable, _, _ = select.select([driver.pgconn.socket], [], [], 0)
        except (OSError, psycopg.Error, ValueError) as exc:
            self._lose(str(exc))
            return False
        if readable and self._statements == statements:
            self._suspect("received something between statements (the server may be closing it)")
        return not self.suspect

    def _closed_by_server(self, socket: int) -> bool:
        """Whether the server closed the connection; marks the round suspect if it did."""
        if not HANGUP:
            return False
        poller = select.poll()  # one per call: handler threads ask at the same time
        poller.register(socket, HANGUP)
        if not poller.poll(0):
            return False
        self._suspect("was closed by the server while a statement was under way")
        return True

    def _suspect(self, seen: str) -> None:
        if not self.suspect:
            self.suspect = True
            self._warn(f"{seen}: this round takes no further group")

    def _lose(self, why: str) -> None:
        if not self.lost:
            self.lost = True
            self._warn(
                f"is gone ({why}): no further groups or deletes in this round; its handled "
                "rows stay and run again"
            )

    def _warn(self, what: str) -> None:
        log.warning(
            "the connection holding %s shard lock(s) of %s %s",
            len(self.locked),
            self.table.name,
            what,
        )

    async def statement(self, work: Work) -> Any:
        """``work(conn)``, alone on the connection; a loss of the connection is noted."""
        async with self._busy:
            # Look at the idle socket before the statement hides a server's close from alive().
            self.alive()
            self._statements += 1
            try:
                return await work(self.conn)
            except BaseException as exc:
                if self.gone(exc):
                    self._lose(type(exc).__name__)
                raise
            finally:
                self._statements += 1

    def gone(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a statement of this round, means its locks are gone."""
        if self.lost or isinstance(exc, OSError) or self.conn.invalidated:
            return True
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return True
        driver = self._socket
        return driver is not None and (driver.closed or driver.broken)

    async def apart(
        self, work: Callable[[list[ShardRef]], Awaitable[None]], shards: list[ShardRef]
    ) -> dict[ShardRef, Exception]:
        """``work(shards)``, else shard by shard; returns the shards whose own ``work`` failed.
        An error that means the connection is gone is raised."""
        try:
            await work(shards)
            return {}
        except Exception as exc:
            if self.gone(exc):
                raise
        failed: dict[ShardRef, Exception] = {}
        for shard in shards:
            try:
                await work([shard])
            except Exception as exc:
                if self.gone(exc):
                    raise
                failed[shard] = exc
        return failed

    async def delete_rows(self, ids: list[int]) -> list[int]:
        assert self._socket is not None  # attached by DrainEngine.locked
        return await driver_writes(self.table, self.conn.dialect).delete_handled(self._socket, ids)

    async def unlock_now(self, shards: list[ShardRef]) -> None:
        assert self._socket is not None
        await driver_writes(self.table, self.conn.dialect).unlock_shards(self._socket, shards)
