"""Memory per row is bounded: eight rows of a 100 MB (compressible) payload, written with plain
SQL beside ordinary rows, through a real worker process. PostgreSQL sizes each payload's JSON
text before the worker reads it; the eight shards block on their rows with PayloadTooLargeError,
every ordinary shard drains, and the worker's peak resident memory (VmHWM, its own process)
stays far below what reading the rows would take (six such rows took a worker to 938 MiB).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from sqlalchemy import text

from outbox_bridge.workflows.models import ShardRef
from tests.faults.harness import new_table, outbox_count, wait_drained
from tests.faults.test_bad_input import in_state, prepare, start_worker, status
from tests.harness import wait_until

BIG_ROWS = 8
BIG_CHARS = 100 * 2**20  # of 'x': about 100 MB of JSON text, stored as about 1 MB
BIG_SHARDS = range(900, 900 + BIG_ROWS)
ORDINARY_SHARDS = 200
PEAK_LIMIT_MIB = 512


def peak_rss_mib(pid: int) -> float:
    """The peak resident memory of process ``pid`` in MiB (Linux's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "VmHWM":
            return int(value.split()[0]) / 1024  # in kB
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


async def write_rows(engine, table: str) -> None:
    """Ordinary rows (three groups per shard), two of them before the large
    rows and one after: rounds take large and ordinary heads together."""
    ordinary = (
        f"INSERT INTO {table} (shard_scope, shard_identifier, category, object_identifier, "
        "payload) SELECT 1, s, 2, o, jsonb_build_object('n', s, 'o', o) "
        "FROM generate_series(1, CAST(:shards AS int)) AS s, "
        "generate_series(CAST(:first AS int), CAST(:last AS int)) AS o"
    )
    async with engine.begin() as conn:
        await conn.execute(text(ordinary), {"shards": ORDINARY_SHARDS, "first": 1, "last": 2})
    # The first large payload is built once (about 6 s: most of it compressing); the others
    # copy its stored (compressed) value.
    first, *others = BIG_SHARDS
    columns = "shard_scope, shard_identifier, category, object_identifier, payload"
    async with engine.begin() as conn:
        big = (
            await conn.execute(
                text(
                    f"INSERT INTO {table} ({columns}) VALUES (1, :shard, 2, 1, "
                    "jsonb_build_object('blob', repeat('x', CAST(:chars AS int)))) RETURNING id"
                ),
                {"shard": first, "chars": BIG_CHARS},
            )
        ).scalar_one()
        await conn.execute(
            text(
                f"INSERT INTO {table} ({columns}) SELECT 1, s, 2, 1, t.payload "
                f"FROM {table} t, unnest(CAST(:shards AS bigint[])) AS s WHERE t.id = :big"
            ),
            {"shards": others, "big": big},
        )
    async with engine.begin() as conn:
        await conn.execute(text(ordinary), {"shards": ORDINARY_SHARDS, "first": 3, "last": 3})


async def test_rows_of_100_mb_block_their_shards_and_the_worker_stays_small(
    engine, fault_database, fault_temporal, fault_client, logs, record_property
) -> None:
    url, _ = fault_database
    table = new_table()
    await prepare(engine, table)
    await write_rows(engine, table)
    # Each attempt makes PostgreSQL build a blocked row's text (about half a second for 100 MB):
    # retries a few seconds apart keep eight of them from filling the machine.
    worker = await start_worker(
        url, fault_temporal.address, table, logs, OUTBOX_MAX_RETRY_INTERVAL="10"
    )
    try:
        await wait_drained(engine, table, timeout=120, left=BIG_ROWS)
        for shard in BIG_SHARDS:
            ref = ShardRef(table, 1, "ORGANIZATION", shard)
            await wait_until(
                partial(in_state, fault_client, ref, "blocked", "PayloadTooLargeError"),
                timeout=120,
                what=f"shard {shard} blocked",
            )
        blocked = await status(fault_client, ShardRef(table, 1, "ORGANIZATION", BIG_SHARDS[0]))
        assert blocked is not None and blocked.last_error is not None
        assert "payload is 100 MiB (104,857,612 bytes), over the limit of 1 MiB" in (
            blocked.last_error.message or ""
        )
        assert await outbox_count(engine, table) == BIG_ROWS  # kept, every ordinary row handled
        peak = peak_rss_mib(worker.pid)
        record_property("worker_peak_rss_mib", round(peak, 1))
        assert peak < PEAK_LIMIT_MIB, f"the worker peaked at {peak:.1f} MiB"
        assert worker.running
    finally:
        code = await worker.stop()
    assert code == 0, worker.output()[-5000:]
