"""The advisory locks: a drain round of a shard runs only under its shard's lock, and a call of
a handler with a fleet-wide limit under one of its slots' locks."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox_bridge.db.driver import Compiled, rows_of
from outbox_bridge.workflows.models import ShardRef

# SQLSTATE of a lock wait that ran into lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"


def lock_key(shard: ShardRef) -> str:
    return f"outbox:{shard.table}:{shard.region or ''}:{shard.scope}:{shard.shard_identifier}"


TRY_LOCK_SHARDS = text(
    "SELECT pg_try_advisory_lock(hashtextextended(k, 0)) "
    "FROM unnest(CAST(:keys AS text[])) WITH ORDINALITY AS u(k, n) ORDER BY n"
)
_TRY_LOCK = Compiled.of(TRY_LOCK_SHARDS)


async def try_lock_shards(conn: AsyncConnection, shards: Sequence[ShardRef]) -> list[bool]:
    """Take the free advisory locks of ``shards`` in one statement; which were taken, in order.
    Session locks, not transaction ones (no transaction stays open while a handler runs): a
    crashed worker's closed connection releases them."""
    if not shards:
        return []
    keys = [lock_key(shard) for shard in shards]
    return [bool(taken) for (taken,) in await rows_of(conn, _TRY_LOCK, {"keys": keys})]


UNLOCK_SHARDS = text(
    "SELECT pg_advisory_unlock(hashtextextended(k, 0)) FROM unnest(CAST(:keys AS text[])) AS u(k)"
)


async def unlock_shards(conn: AsyncConnection, shards: Sequence[ShardRef]) -> None:
    """Release the advisory locks of ``shards`` held by this connection."""
    await unlock_keys(conn, [lock_key(shard) for shard in shards])


async def unlock_keys(conn: AsyncConnection, keys: Sequence[str]) -> None:
    """Release the advisory locks of ``keys`` held by this connection."""
    if keys:
        await conn.execute(UNLOCK_SHARDS, {"keys": list(keys)})


# Up to ``wanted`` free slots of each limit, slot n being the lock of prefix || n. CASE keeps a
# slot this session holds from being locked a second time (session locks stack); LIMIT stops
# the scan, and so the locking, once enough slots are taken.
TRY_SLOTS = text(
    "SELECT w.n, s.slot FROM unnest(CAST(:prefixes AS text[]), CAST(:sizes AS bigint[]), "
    "CAST(:wanted AS int[])) WITH ORDINALITY AS w(prefix, size, wanted, n) "
    "CROSS JOIN LATERAL (SELECT g.slot FROM generate_series(0, w.size - 1) AS g(slot) "
    "WHERE CASE WHEN w.prefix || g.slot = ANY (CAST(:held AS text[])) THEN false "
    "ELSE pg_try_advisory_lock(hashtextextended(w.prefix || g.slot, 0)) END "
    "LIMIT w.wanted) AS s"
)


async def try_slots(
    conn: AsyncConnection, wants: Sequence[tuple[str, int, int]], held: Sequence[str]
) -> list[tuple[int, int]]:
    """Take free slots of limits given as ``(prefix, size, wanted)``, in one statement, never
    one of ``held`` (the keys this connection holds): ``(index in wants, slot)`` of each taken."""
    if not wants:
        return []
    prefixes, sizes, wanted = zip(*wants, strict=True)
    result = await conn.execute(
        TRY_SLOTS,
        {
            "prefixes": list(prefixes),
            "sizes": list(sizes),
            "wanted": list(wanted),
            "held": list(held),
        },
    )
    return [(int(n) - 1, int(slot)) for n, slot in result]


async def lock_shard_waiting(conn: AsyncConnection, shard: ShardRef, seconds: float) -> bool:
    """Take ``shard``'s advisory lock, waiting at most ``seconds`` (a skip waits for a drain
    round of the shard to end rather than fail). False if the wait ran out."""
    timeout = f"{max(1, int(seconds * 1000))}ms"
    await conn.execute(
        text("SELECT set_config('lock_timeout', :timeout, false)"), {"timeout": timeout}
    )
    try:
        await conn.execute(
            text("SELECT pg_advisory_lock(hashtextextended(:key, 0))"), {"key": lock_key(shard)}
        )
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            return False
        raise
    finally:
        await conn.execute(text("SELECT set_config('lock_timeout', '0', false)"))
    return True
