"""DBOS 3.x: a workflow per row on a partitioned queue, partition = the row's key,
``partition_concurrency=1``.

Its documented way to run work of one key one at a time, in order: a partitioned queue
dequeues each partition in order of enqueueing and runs at most ``partition_concurrency`` of
its workflows at once; a failing step is retried inside its workflow (``retries_allowed``), so
its partition waits for it. The schema is its own (``dbos migrate``); the producer enqueues
with ``DBOSClient.enqueue_in_transaction`` on the app's connection, in its transaction (one
enqueue per row); the worker is a process that launches DBOS.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.peers.base import Enqueue, Peer, RunSpec
from bench.peers.calls import handle_async
from bench.peers.checker import Row

QUEUE = "outbox"
WORKFLOW = "outbox_row"
MAX_ATTEMPTS = 100


def _url(spec: RunSpec) -> str:
    return spec.database_url.replace("postgresql://", "postgresql+psycopg://", 1)


class Dbos(Peer):
    name = "dbos"
    distributions = ("dbos",)
    module = "dbos"
    ordered = True
    coroutines = True
    setting = (
        "a workflow per row on a queue with partition_concurrency=1, partition key = key; "
        "worker_concurrency = the run's; step retries every 1 s; queue polling interval 1 s "
        "(its default)"
    )

    def install_schema(self, spec: RunSpec) -> None:
        dbos_cli = str(Path(sys.executable).with_name("dbos"))
        command = [dbos_cli, "migrate", "--sys-db-url", _url(spec)]
        subprocess.run(command, check=True, capture_output=True, timeout=300)

    @contextlib.contextmanager
    def producer(self, spec: RunSpec) -> Iterator[Enqueue]:
        import sqlalchemy as sa
        from dbos import DBOSClient, EnqueueOptions

        client = DBOSClient(system_database_url=_url(spec))
        engine = sa.create_engine(_url(spec))

        def enqueue(rows: Sequence[Row]) -> None:
            with engine.begin() as conn:
                for r in rows:
                    options: EnqueueOptions = {
                        "queue_name": QUEUE,
                        "workflow_name": WORKFLOW,
                        "queue_partition_key": str(r.key),
                    }
                    client.enqueue_in_transaction(conn, options, r.key, r.seq, r.category, r.obj)

        try:
            yield enqueue
        finally:
            client.destroy()
            engine.dispose()

    def serve(self, spec: RunSpec, role: str) -> None:
        from dbos import DBOS

        DBOS(config={"name": f"peers-{spec.name}", "system_database_url": _url(spec)})

        @DBOS.step(retries_allowed=True, max_attempts=MAX_ATTEMPTS, interval_seconds=1.0,
                   backoff_rate=1.0)  # fmt: skip
        async def handle_row(key: int, seq: int, category: int, obj: int) -> None:
            await handle_async(key, seq, category, obj)

        @DBOS.workflow(name=WORKFLOW)
        async def outbox_row(key: int, seq: int, category: int, obj: int) -> None:
            await handle_row(key, seq, category, obj)

        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        DBOS.launch()
        DBOS.register_queue(QUEUE, partition_concurrency=1, worker_concurrency=spec.concurrency)
        stop.wait()
        DBOS.destroy(workflow_completion_timeout_sec=5)
