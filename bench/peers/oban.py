"""Oban for Python (``oban`` 0.7): a job per row on one queue, unordered.

Order per key (partitioned or chained queues) is Oban Pro's, not the open-source package's: a
queue's ``limit`` bounds how many of its jobs run at once, not which, so this runs unordered
and the checker counts what that costs. The schema is its own (``oban.schema.install``); the
producer inserts every row with ``enqueue_many`` on the app's connection, inside its
transaction; the worker is an ``Oban`` instance with the queue at the run's concurrency, its
failing jobs retried after 1 s (``backoff``).

Every release from 0.5 on needs Python 3.12 or later; on an older Python the bench runs it with
``--interpreter oban=PATH``, a Python 3.12 environment with ``oban`` installed (see
:mod:`bench.peers.cli`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator, Sequence
from typing import Any

from bench.peers.base import Enqueue, Peer, RunSpec
from bench.peers.calls import handle_async
from bench.peers.checker import Row

QUEUE = "outbox"
MAX_ATTEMPTS = 100
RETRY_AFTER_S = 1


def _worker() -> Any:
    from oban import worker

    @worker(queue=QUEUE, max_attempts=MAX_ATTEMPTS)
    class OutboxRow:
        async def process(self, job: Any) -> None:
            args = job.args
            await handle_async(args["key"], args["seq"], args["category"], args["obj"])

        def backoff(self, job: Any) -> int:
            return RETRY_AFTER_S

    return OutboxRow


async def _pool(spec: RunSpec) -> Any:
    from oban import Oban

    return await Oban.create_pool(dsn=spec.database_url)


class Oban(Peer):
    name = "oban"
    distributions = ("oban",)
    module = "oban"
    python = (3, 12)
    ordered = False
    coroutines = True
    setting = (
        "unordered: order per key is Oban Pro's; one queue, limit = the run's concurrency, "
        f"retry after {RETRY_AFTER_S} s"
    )

    def install_schema(self, spec: RunSpec) -> None:
        from oban.schema import install

        async def run() -> None:
            pool = await _pool(spec)
            try:
                await install(pool)
            finally:
                await pool.close()

        asyncio.run(run())

    @contextlib.contextmanager
    def producer(self, spec: RunSpec) -> Iterator[Enqueue]:
        from oban import Oban as Client

        loop = asyncio.new_event_loop()
        pool = loop.run_until_complete(_pool(spec))
        client = Client(pool=pool)
        worker = _worker()

        async def enqueue(rows: Sequence[Row]) -> None:
            jobs = [
                worker.new({"key": r.key, "seq": r.seq, "category": r.category, "obj": r.obj})
                for r in rows
            ]
            async with pool.connection() as conn, conn.transaction():
                await client.enqueue_many(jobs, conn=conn)

        try:
            yield lambda rows: loop.run_until_complete(enqueue(rows))
        finally:
            loop.run_until_complete(pool.close())
            loop.close()

    def serve(self, spec: RunSpec, role: str) -> None:
        asyncio.run(_serve(spec))


async def _serve(spec: RunSpec) -> None:
    from oban import Oban as Server

    _worker()
    pool = await _pool(spec)
    server = Server(pool=pool, queues={QUEUE: spec.concurrency})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    await stop.wait()
    await server.stop()
    await pool.close()
