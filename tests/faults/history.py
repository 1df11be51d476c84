"""What the fault scenarios record, the workload they write, and the check of the recorded
history against the invariants of the design contract (docs/explanation/contract.md).

Three tables, shared by every scenario and keyed by outbox table:

- ``fault_truth``: one row per committed outbox row, with its payload, written in the same
  transaction as the outbox row, so a rolled-back outbox row leaves no trace in it either.
- ``fault_calls``: one row per handler call, with what the handler was told about its row (a
  digest of the payload it was given among it), written by the handler on its own connection
  and committed before the handler returns (:mod:`tests.faults.fault_app`).
- ``fault_deletions``: one row per deleted outbox row, written by a trigger in the deleting
  transaction.

Calls and deletions take their ``seq`` from one sequence, so their order is the order in which
they happened: a deletion of a row must come after a successful call of its coalescing group
with an id at least its own.
"""

from __future__ import annotations

import bisect
import heapq
import random
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox_bridge.db.install import create_outbox_tables
from tests.faults.fault_app import (
    PAYLOAD_CANARY,
    FaultCategory,
    FaultScope,
    make_app,
    payload_digest,
)

LOG_DDL = [
    "CREATE SEQUENCE IF NOT EXISTS fault_event_seq",
    """
    CREATE TABLE IF NOT EXISTS fault_calls (
        seq bigint PRIMARY KEY DEFAULT nextval('fault_event_seq'),
        outbox_table text NOT NULL,
        row_id bigint NOT NULL,
        shard_scope int NOT NULL,
        shard_identifier bigint NOT NULL,
        category int NOT NULL,
        object_identifier bigint NOT NULL,
        coalesced int NOT NULL,
        pid int NOT NULL,
        process_seq bigint NOT NULL,
        started double precision NOT NULL,
        finished double precision NOT NULL,
        outcome text NOT NULL,
        handler text NOT NULL,
        region text,
        payload_type text,
        payload_bytes int,
        payload_digest text
    )
    """,
    "ALTER TABLE fault_calls ADD COLUMN IF NOT EXISTS payload_digest text",
    "CREATE INDEX IF NOT EXISTS fault_calls_table_idx ON fault_calls (outbox_table, seq)",
    """
    CREATE TABLE IF NOT EXISTS fault_truth (
        outbox_table text NOT NULL,
        row_id bigint NOT NULL,
        shard_scope int NOT NULL,
        shard_identifier bigint NOT NULL,
        category int NOT NULL,
        object_identifier bigint NOT NULL,
        payload jsonb,
        PRIMARY KEY (outbox_table, row_id)
    )
    """,
    "ALTER TABLE fault_truth ADD COLUMN IF NOT EXISTS payload jsonb",
    """
    CREATE TABLE IF NOT EXISTS fault_deletions (
        seq bigint NOT NULL DEFAULT nextval('fault_event_seq'),
        outbox_table text NOT NULL,
        row_id bigint NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS fault_deletions_table_idx ON fault_deletions (outbox_table)",
    """
    CREATE TABLE IF NOT EXISTS fault_control (
        outbox_table text PRIMARY KEY,
        failure_rate double precision NOT NULL DEFAULT 0,
        poison_shards bigint[] NOT NULL DEFAULT '{}',
        hang_objects bigint[] NOT NULL DEFAULT '{}',
        hang_seconds double precision NOT NULL DEFAULT 0
    )
    """,
    "ALTER TABLE fault_control ADD COLUMN IF NOT EXISTS slow_shards bigint[] NOT NULL DEFAULT '{}'",
    "ALTER TABLE fault_control ADD COLUMN IF NOT EXISTS slow_seconds double precision NOT NULL "
    "DEFAULT 0",
    # The processes whose calls took a hang, in order.
    "ALTER TABLE fault_control ADD COLUMN IF NOT EXISTS hung_pids bigint[] NOT NULL DEFAULT '{}'",
    """
    CREATE OR REPLACE FUNCTION fault_log_deletions() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO fault_deletions (outbox_table, row_id) SELECT TG_TABLE_NAME, id FROM old_rows;
        RETURN NULL;
    END
    $$
    """,
]


async def prepare_fault_table(engine: AsyncEngine, table: str, **control: Any) -> None:
    """Create the log tables (once), the outbox table ``table`` with its deletion log trigger,
    and its control row (``failure_rate``, ``poison_shards``, ``hang_objects``,
    ``slow_shards``, ...)."""
    app = make_app(table)
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended('faults', 0))"))
        for statement in LOG_DDL:
            await conn.execute(text(statement))
        await create_outbox_tables(conn, app.metadata)
        await conn.execute(
            text(
                f"CREATE OR REPLACE TRIGGER {table}_fault_deletions AFTER DELETE ON {table} "
                "REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT "
                "EXECUTE FUNCTION fault_log_deletions()"
            )
        )
        await conn.execute(
            text("INSERT INTO fault_control (outbox_table) VALUES (:t)"), {"t": table}
        )
    if control:
        await set_control(engine, table, **control)


async def set_control(engine: AsyncEngine, table: str, **values: Any) -> None:
    """Change what the fault app's handlers do (they see it within 0.2 s)."""
    assignments = ", ".join(f"{name} = :{name}" for name in values)
    async with engine.begin() as conn:
        await conn.execute(
            text(f"UPDATE fault_control SET {assignments} WHERE outbox_table = :t"),
            {**values, "t": table},
        )


async def hung_in(engine: AsyncEngine, table: str) -> list[int]:
    """The processes whose calls took a hang so far, in order (each hanging object hangs
    once)."""
    async with engine.connect() as conn:
        found = await conn.execute(
            text("SELECT hung_pids FROM fault_control WHERE outbox_table = :t"), {"t": table}
        )
        return list(found.scalar_one())


# -- the workload ---------------------------------------------------------------------------

Shard = tuple[int, int]  # scope, shard identifier


@dataclass
class Workload:
    """Writes rows the way an application does: in transactions of a few rows, each outbox
    row with its ``fault_truth`` row, and one transaction in ``rollback_share`` rolled back
    (its ids remembered). Payloads carry :data:`PAYLOAD_CANARY` and a number of their own, so
    that no two rows have the same payload."""

    engine: AsyncEngine
    table: str
    shards: Sequence[Shard]
    objects: int = 10
    batch: int = 20
    rollback_share: float = 0.05
    seed: int = 1
    committed: int = 0
    rolled_back: list[int] = field(default_factory=list)
    # (time.monotonic() once the commit had returned, the transaction's highest id), in order.
    commits: list[tuple[float, int]] = field(default_factory=list)
    _random: random.Random = field(init=False)
    _written: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    async def write(self, rows: int, *, shards: Sequence[Shard] | None = None) -> None:
        """Commit ``rows`` more rows (plus the rolled-back ones), spread over ``shards``."""
        target = self.committed + rows
        while self.committed < target:
            size = min(self.batch, target - self.committed)
            rollback = self._random.random() < self.rollback_share
            await self._transaction(self._rows(size, shards or self.shards), rollback)

    async def write_exact(self, rows: Sequence[tuple[int, int, int, int]]) -> None:
        """Commit exactly ``rows`` (scope, shard identifier, category, object identifier)."""
        await self._transaction(list(rows), rollback=False)

    def _rows(self, size: int, shards: Sequence[Shard]) -> list[tuple[int, int, int, int]]:
        rows = []
        for _ in range(size):
            scope, ident = self._random.choice(shards)
            if scope == FaultScope.USER:
                category = FaultCategory.USER_UPDATE
            else:
                category = self._random.choice(
                    [
                        FaultCategory.ORGANIZATION_UPDATE,
                        FaultCategory.PROJECT_UPDATE,
                        FaultCategory.MEMBER_UPDATE,
                    ]
                )
            rows.append((scope, ident, int(category), self._random.randrange(self.objects)))
        return rows

    async def _transaction(self, rows: list[tuple[int, int, int, int]], rollback: bool) -> None:
        scopes, shards, categories, objects = (list(column) for column in zip(*rows, strict=True))
        numbers = list(range(self._written, self._written + len(rows)))
        self._written += len(rows)
        statement = text(
            f"""
            WITH new AS (
                INSERT INTO {self.table}
                    (shard_scope, shard_identifier, category, object_identifier, payload)
                SELECT s, i, c, o, jsonb_build_object('canary', CAST(:canary AS text), 'n', n)
                FROM unnest(CAST(:scopes AS int[]), CAST(:shards AS bigint[]),
                            CAST(:categories AS int[]), CAST(:objects AS bigint[]),
                            CAST(:numbers AS bigint[])) AS r(s, i, c, o, n)
                ORDER BY n
                RETURNING id, shard_scope, shard_identifier, category, object_identifier,
                          payload
            )
            INSERT INTO fault_truth (outbox_table, row_id, shard_scope, shard_identifier,
                                     category, object_identifier, payload)
            SELECT :table, id, shard_scope, shard_identifier, category, object_identifier,
                   payload
            FROM new
            RETURNING row_id
            """
        )
        params = {
            "table": self.table,
            "canary": PAYLOAD_CANARY,
            "scopes": scopes,
            "shards": shards,
            "categories": categories,
            "objects": objects,
            "numbers": numbers,
        }
        async with self.engine.connect() as conn:
            transaction = await conn.begin()
            ids = list((await conn.execute(statement, params)).scalars())
            if rollback:
                await transaction.rollback()
                self.rolled_back.extend(ids)
            else:
                await transaction.commit()
                self.commits.append((time.monotonic(), max(ids)))
                self.committed += len(ids)

    def committed_before(self, moment: float) -> int:
        """The highest id committed before ``moment`` (``time.monotonic()``): every read of a
        process started after it sees every row up to that id that is still there."""
        at = bisect.bisect_left(self.commits, (moment, -1))
        return max((row_id for _, row_id in self.commits[:at]), default=0)


# -- reading the history ----------------------------------------------------------------------


@dataclass(frozen=True)
class TruthRow:
    id: int
    shard: Shard
    group: tuple[int, int]  # category, object identifier
    payload_digest: str  # of the payload committed with the row (see payload_digest)


@dataclass(frozen=True)
class CallRow:
    seq: int
    row_id: int
    shard: Shard
    group: tuple[int, int]
    pid: int
    started: float
    finished: float
    outcome: str  # ok, failed, cancelled
    payload_digest: str | None  # of the payload the handler was given
    coalesced: int | None = None  # the rows the handler was told its call covers


@dataclass
class History:
    truth: list[TruthRow]
    calls: list[CallRow]
    deletions: list[tuple[int, int]]  # seq, row id
    remaining: set[int]


async def read_history(engine: AsyncEngine, table: str) -> History:
    async with engine.connect() as conn:
        truth = [
            TruthRow(
                r.row_id,
                (r.shard_scope, r.shard_identifier),
                (r.category, r.object_identifier),
                payload_digest(r.payload),
            )
            for r in await conn.execute(
                text(
                    "SELECT row_id, shard_scope, shard_identifier, category, object_identifier, "
                    "payload FROM fault_truth WHERE outbox_table = :t"
                ),
                {"t": table},
            )
        ]
        calls = [
            CallRow(
                r.seq,
                r.row_id,
                (r.shard_scope, r.shard_identifier),
                (r.category, r.object_identifier),
                r.pid,
                r.started,
                r.finished,
                r.outcome,
                r.payload_digest,
                r.coalesced,
            )
            for r in await conn.execute(
                text(
                    "SELECT seq, row_id, shard_scope, shard_identifier, category, "
                    "object_identifier, pid, started, finished, outcome, payload_digest, "
                    "coalesced FROM fault_calls WHERE outbox_table = :t ORDER BY seq"
                ),
                {"t": table},
            )
        ]
        deletions = [
            (r.seq, r.row_id)
            for r in await conn.execute(
                text("SELECT seq, row_id FROM fault_deletions WHERE outbox_table = :t"),
                {"t": table},
            )
        ]
        remaining = set((await conn.execute(text(f"SELECT id FROM {table}"))).scalars())
    return History(truth, calls, deletions, remaining)


# -- checking it against the invariants of the design contract --------------------------------


@dataclass
class Verdict:
    """What :func:`check` found. Every list of problems must be empty; ``duplicates`` are
    allowed up to the scenario's ceiling, and each is described in ``repeats``."""

    rows: int
    calls: int
    failed_calls: int
    # §3.1: deleted before a successful call of its group covered it, or never handled.
    lost: list[str] = field(default_factory=list)
    # §3.2: a group handled while a lower pending id of another group was not yet handled.
    order_violations: list[str] = field(default_factory=list)
    # §3.3: a call that did not cover every pending row of its group up to its id (or claimed
    # more): the group was not coalesced into its newest row.
    uncoalesced: list[str] = field(default_factory=list)
    # §3.5: two calls of one shard running at the same time.
    overlaps: list[str] = field(default_factory=list)
    # §3.1: a handler ran for a row that was rolled back (or never written), or was told a
    # shard or group that no committed row has.
    phantom_calls: list[str] = field(default_factory=list)
    # A handler was given a row with another row's shard, category, object identifier or
    # payload.
    mismatched_calls: list[str] = field(default_factory=list)
    # §3.5: successful calls that covered a row already covered (at least once: allowed, up
    # to a ceiling that the scenario's faults justify).
    duplicates: int = 0
    repeats: list[str] = field(default_factory=list)
    # For each process, how many duplicates repeated one of its calls (the latest call that
    # had covered the repeated rows): after kill -9, what each kill cost.
    repeats_by_pid: Counter[int] = field(default_factory=Counter)
    # The duplicate calls themselves (when each started tells which fault cost it, see
    # repeats_per_fault).
    repeat_calls: list[CallRow] = field(default_factory=list)
    # More duplicates than the ceiling, or (when the killed processes are known) a repeat of
    # a call whose process was never killed.
    excess_duplicates: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return (
            self.lost
            + self.order_violations
            + self.uncoalesced
            + self.overlaps
            + self.phantom_calls
            + self.mismatched_calls
            + self.excess_duplicates
        )

    def summary(self) -> str:
        return (
            f"{self.rows} rows, {self.calls} calls ({self.failed_calls} failed), "
            f"{len(self.lost)} lost, {len(self.order_violations)} order violations, "
            f"{len(self.uncoalesced)} uncoalesced calls, "
            f"{len(self.overlaps)} overlaps, {len(self.phantom_calls)} phantom calls, "
            f"{len(self.mismatched_calls)} mismatched calls, "
            f"{self.duplicates} duplicates ({len(self.excess_duplicates)} problems); "
            f"first problems: {self.problems[:5]}"
        )


@dataclass
class _ShardState:
    open_ids: list[int] = field(default_factory=list)  # a heap; closed ids are dropped lazily


def check(
    history: History,
    rolled_back: Iterable[int],
    *,
    pending_ok: Iterable[int] = (),
    max_duplicates: int = 0,
    killed_pids: Collection[int] | None = None,
    max_repeats_per_pid: int | None = None,
    visible_to: Mapping[int, int] | None = None,
) -> Verdict:
    """Check ``history`` against the invariants of the design contract
    (docs/explanation/contract.md).

    Every call is judged by the truth row of the id it names, never by what the handler was
    told about that row: a call whose shard, category or object identifier differs from its
    row's, or that was given a payload other than its row's, is a *mismatched* call, and a
    call naming an id, a shard or a group that no committed row has is a *phantom* call. Coverage, order and overlaps follow the truth row.

    A row is *covered* once a successful call of its coalescing group had an id at least its
    own, *pending* until it is deleted, and *open* while it is pending and not covered.

    - No loss: every deleted row was covered before its deletion; every committed row is
      deleted by the end (except ``pending_ok``), and deleted by a recorded delete; the
      latest row of every group was handled with its own id.
    - Coalescing: a call covers every pending row of its group up to its id, no more and no
      fewer (the ``coalesced`` count it was told). With ``visible_to`` (for each process, the
      highest id committed before it started, so visible to its every read), a call is for
      the newest pending row of its group that its process could see: a group is handled
      once, with its highest id.
    - Order: a call handles a group whose lowest pending id (at the call) is below every open
      row of its shard. So a shard's groups run in order of their lowest pending id, a failing
      head blocks the rows behind it, and the only way back to a lower id is a group that was
      already covered and is repeated (after a crash or a timeout, before its rows were
      deleted). A call for a group whose rows up to its id were all deleted is a violation.
    - No overlap: the calls of one shard never run at the same time.
    - No call for a row that was rolled back or never written.
    - At most ``max_duplicates`` successful calls that covered a row already covered (zero
      unless the scenario injects a fault that can repeat a call). With ``killed_pids``, the
      processes that were killed with ``kill -9``: every such repeat must repeat a call of one
      of them (the only processes that can die between a call and its delete).
    - With ``max_repeats_per_pid``, at most that many of these repeat calls of any one process
      (after kill -9: at most that many per kill).

    The check relies on ids committing in ascending order (one producer, as in the
    scenarios): then every row below a call's id committed before the call.
    """
    rows = {row.id: row for row in history.truth}
    rolled = set(rolled_back)
    verdict = Verdict(
        rows=len(rows),
        calls=len(history.calls),
        failed_calls=sum(1 for c in history.calls if c.outcome != "ok"),
    )
    payloads = {truth.payload_digest: truth.id for truth in rows.values()}
    group_ids: dict[tuple[Shard, tuple[int, int]], list[int]] = defaultdict(list)
    shards: dict[Shard, _ShardState] = defaultdict(_ShardState)
    for truth in sorted(rows.values(), key=lambda r: r.id):
        group_ids[(truth.shard, truth.group)].append(truth.id)
        shards[truth.shard].open_ids.append(truth.id)  # ascending: already a heap
    deleted: set[int] = set()
    covered: dict[int, CallRow] = {}  # row id: the latest successful call that covered it
    handled_ids: set[int] = set()
    events: list[tuple[int, int, Any]] = [(c.seq, 1, c) for c in history.calls]
    events += [(seq, 0, row_id) for seq, row_id in history.deletions]
    for seq, kind, item in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            row_id = item
            if row_id in rows and row_id not in covered:
                verdict.lost.append(f"row {row_id} deleted (seq {seq}) before it was handled")
            deleted.add(row_id)
            continue
        call: CallRow = item
        row = rows.get(call.row_id)
        if row is None:
            what = "rolled-back" if call.row_id in rolled else "never written"
            verdict.phantom_calls.append(f"call {call.seq} handled {what} row {call.row_id}")
            continue
        _compare(call, row, shards.keys(), group_ids.keys(), payloads, verdict)
        ids = group_ids[(row.shard, row.group)]
        pending = [i for i in ids if i <= row.id and i not in deleted]
        if not pending:
            verdict.order_violations.append(
                f"call {call.seq} handled row {row.id} after its group was deleted"
            )
            continue
        if call.coalesced is not None and call.coalesced != len(pending):
            verdict.uncoalesced.append(
                f"call {call.seq} of row {row.id} covered {call.coalesced} row(s) of group "
                f"{row.group} of shard {row.shard}; {len(pending)} were pending up to it: "
                f"{pending[:10]}"
            )
        if visible_to is not None:
            newer = _newer_visible(ids, row.id, visible_to.get(call.pid, 0), deleted)
            if newer is not None:
                verdict.uncoalesced.append(
                    f"call {call.seq} (pid {call.pid}) handled row {row.id} of group "
                    f"{row.group} of shard {row.shard} while its row {newer}, committed before "
                    "the process started, was pending"
                )
        heap = shards[row.shard].open_ids
        while heap and (heap[0] in deleted or heap[0] in covered):
            heapq.heappop(heap)
        if heap and heap[0] < pending[0]:
            verdict.order_violations.append(
                f"call {call.seq} handled group {row.group} of shard {row.shard} from id "
                f"{pending[0]} while row {heap[0]} of another group was pending"
            )
        if call.outcome == "ok":
            handled_ids.add(row.id)
            earlier = {covered[i].seq: covered[i] for i in pending if i in covered}
            if earlier:
                verdict.duplicates += 1
                _repeat(
                    call, row, sorted(earlier.values(), key=lambda c: c.seq), killed_pids, verdict
                )
            covered.update(dict.fromkeys(pending, call))
    pending_ok = set(pending_ok)
    for row_id in sorted(history.remaining - pending_ok):
        if row_id in rows:
            verdict.lost.append(f"row {row_id} is still in the table")
    for (shard, group), ids in group_ids.items():
        latest = ids[-1]
        if latest not in handled_ids and latest not in history.remaining:
            verdict.lost.append(f"latest row {latest} of group {group} in {shard} never handled")
    for row_id in sorted(rows.keys() - deleted - history.remaining):
        verdict.lost.append(f"row {row_id} vanished without a deletion")
    verdict.overlaps = _overlaps(history.calls, rows)
    if max_repeats_per_pid is not None:
        for pid, count in sorted(verdict.repeats_by_pid.items()):
            if count > max_repeats_per_pid:
                verdict.excess_duplicates.append(
                    f"{count} duplicate calls repeated calls of pid {pid}, more than the "
                    f"{max_repeats_per_pid} allowed per process"
                )
    if verdict.duplicates > max_duplicates:
        verdict.excess_duplicates.append(
            f"{verdict.duplicates} duplicate calls, more than the {max_duplicates} allowed; "
            f"first: {verdict.repeats[:3]}"
        )
    return verdict


def _newer_visible(
    ids: Sequence[int], handled: int, visible: int, deleted: Collection[int]
) -> int | None:
    """The newest row of a group (``ids``, ascending) above ``handled``, up to ``visible``,
    that is not ``deleted``; None if there is none."""
    above = ids[bisect.bisect_right(ids, handled) : bisect.bisect_right(ids, visible)]
    for row_id in reversed(above):
        if row_id not in deleted:
            return row_id
    return None


def _repeat(
    call: CallRow,
    row: TruthRow,
    earlier: Sequence[CallRow],
    killed_pids: Collection[int] | None,
    verdict: Verdict,
) -> None:
    """Describe a call that covered rows that ``earlier`` calls had covered already."""
    repeated = ", ".join(f"call {c.seq} (pid {c.pid})" for c in earlier)
    verdict.repeats_by_pid[earlier[-1].pid] += 1
    verdict.repeat_calls.append(call)
    verdict.repeats.append(
        f"call {call.seq} (pid {call.pid}) of row {row.id} in group {row.group} of shard "
        f"{row.shard} repeated {repeated}"
    )
    if killed_pids is None:
        return
    for previous in earlier:
        if previous.pid not in killed_pids:
            verdict.excess_duplicates.append(
                f"call {call.seq} (pid {call.pid}) of row {row.id} repeated call "
                f"{previous.seq} of pid {previous.pid}, which was not killed"
            )


def repeats_per_fault(
    repeats: Sequence[CallRow], faults_at: Sequence[float]
) -> tuple[list[int], int]:
    """How many of the duplicate calls ``repeats`` each fault cost (``faults_at``: when each
    fault struck, by ``time.time()``, ascending), and how many no fault explains. A repeat is
    the cost of the last fault before it started: the worker runs again what that fault kept
    it from deleting, as soon as it can."""
    counts = [0] * len(faults_at)
    unexplained = 0
    for call in repeats:
        index = bisect.bisect_right(faults_at, call.started) - 1
        if index >= 0:
            counts[index] += 1
        else:
            unexplained += 1
    return counts, unexplained


def _compare(
    call: CallRow,
    row: TruthRow,
    shards: Collection[Shard],
    groups: Collection[tuple[Shard, tuple[int, int]]],
    payloads: Mapping[str, int],
    verdict: Verdict,
) -> None:
    """Report what ``call`` was told about its row that the row's truth contradicts."""
    if call.shard not in shards or (call.shard, call.group) not in groups:
        verdict.phantom_calls.append(
            f"call {call.seq} of row {row.id} named group {call.group} of shard {call.shard}, "
            "which no committed row has"
        )
    elif (call.shard, call.group) != (row.shard, row.group):
        verdict.mismatched_calls.append(
            f"call {call.seq} of row {row.id} named group {call.group} of shard {call.shard}; "
            f"the row is in group {row.group} of shard {row.shard}"
        )
    if call.payload_digest != row.payload_digest:
        source = payloads.get(call.payload_digest or "")
        whose = f"row {source}'s" if source is not None else "no committed row's"
        verdict.mismatched_calls.append(
            f"call {call.seq} of row {row.id} was given {whose} payload"
        )


def _overlaps(calls: Sequence[CallRow], rows: Mapping[int, TruthRow]) -> list[str]:
    """Calls of one shard that ran at the same time, the shard of a call being its row's (the
    one it reported when its row is unknown)."""
    by_shard: dict[Shard, list[CallRow]] = defaultdict(list)
    for call in calls:
        row = rows.get(call.row_id)
        by_shard[row.shard if row is not None else call.shard].append(call)
    found = []
    for shard, shard_calls in by_shard.items():
        shard_calls.sort(key=lambda c: c.started)
        latest: CallRow | None = None
        for call in shard_calls:
            if latest is not None and call.started < latest.finished:
                found.append(
                    f"shard {shard}: call {call.seq} (pid {call.pid}) started while call "
                    f"{latest.seq} (pid {latest.pid}) was running"
                )
            if latest is None or call.finished > latest.finished:
                latest = call
    return found
