"""One fault scenario: its table, its workers, its workload, and the final check; and the
variants each scenario runs in.

Every scenario has a fast variant, run by default, and a full one (``pytest -m faults``); the
slowest fast variants run only with the full ones (:func:`variants`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from outbox_bridge import OutboxSettings
from outbox_bridge.runtime.shards import WORKFLOW as SHARD_WORKFLOW
from tests.faults.fault_app import ERROR_CANARY, PAYLOAD_CANARY, FaultScope
from tests.faults.harness import (
    Clock,
    Figures,
    WorkerProcess,
    histories_containing,
    new_table,
    new_task_queue,
    wait_drained,
    worker_env,
)
from tests.faults.history import (
    CallRow,
    Shard,
    Verdict,
    Workload,
    check,
    hung_in,
    prepare_fault_table,
    read_history,
    repeats_per_fault,
)
from tests.harness import wait_until

FULL = [pytest.mark.faults, pytest.mark.timeout(1800)]


def variants(fast: Any, full: Any, *, fast_by_default: bool = True) -> list[Any]:
    """Parameters of a scenario (its size): its fast variant and its full variant (``pytest -m
    faults``). The fast variant runs by default, unless ``fast_by_default`` is False (the
    slowest of them): then with the full ones, so that the default suite stays short."""
    fast_marks = [] if fast_by_default else [pytest.mark.faults]
    return [
        pytest.param(fast, id="fast", marks=fast_marks),
        pytest.param(full, id="full", marks=FULL),
    ]


@dataclass
class Scenario:
    name: str
    engine: AsyncEngine
    database_url: str  # with the password canary
    password: str
    temporal_address: str
    logs: Path
    table: str = field(default_factory=new_table)
    task_queue: str = field(default_factory=new_task_queue)
    workers: list[WorkerProcess] = field(default_factory=list)
    clock: Clock = field(default_factory=Clock)

    async def prepare(self, **control: object) -> None:
        await prepare_fault_table(self.engine, self.table, **control)

    def env(self, **settings: str) -> dict[str, str]:
        """The settings of this scenario's workers, also for its command-line calls."""
        return worker_env(
            self.database_url,
            self.temporal_address,
            self.table,
            self.task_queue,
            **settings,
        )

    def worker(self, name: str = "worker", **settings: str) -> WorkerProcess:
        worker = WorkerProcess(self.env(**settings), self.logs, name)
        self.workers.append(worker)
        return worker

    def workload(self, shards: Iterable[Shard], **options: object) -> Workload:
        return Workload(self.engine, self.table, list(shards), **options)  # type: ignore[arg-type]

    async def drained(self, timeout: float, left: int = 0) -> float:
        """Wait until the table is drained; returns the seconds since the last fault."""
        await wait_drained(self.engine, self.table, timeout=timeout, left=left)
        return self.clock.since_fault()

    async def hung_worker(self) -> tuple[WorkerProcess, WorkerProcess]:
        """Once a call of this scenario hangs (see ``hang_objects``): the worker whose call it
        is, and the other of its two workers."""

        async def hanging() -> bool:
            return bool(await hung_in(self.engine, self.table))

        await wait_until(hanging, timeout=60, what="a call hanging")
        [pid] = await hung_in(self.engine, self.table)
        [hung] = [worker for worker in self.workers if worker.pid == pid]
        [other] = [worker for worker in self.workers if worker is not hung]
        return hung, other

    async def held_shards(self) -> int:
        """Shards that their own workflow holds (rows of ``<table>_owners``)."""
        async with self.engine.connect() as conn:
            result = await conn.execute(text(f"SELECT count(*) FROM {self.table}_owners"))
            return int(result.scalar_one())

    async def running_shard_workflows(self, client: Client) -> list[str]:
        """Ids of the running OutboxShard workflows of this scenario's task queue."""
        query = (
            f"WorkflowType = '{SHARD_WORKFLOW}' AND ExecutionStatus = 'Running' "
            f"AND TaskQueue = '{self.task_queue}'"
        )
        return [execution.id async for execution in client.list_workflows(query)]

    async def settled(self, client: Client, timeout: float = 60) -> None:
        """Nobody is stuck: with the table drained, every shard was given back (no shard is
        held) and no shard workflow runs any more (each completes once its shard is empty)."""

        async def settled() -> bool:
            return not await self.held_shards() and not await self.running_shard_workflows(client)

        try:
            await wait_until(settled, timeout=timeout, interval=0.5, what="shards given back")
        except AssertionError:
            held = await self.held_shards()
            running = await self.running_shard_workflows(client)
            raise AssertionError(
                f"stuck after the drain: {held} shard(s) held, shard workflows running: "
                f"{running[:5]}"
            ) from None

    async def finish(
        self,
        workload: Workload,
        *,
        faults: str,
        recovery: float,
        client: Client,
        record: Callable[[Figures], None],
        max_duplicates: int,
        repeats_only_after_kills: bool = False,
        max_repeats_per_kill: int | None = None,
        faults_at: Sequence[float] = (),
        max_repeats_per_fault: int | None = None,
        pending_ok: Iterable[int] = (),
        redacted: bool = False,
        settle: bool = True,
    ) -> Verdict:
        """Check that nobody is stuck (:meth:`settled`, unless ``settle`` is False: rows are
        left pending on purpose), stop the workers, check the history against the invariants
        of the design contract (docs/explanation/contract.md), check that no payload (and,
        when ``redacted``, no error message) reached Temporal and that no worker printed the
        database password, and record the scenario's figures. ``faults`` may name the number
        of failed handler calls as ``{failed}``, the spread of the repeats per killed process
        as ``{per_kill}``, the most calls a killed process had under way at once in its last second
        as ``{at_kill}``, and per fault of ``faults_at`` as ``{per_fault}``.

        ``max_duplicates`` is the most repeated calls that the scenario's faults can explain;
        with ``repeats_only_after_kills``, every repeat must repeat a call of a worker process
        that was killed (the scenario's only fault that can repeat a call), and at most
        ``max_repeats_per_kill`` may repeat the calls of any one killed process. With
        ``faults_at`` (when each fault struck, by ``time.time()``) and
        ``max_repeats_per_fault``, every repeat must follow one of those faults, at most that
        many per fault (:func:`~tests.faults.history.repeats_per_fault`)."""
        if settle:
            await self.settled(client)
        for worker in self.workers:
            code = await worker.stop()
            assert code == 0, f"{worker.name} exited {code}\n{worker.output()[-5000:]}"
            worker.check_output()
        history = await read_history(self.engine, self.table)
        killed = [pid for worker in self.workers for pid in worker.killed_pids]
        # Each process sees every row committed before it started: it handles each of their
        # groups with its newest row.
        visible = {
            pid: workload.committed_before(moment)
            for worker in self.workers
            for pid, moment in zip(worker.pids, worker.started_at, strict=True)
        }
        verdict = check(
            history,
            workload.rolled_back,
            pending_ok=pending_ok,
            max_duplicates=max_duplicates,
            killed_pids=killed if repeats_only_after_kills else None,
            max_repeats_per_pid=max_repeats_per_kill,
            visible_to=visible,
        )
        per_fault, unexplained = repeats_per_fault(verdict.repeat_calls, faults_at)
        if max_repeats_per_fault is not None:
            if unexplained:
                verdict.excess_duplicates.append(
                    f"{unexplained} duplicate calls started before the first fault"
                )
            for number, count in enumerate(per_fault, 1):
                if count > max_repeats_per_fault:
                    verdict.excess_duplicates.append(
                        f"fault {number} cost {count} repeated calls, more than the "
                        f"{max_repeats_per_fault} allowed per fault"
                    )
        record(
            Figures(
                scenario=self.name,
                rows=verdict.rows,
                faults=faults.format(
                    failed=verdict.failed_calls,
                    per_kill=spread([verdict.repeats_by_pid.get(pid, 0) for pid in killed]),
                    at_kill=spread(
                        [calls_at_once_before_end(history.calls, pid) for pid in killed]
                    ),
                    per_fault=spread(per_fault),
                ),
                lost=len(verdict.lost),
                order_violations=len(verdict.order_violations),
                overlaps=len(verdict.overlaps),
                duplicates=verdict.duplicates,
                recovery_seconds=recovery,
            )
        )
        assert verdict.rows == workload.committed
        assert not verdict.problems, verdict.summary()
        outputs = "\n".join(worker.output() for worker in self.workers)
        assert self.password not in outputs, "a worker printed the database password"
        found = await histories_containing(client, [PAYLOAD_CANARY, ERROR_CANARY])
        assert not found[PAYLOAD_CANARY], f"payloads in history: {found[PAYLOAD_CANARY][:3]}"
        if redacted:
            assert not found[ERROR_CANARY], f"error messages in history: {found[ERROR_CANARY][:3]}"
            if verdict.failed_calls:
                # Full details still go to the logs.
                assert ERROR_CANARY in outputs
        return verdict


# Settings of the workers whose repeats a scenario bounds: calls at once few enough that a
# bound broken by a few dozen groups fails the scenario (the default, 1,000, would hide it).
COUNTED_WORKER = {"OUTBOX_MAX_CONCURRENT_CALLS": "40"}


def repeats_per_lost_round() -> int:
    """The groups a worker of :data:`COUNTED_WORKER` may have handled and not deleted: its
    ``max_undeleted_groups``, by default as many calls as it can run at once (the fault app has
    async handlers: ``max_concurrent_calls``). A kill -9 repeats them; a lost connection
    repeats those of the shards another execution took in between."""
    assert OutboxSettings.model_fields["max_undeleted_groups"].default is None
    return int(COUNTED_WORKER["OUTBOX_MAX_CONCURRENT_CALLS"])


def repeats_per_kill(shards: Iterable[Shard]) -> int:
    """The most successful calls one ``kill -9`` of a worker of :data:`COUNTED_WORKER` can
    repeat, as the guarantees page bounds it ("Repeats per kill"): the groups its drains had
    handled and not deleted yet (:func:`repeats_per_lost_round`), and the calls under way: at
    most ``max_concurrent_calls``, and one per handler thread for the plain-def handlers and
    one per shard for the async ones (the fault app's USER shards)."""
    threads = OutboxSettings.model_fields["handler_threads"].default
    async_shards = sum(1 for scope, _ in shards if scope == FaultScope.USER)
    calls = int(COUNTED_WORKER["OUTBOX_MAX_CONCURRENT_CALLS"])
    return repeats_per_lost_round() + min(calls, int(threads) + async_shards)


def calls_at_once_before_end(calls: Iterable[CallRow], pid: int, window: float = 1.0) -> int:
    """The most calls of process ``pid`` under way at once in the ``window`` seconds before its
    last recorded call ended: for a killed process, about the concurrency at the kill (a call
    is recorded as it returns, so those the kill cut off are not counted)."""
    mine = [call for call in calls if call.pid == pid]
    if not mine:
        return 0
    end = max(call.finished for call in mine)
    edges = sorted(
        edge
        for call in mine
        if call.finished >= end - window
        for edge in ((call.started, 1), (call.finished, -1))
    )
    most = running = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def spread(counts: list[int]) -> str:
    """``median m, low–high`` of ``counts``."""
    if not counts:
        return "none"
    return f"median {statistics.median(counts):g}, {min(counts)}–{max(counts)}"
