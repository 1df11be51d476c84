"""The bridge: hands its tables' notifications to this worker's partition drains; the one bridge
per database and set of tables that holds the advisory lock also sweeps every ``sweep_interval``
(:mod:`~outbox_bridge.runtime.supervisor`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import nullcontext

import psycopg
from sqlalchemy import Table
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.config import OutboxSettings
from outbox_bridge.db.disconnects import connection_lost
from outbox_bridge.db.pauses import PAUSES_CHANGED
from outbox_bridge.db.scans import read_shard_ranges
from outbox_bridge.db.schema import SWEEP_NOTIFICATION, notify_channel
from outbox_bridge.db.stats import STATISTICS_MIN_ROWS, analyze, lacks_statistics
from outbox_bridge.db.tls import tls_refusal
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.observability.backlog import observe_backlog, observe_shard_states
from outbox_bridge.observability.metrics import active_metrics
from outbox_bridge.observability.telemetry import active_tracer
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.hub import ShardHub, in_regions, shard_of, wait_any
from outbox_bridge.runtime.notifications import RefusalLog, Throttle, parse_notification
from outbox_bridge.runtime.pause_control import ControlViews, PauseControl
from outbox_bridge.runtime.supervisor import PartitionSupervisor

log = logging.getLogger(__name__)

# Seconds between a standby bridge's attempts to become the active one.
STANDBY_RETRY = 5.0
# Seconds between the scans of every shard of a table that notifications ask for ('*', a
# refused message), and between the sweeps they ask for ('pauses'), at least: anyone who can
# connect can NOTIFY, as often as they like.
NOTIFIED_SCAN_INTERVAL = 1.0
NOTIFIED_SWEEP_INTERVAL = 5.0


class Bridge:
    def __init__(
        self,
        *,
        app: OutboxApp,
        engine: AsyncEngine,
        listen_url: str,
        settings: OutboxSettings,
        supervisor: PartitionSupervisor,
        hub: ShardHub,
    ) -> None:
        self._app = app
        self._engine = engine
        self._listen_url = listen_url
        self._settings = settings
        self._supervisor = supervisor
        self._controls = ControlViews(
            PauseControl(app, engine), supervisor.client, settings.task_queue
        )
        self._hub = hub
        self._wake = asyncio.Event()
        # A pause changed: the held shards that waited for it go on.
        self._sweep_asked = Throttle(NOTIFIED_SWEEP_INTERVAL)
        self._scans_asked: dict[str, Throttle] = {}  # by table
        self._refusals: dict[str, RefusalLog] = {}  # by table
        self._cannot_analyze: set[str] = set()  # tables this role may not analyze (said once)
        self.handed_to_drains = 0
        self.notifications_refused = 0
        self.is_leader = False
        self.ready = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set. A lost connection is waited out (reconnect, listen again,
        sweep); any other error is logged as a failure, and the bridge restarts alike."""
        delay = 1.0
        while not stop.is_set():
            try:
                await self._run_connected(stop)
                delay = 1.0
            except ConfigurationError as exc:  # TLS refused the server: said in one line
                log.error("bridge cannot connect: %s; trying again in %.0fs", exc, delay)
            except Exception as exc:
                if connection_lost(exc):
                    log.warning(
                        "bridge lost the database (%s); reconnecting in %.0fs",
                        type(exc).__name__,
                        delay,
                    )
                else:
                    log.exception("bridge failed; restarting in %.0fs", delay)
            else:
                continue
            self.is_leader = False
            await wait_any(stop, timeout=delay)
            delay = min(delay * 2, 30.0)

    async def _run_connected(self, stop: asyncio.Event) -> None:
        # Each entered as soon as it is open: a stop while the second connects closes the first.
        async with (
            await self._connect() as listen_conn,
            await self._connect() as lock_conn,
        ):
            listener = None
            if self._settings.listen:
                for table in self._tables():
                    await listen_conn.execute(f'LISTEN "{notify_channel(table.name)}"')
                listener = asyncio.create_task(self._listen(listen_conn))
                self._hub.set_listening(True)
            try:
                await self._loop(stop, listener, lock_conn)
            finally:
                for refusals in self._refusals.values():
                    refusals.flush(now=True)
                self._hub.set_listening(False)
                self.is_leader = False
                metrics = active_metrics()
                if metrics is not None:
                    metrics.forget(self)  # a standby bridge reports no backlog
                if listener is not None:
                    listener.cancel()
                    with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                        await listener

    async def _connect(self) -> psycopg.AsyncConnection[tuple[object, ...]]:
        try:
            return await psycopg.AsyncConnection.connect(self._listen_url, autocommit=True)
        except psycopg.OperationalError as exc:
            refused = tls_refusal(exc, make_url(self._listen_url))
            if refused is None:
                raise
            raise refused from None

    async def _try_lead(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> bool:
        # Bridges of other regions on the same tables must not stand by for this one.
        regions = ",".join(sorted(self._settings.regions)) if self._settings.regions else "*"
        tables = ",".join(sorted(t.name for t in self._tables()))
        key = f"outbox-bridge:bridge:{tables}:{regions}"
        cur = await conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [key])
        row = await cur.fetchone()
        tables = tables.replace(",", ", ")
        if row and row[0]:
            self.is_leader = True
            log.info("bridge active for tables %s", tables)
            return True
        if not self.ready.is_set():
            log.info("another bridge is active for tables %s; standing by", tables)
        return False

    async def _listen(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
        channels = {notify_channel(t.name): t for t in self._tables()}
        try:
            async for notification in conn.notifies():
                table = channels.get(notification.channel)
                if table is not None:
                    self._take_notification(table, notification.payload)
                    self._wake.set()
        finally:
            # A lost connection wakes the loop to reconnect now, not at its next scan.
            self._wake.set()

    async def _loop(
        self,
        stop: asyncio.Event,
        listener: asyncio.Task[None] | None,
        lock_conn: psycopg.AsyncConnection[tuple[object, ...]],
    ) -> None:
        next_sweep = next_lead = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if not self.is_leader and now >= next_lead:
                if await self._try_lead(lock_conn):
                    next_sweep = now
                next_lead = now + STANDBY_RETRY
            if self.is_leader and (now >= next_sweep or self._sweep_asked.take()):
                self._sweep_asked.pending = False
                await self._sweep()
                next_sweep = time.monotonic() + self._settings.sweep_interval
            if not self.is_leader:
                self._sweep_asked.pending = False  # a standby bridge sweeps nothing
            self._answer_notifications()
            self.ready.set()
            deadline = next_sweep if self.is_leader else next_lead
            held = [t.due_in() for t in [*self._scans_asked.values(), self._sweep_asked]]
            deadline = min([deadline, *(time.monotonic() + d for d in held if d is not None)])
            await wait_any(stop, self._wake, timeout=max(0.0, deadline - time.monotonic()))
            self._wake.clear()
            if listener is not None and listener.done():
                listener.result()  # re-raises the connection error: reconnect
                raise psycopg.OperationalError("the LISTEN connection closed")

    # -- notifications --------------------------------------------------------------------------

    def _take_notification(self, table: Table, payload: str) -> None:
        if payload in (SWEEP_NOTIFICATION, PAUSES_CHANGED):
            if payload == PAUSES_CHANGED:
                self._sweep_asked.request()
            self._scan_asked(table.name)
            return
        parsed = parse_notification(payload, regional="region" in table.c)
        if isinstance(parsed, str):  # any role can NOTIFY: answered with a scan, never trusted
            self.notifications_refused += 1
            metrics = active_metrics()
            if metrics is not None:
                metrics.notifications_refused.add(1, {"outbox.table": table.name})
            refusals = self._refusals.setdefault(table.name, RefusalLog(notify_channel(table.name)))
            refusals.refuse(parsed, payload)
            self._scan_asked(table.name)
            return
        for entry in parsed:
            key = shard_of(self._app, table.name, entry.region, entry.scope, entry.shard_identifier)
            wanted = in_regions(key.region, self._settings.regions)
            if wanted and self._hub.offer_to_partition(key, entry.max_id):
                self.handed_to_drains += 1

    def _scan_asked(self, table: str) -> None:
        """A notification asks for a scan of every shard of ``table``: now, unless one was
        asked less than :data:`NOTIFIED_SCAN_INTERVAL` ago (then the loop asks when it may)."""
        throttle = self._scans_asked.setdefault(table, Throttle(NOTIFIED_SCAN_INTERVAL))
        throttle.request()
        if throttle.take():
            self._hub.rescan(table)

    def _answer_notifications(self) -> None:
        """The scans held back by their throttle that may run now, and the refusals' log."""
        for table, throttle in self._scans_asked.items():
            if throttle.take():
                self._hub.rescan(table)
        for refusals in self._refusals.values():
            refusals.flush()

    # -- the sweep ------------------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Keep the partitions running, each table's ``OutboxControl`` workflow showing its
        pauses (the timed pauses that have ended deleted first), make Temporal match the owner
        table, and measure the backlog (metrics on)."""
        tracer = active_tracer()
        with tracer.start_as_current_span("outbox.bridge.sweep") if tracer else nullcontext():
            for table in self._tables():
                await self._ensure_statistics(table)
            await self._supervisor.ensure_partitions()
            await self._controls.refresh(list(self._app.tables))
            await self._supervisor.check_held()
            metrics = active_metrics()
            if metrics is None:
                return  # the partitions find the rows; only the metrics need the aggregate
            for table in self._tables():
                async with self._engine.connect() as conn:
                    ranges = await read_shard_ranges(
                        conn, table, after_id=None, regions=self._settings.regions
                    )
                    await observe_backlog(metrics, self, conn, self._app, table, ranges)
            await observe_shard_states(
                metrics, self, self._supervisor.client, self._settings.task_queue
            )

    async def _ensure_statistics(self, table: Table) -> None:
        """Analyze a table that has rows and no planner statistics (the drains' plans need them;
        autovacuum comes a minute or more later)."""
        if table.name in self._cannot_analyze:
            return
        async with self._engine.connect() as conn:
            if not await lacks_statistics(conn, table):
                return
            try:
                await analyze(conn, table)
                await conn.commit()
                # Before PostgreSQL 17, ANALYZE by a role that does not own the table skips
                # it with a warning rather than an error.
                refused = "skipped" if await lacks_statistics(conn, table) else None
                await conn.commit()
            except SQLAlchemyError as exc:
                refused = type(getattr(exc, "orig", exc)).__name__
            if refused is not None:
                self._cannot_analyze.add(table.name)
                log.warning(
                    "%s holds %s or more rows and has no planner statistics, and this role "
                    "cannot analyze it (%s): deep shards drain slowly until autovacuum does; "
                    "run ANALYZE %s, or grant MAINTAIN on it (PostgreSQL 17+)",
                    table.name,
                    f"{STATISTICS_MIN_ROWS:,}",
                    refused,
                    table.name,
                )
                return
        log.info("analyzed %s: it had rows and no planner statistics", table.name)

    def _tables(self) -> list[Table]:
        return [self._app.table(name) for name in self._app.tables]
