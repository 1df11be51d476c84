"""One fault scenario: its table, its workers, its workload, and the final check."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from tests.faults.fault_app import ERROR_CANARY, PAYLOAD_CANARY
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
from tests.faults.history import Shard, Verdict, Workload, check, prepare_fault_table, read_history


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

    def worker(self, name: str = "worker", **settings: str) -> WorkerProcess:
        env = worker_env(
            self.database_url, self.temporal_address, self.table, self.task_queue, **settings
        )
        worker = WorkerProcess(env, self.logs, name)
        self.workers.append(worker)
        return worker

    def workload(self, shards: Iterable[Shard], **options: object) -> Workload:
        return Workload(self.engine, self.table, list(shards), **options)  # type: ignore[arg-type]

    async def drained(self, timeout: float, left: int = 0) -> float:
        """Wait until the table is drained; returns the seconds since the last fault."""
        await wait_drained(self.engine, self.table, timeout=timeout, left=left)
        return self.clock.since_fault()

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
        pending_ok: Iterable[int] = (),
        redacted: bool = False,
    ) -> Verdict:
        """Stop the workers, check the history against the invariants of the design contract
        (docs/explanation/contract.md), check that no payload (and, when ``redacted``, no
        error message) reached Temporal and that no worker printed the database password,
        and record the scenario's figures. ``faults`` may name the number of failed handler
        calls as ``{failed}``.

        ``max_duplicates`` is the most repeated calls that the scenario's faults can explain;
        with ``repeats_only_after_kills``, every repeat must repeat a call of a worker process
        that was killed (the scenario's only fault that can repeat a call)."""
        for worker in self.workers:
            code = await worker.stop()
            assert code == 0, f"{worker.name} exited {code}\n{worker.output()[-5000:]}"
            worker.check_output()
        history = await read_history(self.engine, self.table)
        killed = [pid for worker in self.workers for pid in worker.killed_pids]
        verdict = check(
            history,
            workload.rolled_back,
            pending_ok=pending_ok,
            max_duplicates=max_duplicates,
            killed_pids=killed if repeats_only_after_kills else None,
        )
        record(
            Figures(
                scenario=self.name,
                rows=verdict.rows,
                faults=faults.format(failed=verdict.failed_calls),
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
