"""pgqueuer 1.x: a job per row on one entrypoint, unordered.

pgqueuer serialises dispatch per *entrypoint* (``concurrency_limit=1``), not per key: its
documented options give no order per key, so it runs unordered, at its worker's concurrency,
and the checker counts what that costs. Failing jobs are retried in the database
(``DatabaseRetryEntrypointExecutor``, 1 s then doubling), not deleted. The schema is its own
(``Queries.install``); the producer enqueues every row in one batch inside a transaction; the
worker is ``QueueManager.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from bench.peers.base import Enqueue, Peer, RunSpec
from bench.peers.calls import handle_async
from bench.peers.checker import Row

ENTRYPOINT = "outbox_row"
MAX_ATTEMPTS = 100


async def _connect(spec: RunSpec) -> Any:
    import psycopg

    return await psycopg.AsyncConnection.connect(spec.database_url, autocommit=True)


class PgQueuer(Peer):
    name = "pgqueuer"
    distributions = ("pgqueuer",)
    module = "pgqueuer"
    ordered = False
    coroutines = True
    setting = (
        "unordered: order is kept per entrypoint only (concurrency_limit=1), not per key; one "
        "entrypoint, worker max_concurrent_tasks = the run's, retried in the database"
    )

    def install_schema(self, spec: RunSpec) -> None:
        from pgqueuer import Queries

        async def install() -> None:
            conn = await _connect(spec)
            try:
                await Queries.from_psycopg_connection(conn).install()
            finally:
                await conn.close()

        asyncio.run(install())

    @contextlib.contextmanager
    def producer(self, spec: RunSpec) -> Iterator[Enqueue]:
        from pgqueuer import Queries

        loop = asyncio.new_event_loop()
        conn = loop.run_until_complete(_connect(spec))
        queries = Queries.from_psycopg_connection(conn)

        async def enqueue(rows: Sequence[Row]) -> None:
            payloads = [json.dumps([r.key, r.seq, r.category, r.obj]).encode() for r in rows]
            async with conn.transaction():
                await queries.enqueue([ENTRYPOINT] * len(rows), payloads, [0] * len(rows))

        try:
            yield lambda rows: loop.run_until_complete(enqueue(rows))
        finally:
            loop.run_until_complete(conn.close())
            loop.close()

    def serve(self, spec: RunSpec, role: str) -> None:
        asyncio.run(_serve(spec))


async def _serve(spec: RunSpec) -> None:
    from pgqueuer import DatabaseRetryEntrypointExecutor, Queries, QueueManager

    conn = await _connect(spec)
    manager = QueueManager(Queries.from_psycopg_connection(conn))

    def retrying(parameters: Any) -> Any:
        return DatabaseRetryEntrypointExecutor(
            parameters=parameters,
            max_attempts=MAX_ATTEMPTS,
            initial_delay=timedelta(seconds=1),
        )

    @manager.entrypoint(ENTRYPOINT, executor_factory=retrying)
    async def outbox_row(job: Any) -> None:
        key, seq, category, obj = json.loads(job.payload)
        await handle_async(key, seq, category, obj)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, manager.shutdown.set)
    # Its batch (10) and a cap at the run's concurrency, as the other systems get.
    await manager.run(max_concurrent_tasks=max(spec.concurrency, 20))
    await conn.close()
