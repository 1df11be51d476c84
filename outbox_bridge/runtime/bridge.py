"""The bridge: makes sure every shard with committed rows gets drained.

Every worker's bridge listens for its tables' notifications (one per INSERT statement, carrying
each shard's highest new id) and hands the news to the drains of its own process.

On demand (the default), those are the partitions' drains
(:mod:`~outbox_bridge.runtime.partition_drain`), which also find rows by their own scans.
The *active* bridge keeps each table's partition workflows running and, on every sweep,
starts the workflow of a held shard that has none (:mod:`~outbox_bridge.runtime.supervisor`).

With ``--shard-workflows always``, every shard with rows has its own workflow, and the active
bridge signals it: it scans for new ids on a short timer and sweeps the whole table on a
longer one, and signals only what changed (one signal-with-start per shard per wake-up, none
when it already told the workflow about that id). The sweep catches what the fast paths can
miss: rows that committed late with lower ids, lost notifications, and workflows that were
terminated or lost; it asks Temporal (describe and query, which add no history) before
signalling a shard that made no progress.

Only one bridge per database and set of tables is active at a time (an advisory lock held by
its own connection); other workers' bridges stand by.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link
from sqlalchemy import Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge.db.disconnects import connection_lost
from outbox_bridge.db.schema import SWEEP_NOTIFICATION, notify_channel
from outbox_bridge.db.store import (
    STATISTICS_MIN_ROWS,
    FirstRow,
    ShardRange,
    analyze,
    lacks_statistics,
    read_first_row,
    read_shard_ranges,
    read_trace_contexts,
)
from outbox_bridge.observability.backlog import observe_backlog, observe_shard_states
from outbox_bridge.observability.metrics import active_metrics
from outbox_bridge.observability.telemetry import active_tracer, context_of
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.hub import ShardHub, ShardKey, ref_of
from outbox_bridge.runtime.notifications import Notification, parse_notification
from outbox_bridge.runtime.shards import (
    STATUS_QUERY_TIMEOUT,
    ShardStarter,
    blocked_on_another_head,
)
from outbox_bridge.runtime.supervisor import PartitionSupervisor
from outbox_bridge.workflows.models import ShardRef, ShardState, ShardStatus

log = logging.getLogger("outbox_bridge.runtime.bridge")


@dataclass
class BridgeOptions:
    task_queue: str
    poll_interval: float = 1.0
    sweep_interval: float = 30.0
    listen: bool = True
    regions: Sequence[str] | None = None
    signal_concurrency: int = 50
    standby_retry: float = 5.0
    # Always mode: how long a shard's workflow may stay open after its last rows, and lingers.
    idle_timeout: float = 0.0
    linger: float = 0.0


class Bridge:
    def __init__(
        self,
        *,
        app: OutboxApp,
        engine: AsyncEngine,
        client: Client,
        listen_url: str,
        options: BridgeOptions,
        starter: ShardStarter,
        supervisor: PartitionSupervisor | None = None,
        held: PartitionSupervisor | None = None,
        hub: ShardHub | None = None,
    ) -> None:
        self._app = app
        self._engine = engine
        self._client = client
        self._listen_url = listen_url
        self._options = options
        self._starter = starter
        self._supervisor = supervisor  # set: on demand, partitions drain healthy shards
        # Every shard its own workflow (always): still, a skipped shard whose workflow ended
        # starts again skipped (the skip is kept in the owner table).
        self._held = held
        self._known: dict[ShardKey, int] = {}
        self._last_min: dict[ShardKey, int] = {}
        self._watermark: dict[str, int] = {}
        self._pending: dict[ShardKey, tuple[int, bool]] = {}
        self._scan_requested: set[str] = set()
        self._wake = asyncio.Event()
        self._semaphore = asyncio.Semaphore(options.signal_concurrency)
        self._hub = hub
        self._last_contact: dict[ShardKey, float] = {}
        self._cannot_analyze: set[str] = set()  # tables this role may not analyze (said once)
        self.signals_sent = 0
        self.starts = 0
        self.handed_to_drains = 0
        self.notifications_refused = 0
        self.is_leader = False
        self.ready = asyncio.Event()

    @property
    def on_demand(self) -> bool:
        return self._supervisor is not None

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set. Database and Temporal outages are waited out: the bridge
        reconnects, listens again and sweeps, so nothing committed meanwhile is missed. Any
        other error (a statement PostgreSQL refuses, a bug) is a failure, logged as one with
        its traceback; the bridge restarts with the same backoff, so the worker stays up."""
        delay = 1.0
        while not stop.is_set():
            try:
                await self._run_connected(stop)
                delay = 1.0
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
            await _wait(stop, delay)
            delay = min(delay * 2, 30.0)

    async def _run_connected(self, stop: asyncio.Event) -> None:
        # Every worker listens (its drains want the news); only the leader signals and sweeps.
        listen_conn = await psycopg.AsyncConnection.connect(self._listen_url, autocommit=True)
        lock_conn = await psycopg.AsyncConnection.connect(self._listen_url, autocommit=True)
        async with listen_conn, lock_conn:
            listener = None
            if self._options.listen:
                for table in self._tables():
                    await listen_conn.execute(f'LISTEN "{notify_channel(table.name)}"')
                listener = asyncio.create_task(self._listen(listen_conn))
            try:
                await self._loop(stop, listener, lock_conn)
            finally:
                self.is_leader = False
                metrics = active_metrics()
                if metrics is not None:
                    metrics.forget(self)  # a standby bridge reports no backlog
                if listener is not None:
                    listener.cancel()
                    with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                        await listener

    async def _try_lead(self, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> bool:
        # Bridges of other regions on the same tables must not stand by for this one.
        regions = ",".join(sorted(self._options.regions)) if self._options.regions else "*"
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
            # A lost connection must wake the loop, which reconnects and listens again: with
            # a long --poll-interval it would otherwise notice only at its next scan.
            self._wake.set()

    async def _loop(
        self,
        stop: asyncio.Event,
        listener: asyncio.Task[None] | None,
        lock_conn: psycopg.AsyncConnection[tuple[object, ...]],
    ) -> None:
        next_sweep = next_scan = next_lead = 0.0
        # On demand, the partitions scan for new rows themselves: the leader only sweeps.
        poll = self._options.sweep_interval if self.on_demand else self._options.poll_interval
        while not stop.is_set():
            now = time.monotonic()
            if not self.is_leader and now >= next_lead:
                if await self._try_lead(lock_conn):
                    await self._sweep()
                    now = time.monotonic()
                    next_sweep = now + self._options.sweep_interval
                    next_scan = now + poll
                next_lead = now + self._options.standby_retry
                self.ready.set()
            deadline = min(next_sweep, next_scan) if self.is_leader else next_lead
            await _wait_any(stop, self._wake, max(0.0, deadline - time.monotonic()))
            self._wake.clear()
            if listener is not None and listener.done():
                listener.result()  # re-raises the connection error: reconnect
                raise psycopg.OperationalError("the LISTEN connection closed")
            if not self.is_leader:
                self._hand_to_lingering_drains()
                continue
            await self._flush_notifications()
            now = time.monotonic()
            if now >= next_sweep:
                await self._sweep()
                next_sweep = now + self._options.sweep_interval
                next_scan = now + poll
            elif now >= next_scan or (self._scan_requested and not self.on_demand):
                await self._scan()
                next_scan = now + poll

    # -- notifications --------------------------------------------------------------------------

    def _take_notification(self, table: Table, payload: str) -> None:
        if payload == SWEEP_NOTIFICATION:
            self._scan_requested.add(table.name)
            self._offer_rescan(table.name)
            return
        parsed = parse_notification(payload, regional="region" in table.c)
        if isinstance(parsed, str):
            # Any role that can connect can NOTIFY: a malformed message is logged and answered
            # with a scan, never trusted and never a reason to restart.
            self.notifications_refused += 1
            log.warning(
                "refused a notification on %s (%s): %r; scanning instead",
                notify_channel(table.name),
                parsed,
                payload[:200],
            )
            self._scan_requested.add(table.name)
            self._offer_rescan(table.name)
            return
        for entry in parsed:
            self._take_entry(table.name, entry)

    def _take_entry(self, table: str, entry: Notification) -> None:
        key = ShardKey(table, entry.region, entry.scope, entry.shard_identifier)
        if not self._wanted_region(key.region):
            return
        if self.on_demand:
            if self._hub is not None and self._hub.offer_to_partition(key, entry.max_id):
                self.handed_to_drains += 1
            return
        max_id = entry.max_id
        previous = self._pending.get(key)
        if previous is None or max_id > previous[0]:
            self._pending[key] = (max_id, previous[1] if previous else False)
        known = self._known.get(key, 0)
        if max_id < known or (previous is not None and max_id < previous[0]):
            # Committed after a higher id was announced: the workflow may have drained past it
            # already, so it must look again.
            self._pending[key] = (self._pending[key][0], True)

    def _offer_rescan(self, table: str) -> None:
        """A statement wrote too many shards to name them: this worker's partitions of the
        table scan every shard now. (The leader of the other mode scans instead.)"""
        if self._hub is not None and self.on_demand:
            self._hub.rescan(table)

    def _hand_to_lingering_drains(self) -> None:
        """Standby: wake this process's lingering drains; the leader signals the rest."""
        pending, self._pending = self._pending, {}
        self._scan_requested.clear()
        if self._hub is not None:
            for key in pending:
                self._hub.offer(key)

    async def _flush_notifications(self) -> None:
        pending, self._pending = self._pending, {}
        await self._signal_all(
            [
                (key, max_id, late)
                for key, (max_id, late) in pending.items()
                if late or max_id > self._known.get(key, 0)
            ],
            reason="notify",
        )

    # -- scans and sweeps -------------------------------------------------------------------------

    async def _scan(self) -> None:
        """Rows above the watermark: new commits since the last scan, in id order."""
        self._scan_requested.clear()
        for table in self._tables():
            watermark = self._watermark.get(table.name, 0)
            ranges = await self._ranges(table, after_id=watermark)
            await self._signal_new(table, ranges, reason="scan")

    async def _sweep(self) -> None:
        """Every shard with rows: signal what is unknown, check shards that made no progress;
        with metrics on, measure the backlog and count blocked and skipped shards."""
        tracer = active_tracer()
        if tracer is None:
            await self._sweep_tables()
            return
        with tracer.start_as_current_span("outbox.bridge.sweep"):
            await self._sweep_tables()

    async def _sweep_tables(self) -> None:
        self._scan_requested.clear()
        metrics = active_metrics()
        for table in self._tables():
            await self._ensure_statistics(table)
        if self._supervisor is not None:
            await self._supervisor.ensure_partitions()
            await self._supervisor.check_held()
        elif self._held is not None:
            await self._held.check_held(skipped_only=True)
        for table in self._tables():
            if self._supervisor is not None and metrics is None:
                continue  # the partitions find the rows; only the metrics need the aggregate
            ranges = await self._ranges(table, after_id=None)
            if self._supervisor is None:
                await self._signal_new(table, ranges, reason="sweep")
            if metrics is not None:
                async with self._engine.connect() as conn:
                    await observe_backlog(metrics, self, conn, self._app, table, ranges)
            if self._supervisor is None:
                await self._check_progress(table, ranges)
        if metrics is not None:
            await observe_shard_states(metrics, self, self._client, self._options.task_queue)

    async def _ensure_statistics(self, table: Table) -> None:
        """Analyze a table that has rows and no planner statistics (a fresh table, or one last
        analyzed while empty): the drains' plans depend on them. Autovacuum would do it too,
        but only after a minute or more of a backlog drained many times slower."""
        if table.name in self._cannot_analyze:
            return
        async with self._engine.connect() as conn:
            if not await lacks_statistics(conn, table):
                return
            try:
                await analyze(conn, table)
                await conn.commit()
            except SQLAlchemyError as exc:
                self._cannot_analyze.add(table.name)
                log.warning(
                    "%s holds %s or more rows and has no planner statistics, and this role "
                    "cannot analyze it (%s): deep shards drain slowly until autovacuum does; "
                    "run ANALYZE %s",
                    table.name,
                    f"{STATISTICS_MIN_ROWS:,}",
                    type(getattr(exc, "orig", exc)).__name__,
                    table.name,
                )
                return
        log.info("analyzed %s: it had rows and no planner statistics", table.name)

    async def _check_progress(self, table: Table, ranges: list[ShardRange]) -> None:
        """Always mode: check the workflows of shards whose head did not move since the last
        sweep, and forget shards that have no rows (the bridge's memory stays as large as the
        backlog, however many shards come and go)."""
        present: set[ShardKey] = set()
        stalled: list[ShardKey] = []
        for r in ranges:
            key = ShardKey(table.name, r.region, r.scope, r.shard_identifier)
            present.add(key)
            if self._last_min.get(key) == r.min_id:
                stalled.append(key)
            self._last_min[key] = r.min_id
        recent = time.monotonic() - max(self._options.linger, self._options.idle_timeout, 1.0)
        for memory in (self._last_min, self._known):
            for key in [k for k in memory if k.table == table.name and k not in present]:
                memory.pop(key, None)
        for key in [
            k
            for k, at in self._last_contact.items()
            if k.table == table.name and k not in present and at < recent
        ]:
            del self._last_contact[key]
        await asyncio.gather(*(self._check_stalled(key) for key in stalled))

    async def _ranges(self, table: Table, *, after_id: int | None) -> list[ShardRange]:
        async with self._engine.connect() as conn:
            ranges = await read_shard_ranges(
                conn, table, after_id=after_id, regions=self._options.regions
            )
        if ranges:
            top = max(r.max_id for r in ranges)
            self._watermark[table.name] = max(self._watermark.get(table.name, 0), top)
        return ranges

    async def _signal_new(self, table: Table, ranges: Iterable[ShardRange], *, reason: str) -> None:
        keys = (
            (ShardKey(table.name, r.region, r.scope, r.shard_identifier), r.max_id) for r in ranges
        )
        await self._signal_all(
            [(key, max_id, False) for key, max_id in keys if max_id > self._known.get(key, 0)],
            reason=reason,
        )

    async def _check_stalled(self, key: ShardKey) -> None:
        """A shard whose head did not move since the last sweep: make sure a workflow is on it,
        and that a deferred one notices when its head became due (an operator deleted the
        deferred row or moved it earlier)."""
        shard = self.shard_ref(key)
        handle = self._client.get_workflow_handle(shard.workflow_id)
        async with self._semaphore:
            try:
                description = await handle.describe()
                if description.status != WorkflowExecutionStatus.RUNNING:
                    state = description.status.name if description.status else "gone"
                    reason = f"its workflow is {state}"
                else:
                    status = await handle.query(
                        "status", result_type=ShardStatus, rpc_timeout=STATUS_QUERY_TIMEOUT
                    )
                    first = await self._first_row(shard)
                    if status.state == ShardState.DEFERRED and first is not None and first.due:
                        reason = "its head is due, but its workflow waits for a deferred row"
                    elif blocked_on_another_head(status, first):
                        log.info("shard %s is blocked on a group no longer its head", shard.key)
                        await self._starter.recheck(shard, "its head changed")
                        return
                    elif status.state != ShardState.IDLE:
                        return  # draining, blocked, skipped or deferred: it is on it
                    else:
                        reason = "its workflow is idle"
            except RPCError as exc:
                if exc.status != RPCStatusCode.NOT_FOUND:
                    log.warning("cannot check shard %s: %s", shard.key, exc.message)
                    return
                reason = "it has no workflow"
            except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as exc:
                # A busy or replaying worker: the next sweep asks again.
                log.warning("cannot query shard %s: %s", shard.key, exc)
                return
        log.info("shard %s has pending rows but %s; signalling it", shard.key, reason)
        self._last_contact.pop(key, None)
        await self._signal(key, self._known.get(key, 0), late=True, via_hub=False)

    async def _first_row(self, shard: ShardRef) -> FirstRow | None:
        async with self._engine.connect() as conn:
            return await read_first_row(conn, self._app.table(shard.table), shard)

    # -- signalling (always mode) ----------------------------------------------------------------

    async def _signal_all(self, items: list[tuple[ShardKey, int, bool]], *, reason: str) -> None:
        """Signal each shard of ``items``. With tracing on, a wake-up that signals anything has
        a span (the sweep has its own), and each shard's signal is a child of the producer span
        of the row it announces, so that a row's trace runs from its producer into Temporal."""
        if not items:
            return
        tracer = active_tracer()
        if tracer is None:
            await asyncio.gather(*(self._signal(key, max_id, late) for key, max_id, late in items))
            return
        producers = await self._producer_contexts(items)
        wake = (
            contextlib.nullcontext()
            if reason == "sweep"
            else tracer.start_as_current_span(
                "outbox.bridge.wake",
                attributes={"outbox.wake.reason": reason, "outbox.shards": len(items)},
            )
        )
        with wake:
            await asyncio.gather(
                *(
                    self._signal(key, max_id, late, parent=producers.get((key.table, max_id)))
                    for key, max_id, late in items
                )
            )

    async def _producer_contexts(
        self, items: list[tuple[ShardKey, int, bool]]
    ) -> dict[tuple[str, int], Context]:
        """The producer trace context of each announced row that has one: one statement per
        table, and only with tracing on."""
        wanted: dict[str, list[int]] = {}
        for key, max_id, _ in items:
            wanted.setdefault(key.table, []).append(max_id)
        found: dict[tuple[str, int], Context] = {}
        try:
            async with self._engine.connect() as conn:
                for table, ids in wanted.items():
                    carriers = await read_trace_contexts(conn, self._app.table(table), ids)
                    for row_id, carrier in carriers.items():
                        context = context_of(carrier)
                        if context is not None:
                            found[(table, row_id)] = context
        except SQLAlchemyError as exc:  # the signals matter more than their parent spans
            log.warning("cannot read the trace context of new rows: %s", type(exc).__name__)
        return found

    def shard_ref(self, key: ShardKey) -> ShardRef:
        return ref_of(key, self._app)

    async def _signal(
        self,
        key: ShardKey,
        max_id: int,
        late: bool,
        *,
        via_hub: bool = True,
        parent: Context | None = None,
    ) -> None:
        if via_hub and self._hub is not None and self._hub.offer(key):
            # A drain of this shard lingers in this process and takes the rows itself.
            self.handed_to_drains += 1
            self._known[key] = max(self._known.get(key, 0), max_id)
            self._last_contact[key] = time.monotonic()
            return
        shard = self.shard_ref(key)
        traffic = self._recent_traffic(key)
        with self._signal_span(shard, max_id, late, parent):
            async with self._semaphore:
                if self._may_be_closed(key) and await self._starter.start(
                    shard, max_id, traffic=traffic
                ):
                    self.starts += 1
                elif not await self._starter.notify(shard, max_id, late=late, traffic=traffic):
                    return  # not remembered as known: the next scan or sweep signals it again
        self.signals_sent += 1
        self._known[key] = max(self._known.get(key, 0), max_id)
        self._last_contact[key] = time.monotonic()

    @staticmethod
    def _signal_span(
        shard: ShardRef, max_id: int, late: bool, parent: Context | None
    ) -> contextlib.AbstractContextManager[object]:
        """``outbox.bridge.signal``: a child of the announced row's producer span when it has
        one (linked to the wake-up's span), else of the wake-up's or sweep's span. Temporal's
        interceptor puts its StartWorkflow / SignalWithStartWorkflow span under it."""
        tracer = active_tracer()
        if tracer is None:
            return contextlib.nullcontext()
        links = []
        current = trace.get_current_span().get_span_context()
        if parent is not None and current.is_valid:
            links.append(Link(current))
        attributes: dict[str, Any] = {
            "outbox.table": shard.table,
            "outbox.scope": shard.scope_name,
            "outbox.shard_identifier": shard.shard_identifier,
            "outbox.max_id": max_id,
            "outbox.late": late,
        }
        if shard.region is not None:
            attributes["outbox.region"] = shard.region
        return tracer.start_as_current_span(
            "outbox.bridge.signal", context=parent, links=links, attributes=attributes
        )

    def _may_be_closed(self, key: ShardKey) -> bool:
        """No contact with this shard's workflow for an idle period: it has likely completed."""
        last = self._last_contact.get(key)
        return last is None or time.monotonic() - last > self._options.idle_timeout / 2

    def _recent_traffic(self, key: ShardKey) -> bool:
        """Rows for this shard again within a linger period of the last: a new run of its
        workflow should linger for the next ones rather than complete and be started again."""
        last = self._last_contact.get(key)
        linger = self._options.linger
        return last is not None and linger > 0 and time.monotonic() - last <= linger

    # -- helpers -------------------------------------------------------------------------------

    def _tables(self) -> list[Table]:
        return [self._app.table(name) for name in self._app.tables]

    def _wanted_region(self, region: str | None) -> bool:
        regions = self._options.regions
        return region is None or regions is None or region in regions


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


async def _wait_any(stop: asyncio.Event, wake: asyncio.Event, timeout: float) -> None:
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(wake.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
