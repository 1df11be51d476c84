"""procrastinate 3.x: a job per row, ``lock`` = the row's key.

Its documented way to run jobs of one key one at a time and in order: jobs sharing a ``lock``
never run at once, and a job waits while an earlier job of its lock is still to do (its
``procrastinate_fetch_job`` query), retries included. The schema is its own
(``schema_manager.apply_schema``); the producer defers each key's rows with ``batch_defer`` on
the app's own connection, inside its transaction; the worker is ``App.run_worker_async``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from bench.peers.base import Enqueue, Peer, RunSpec
from bench.peers.calls import handle_async
from bench.peers.checker import Row

RETRY_WAIT_S = 1  # between attempts of a failing job
MAX_ATTEMPTS = 100  # procrastinate has no "retry forever"


def _app(spec: RunSpec) -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=spec.database_url))
    retry = procrastinate.RetryStrategy(max_attempts=MAX_ATTEMPTS, wait=RETRY_WAIT_S)

    @app.task(name="outbox_row", retry=retry, pass_context=False)
    async def outbox_row(key: int, seq: int, category: int, obj: int) -> None:
        await handle_async(key, seq, category, obj)

    return app


class Procrastinate(Peer):
    name = "procrastinate"
    distributions = ("procrastinate",)
    module = "procrastinate"
    ordered = True
    coroutines = True
    setting = (
        "a job per row with lock=key; worker concurrency = the run's; retry every "
        f"{RETRY_WAIT_S} s, {MAX_ATTEMPTS} attempts"
    )

    def install_schema(self, spec: RunSpec) -> None:
        async def apply() -> None:
            app = _app(spec)
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(apply())

    @contextlib.contextmanager
    def producer(self, spec: RunSpec) -> Iterator[Enqueue]:
        import psycopg

        loop = asyncio.new_event_loop()
        app = _app(spec)
        task = app.tasks["outbox_row"]
        loop.run_until_complete(app.open_async().__aenter__())
        conn = loop.run_until_complete(psycopg.AsyncConnection.connect(spec.database_url))

        async def defer(rows: Sequence[Row]) -> None:
            by_key: dict[int, list[dict[str, int]]] = defaultdict(list)
            for r in rows:
                by_key[r.key].append(
                    {"key": r.key, "seq": r.seq, "category": r.category, "obj": r.obj}
                )
            async with conn.transaction():
                for key, jobs in by_key.items():
                    deferrer = task.configure(lock=f"key-{key}", connection=conn)
                    await deferrer.batch_defer_async(*jobs)

        try:
            yield lambda rows: loop.run_until_complete(defer(rows))
        finally:
            loop.run_until_complete(conn.close())
            loop.run_until_complete(app.connector.close_async())
            loop.close()

    def serve(self, spec: RunSpec, role: str) -> None:
        async def work() -> None:
            app = _app(spec)
            async with app.open_async():
                await app.run_worker_async(concurrency=spec.concurrency, wait=True)

        asyncio.run(work())
