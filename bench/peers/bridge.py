"""outbox-bridge itself, measured through the same interface as the other systems.

A shard per key; order per shard, coalescing and retries are the bridge's own, with
:class:`~outbox_bridge.OutboxSettings` defaults (a unique task queue). The schema is the
worker's (``create_outbox_tables``); the producer inserts the rows into the outbox table in one
transaction, ids = the rows' sequences; the worker is ``worker.serve`` on a Temporal dev server
(the embedded one, on its SQLite file).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator, Sequence

from bench.peers.base import Enqueue, Peer, RunSpec
from bench.peers.calls import handle_async
from bench.peers.checker import Row

COLUMNS = "id, shard_scope, shard_identifier, category, object_identifier"


def _app(spec: RunSpec):  # type: ignore[no-untyped-def]
    from bench.app import Category, Scope
    from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable

    app = OutboxApp(
        scopes={Scope.TENANT: set(Category)}, categories=[Category], tables=[OutboxTable(spec.name)]
    )

    @app.handler(*Category)
    async def outbox_row(message: OutboxMessage) -> None:
        await handle_async(
            message.shard_identifier, message.id, int(message.category), message.object_identifier
        )

    return app


class OutboxBridge(Peer):
    name = "outbox-bridge"
    distributions = ("outbox-bridge", "temporalio")
    module = "outbox_bridge"
    ordered = True
    coalescing = True
    coroutines = True
    needs_temporal = True
    setting = "a shard per key (order per shard by design); OutboxSettings defaults"

    def install_schema(self, spec: RunSpec) -> None:
        from bench.rows import create_table

        asyncio.run(create_table(spec.database_url, _app(spec)))

    @contextlib.contextmanager
    def producer(self, spec: RunSpec) -> Iterator[Enqueue]:
        from bench.app import Scope
        from bench.rows import connect

        scope = int(Scope.TENANT)
        with connect(spec.database_url) as conn:

            def insert(rows: Sequence[Row]) -> None:
                with conn.cursor() as cur:
                    with cur.copy(f"COPY {spec.name} ({COLUMNS}) FROM STDIN") as copy:
                        for r in rows:
                            copy.write_row((r.seq, scope, r.key, r.category, r.obj))
                conn.commit()

            yield insert

    def serve(self, spec: RunSpec, role: str) -> None:
        asyncio.run(_serve(spec))


async def _serve(spec: RunSpec) -> None:
    from bench.bridge_run import bench_settings
    from outbox_bridge.runtime.worker import serve

    assert spec.temporal_address is not None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await serve(
        bench_settings(),
        _app(spec),
        stop=stop,
        database_url=spec.database_url,
        temporal_address=spec.temporal_address,
    )
