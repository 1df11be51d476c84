"""Synchronous flush (see the flush how-to): after a commit, each shard written to gets the
``flush`` update with start, answered once the shard handled the rows. It never raises after
the commit: it answers ``unavailable`` with a ``detail``. It first checks that a worker polls
its task queue: a workflow started where nobody polls would never run, nor be moved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Self

from sqlalchemy import event
from sqlalchemy.engine import Connection
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowUpdateFailedError,
    WorkflowUpdateHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.loop_thread import EventLoopThread, settle_native_threads_at_exit
from outbox_bridge.runtime.shards import WORKFLOW, start_arguments, static_skip, static_skips
from outbox_bridge.runtime.temporal import (
    PROBE_TIMEOUT,
    connect,
    task_queue_polled,
    temporal_address,
)
from outbox_bridge.sessions import CONTEXTS, LISTENING, session_info, sync_target
from outbox_bridge.workflows.models import FlushInput, FlushOutcome, FlushResult, ShardRef

log = logging.getLogger("outbox_bridge.flush")

DEFAULT_TIMEOUT = 10.0
# How much longer than the flush's own timeout the client waits for the update's answer.
ANSWER_GRACE = 5.0
# Errors that sending the update again cannot cure.
FINAL_RPC_STATUSES = frozenset(
    {
        RPCStatusCode.INVALID_ARGUMENT,
        RPCStatusCode.PERMISSION_DENIED,
        RPCStatusCode.UNAUTHENTICATED,
        RPCStatusCode.UNIMPLEMENTED,
    }
)
# A task queue seen with pollers is not asked about again for this long (seconds).
POLLERS_TRUSTED_FOR = 10.0


class _Unavailable(Exception):
    """Temporal cannot take the flush now (the message says why): answered ``unavailable``."""


class _NoWorker(_Unavailable):
    """No worker polls the flusher's task queue (logged once per absence, not per flush)."""


def check_timeout(timeout: float) -> None:
    if not 0 < timeout <= 3600:
        raise ValueError(f"flush timeout must be between 0 and 3600 seconds, got {timeout}")


def unavailable(targets: Mapping[ShardRef, int], detail: str) -> list[FlushResult]:
    """Every shard of ``targets`` answered ``unavailable``, for ``detail``."""
    return [FlushResult(shard.key, FlushOutcome.UNAVAILABLE, detail=detail) for shard in targets]


@dataclass
class FlushReport:
    """The answer of a flush: one :class:`FlushResult` per shard written to (in the order the
    shards were first written), and the shards whose rows had not committed when the context
    ended (not waited for)."""

    results: list[FlushResult] = field(default_factory=list)
    not_committed: list[str] = field(default_factory=list)

    @property
    def handled(self) -> bool:
        """Every row written in the context is handled."""
        return not self.not_committed and all(r.handled for r in self.results)

    def __getitem__(self, shard: str) -> FlushResult:
        for result in self.results:
            if result.shard == shard:
                return result
        raise KeyError(shard)

    def __iter__(self) -> Iterator[FlushResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON values (``json.dumps`` and Django's ``JsonResponse`` take it):
        ``handled``, ``results`` (each result's fields; ``outcome`` as its string) and
        ``not_committed``. A blocked shard's ``error`` holds its handler's exception message:
        leave it out of what a browser sees if that message may hold private data."""
        return {
            "handled": self.handled,
            "results": [
                {**asdict(result), "outcome": str(result.outcome)} for result in self.results
            ],
            "not_committed": list(self.not_committed),
        }


class Flusher:
    """Sends ``flush`` updates to shard workflows, for :func:`outbox_context` and the
    ``outbox-bridge flush`` command.

    Configured like the worker (``OutboxSettings``: Temporal address, namespace, TLS or API
    key, task queue and shard settings, which must match the worker's). Async callers may pass
    their own ``client``; sync callers get a client on a background event loop, which
    :meth:`close` stops (at interpreter exit at the latest: a process that flushed exits with
    its own exit code, whether Temporal answered, was down or was slow).
    """

    def __init__(
        self,
        app: OutboxApp,
        settings: OutboxSettings | None = None,
        *,
        client: Client | None = None,
    ) -> None:
        self._settings = settings if settings is not None else OutboxSettings()
        self._skips = static_skips(app, self._settings.skip_shards)
        self._client = client
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Client] = (
            weakref.WeakKeyDictionary()
        )
        self._loop_thread: EventLoopThread | None = None
        self._loop_lock = threading.Lock()
        self._polled_until = 0.0  # time.monotonic() until which the task queue has pollers
        self._absence_logged = False  # until a worker polls the task queue again

    # -- async ---------------------------------------------------------------------------------

    async def flush(
        self, targets: Mapping[ShardRef, int], timeout: float = DEFAULT_TIMEOUT
    ) -> list[FlushResult]:
        """Flush every shard of ``targets`` (shard → highest id to wait for) concurrently."""
        if not targets:
            return []
        check_timeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            client = await self._client_for_loop(deadline)
            await self._check_pollers(client, deadline)
        except _Unavailable as exc:
            log.log(
                logging.DEBUG if isinstance(exc, _NoWorker) else logging.WARNING,
                "flush of shard(s) %s not sent: %s; their rows are handled asynchronously",
                ", ".join(shard.key for shard in targets),
                exc,
            )
            return unavailable(targets, str(exc))
        flushes = [
            self._flush_one(client, shard, up_to, deadline) for shard, up_to in targets.items()
        ]
        return list(await asyncio.gather(*flushes))

    async def _client_for_loop(self, deadline: float) -> Client:
        if self._client is not None:
            return self._client
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            settings = self._settings
            # The SDK's threads may call back into Python after the flush gave up on them.
            settle_native_threads_at_exit()
            left = max(deadline - time.monotonic(), 0.0)
            try:  # a server that accepts connections and never answers: bounded by the deadline
                client = await asyncio.wait_for(connect(settings, temporal_address(settings)), left)
            except TimeoutError:
                raise _Unavailable(self._no_answer(f"no answer within {left:.1f} s")) from None
            except ConfigurationError as exc:  # cannot connect, or a TLS file is unreadable
                raise _Unavailable(str(exc)) from None
            self._clients[loop] = client
        return client

    async def _check_pollers(self, client: Client, deadline: float) -> None:
        """Return once a worker polls the task queue; else :class:`_NoWorker`, or
        :class:`_Unavailable` if Temporal does not answer by the deadline."""
        queue = self._settings.task_queue
        if time.monotonic() < self._polled_until:
            return
        try:
            polled = await task_queue_polled(client, queue, deadline)
        except RPCError as exc:
            raise _Unavailable(self._no_answer(exc.message)) from None
        except TimeoutError:
            raise _Unavailable(self._no_answer("no answer in time")) from None
        if polled is False:
            detail = (
                f"no worker polls task queue {queue!r} in namespace "
                f"{client.namespace!r}: the flusher's task queue (OUTBOX_TASK_QUEUE) must "
                "be the worker's. The shard's workflow was not started there"
            )
            if not self._absence_logged:
                self._absence_logged = True
                log.warning(
                    "%s; flushes answer unavailable and their rows are handled asynchronously "
                    "(logged once, until a worker polls the task queue)",
                    detail,
                )
            raise _NoWorker(detail)
        if polled:
            self._absence_logged = False
            self._polled_until = time.monotonic() + POLLERS_TRUSTED_FOR

    def _no_answer(self, why: str) -> str:
        return f"Temporal at {temporal_address(self._settings)} did not answer: {why}"

    async def _flush_one(
        self, client: Client, shard: ShardRef, up_to: int, deadline: float
    ) -> FlushResult:
        try:
            handle = await self._accepted(client, shard, up_to, deadline)
            if handle is None:
                return await self._timed_out(client, shard)
            # Accepted: the workflow does not complete before answering.
            left = max(deadline - time.monotonic(), 0.0)
            result: FlushResult = await asyncio.wait_for(handle.result(), left + ANSWER_GRACE)
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
            return await self._timed_out(client, shard)
        except (_Unavailable, RPCError, WorkflowUpdateFailedError) as exc:
            return _unanswered(shard, getattr(exc, "message", None) or str(exc))
        return result

    async def _timed_out(self, client: Client, shard: ShardRef) -> FlushResult:
        """``timed_out``, or ``unavailable`` when the server no longer answers (the client
        retries calls to an unreachable server until they are cancelled)."""
        try:
            await asyncio.wait_for(
                client.workflow_service.get_system_info(
                    GetSystemInfoRequest(), timeout=timedelta(seconds=PROBE_TIMEOUT)
                ),
                PROBE_TIMEOUT + 0.5,
            )
        except RPCError as exc:
            return _unanswered(shard, self._no_answer(exc.message))
        except TimeoutError:
            return _unanswered(shard, self._no_answer(f"no answer within {PROBE_TIMEOUT:.1f} s"))
        return FlushResult(shard.key, FlushOutcome.TIMED_OUT)

    async def _accepted(
        self, client: Client, shard: ShardRef, up_to: int, deadline: float
    ) -> WorkflowUpdateHandle[FlushResult] | None:
        """Deliver the update with start until the shard's workflow accepts it: a run that
        completes (its shard empty) while the update waits drops it, and the server reports it
        failed or not ready; sent again, it starts a new run, which answers from the table."""
        pause = 0.05
        last_error: RPCError | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if last_error is not None:  # every attempt failed, the last one with this
                    raise _Unavailable(self._no_answer(last_error.message))
                return None
            try:  # a delivery that waits on a busy workflow task: bounded by the deadline
                return await asyncio.wait_for(
                    client.start_update_with_start_workflow(
                        "flush",
                        FlushInput(up_to_id=up_to, timeout_seconds=left),
                        start_workflow_operation=self._start_operation(shard, up_to),
                        wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                        result_type=FlushResult,
                        rpc_timeout=timedelta(seconds=left),
                    ),
                    left,
                )
            except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
                return None
            except RPCError as exc:
                if exc.status in FINAL_RPC_STATUSES:
                    raise
                last_error = exc
                log.debug("flush of shard %s not delivered yet: %s", shard.key, exc.message)
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 1.0)

    def _start_operation(self, shard: ShardRef, up_to: int) -> WithStartWorkflowOperation[Any, Any]:
        settings = self._settings
        operation: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
            WORKFLOW,
            **start_arguments(
                shard,
                settings.shard_options(),
                settings.task_queue,
                max_id=up_to,
                skip=static_skip(shard, self._skips),
            ),
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        _retrieve_start_outcome(operation)
        return operation

    # -- sync ----------------------------------------------------------------------------------

    def flush_sync(
        self, targets: Mapping[ShardRef, int], timeout: float = DEFAULT_TIMEOUT
    ) -> list[FlushResult]:
        """:meth:`flush` for sync code: runs on this flusher's background event loop."""
        if not targets:
            return []
        wait = timeout + 2 * ANSWER_GRACE
        work = self._background().submit(self.flush(targets, timeout))
        try:
            return work.result(wait)
        except concurrent.futures.TimeoutError:  # a backstop: every step has its deadline
            work.cancel()
            detail = self._no_answer(f"no answer within {wait:.0f} s")
            log.warning("flush of shard(s) %s: %s", ", ".join(s.key for s in targets), detail)
            return unavailable(targets, detail)

    def _background(self) -> EventLoopThread:
        with self._loop_lock:
            if self._loop_thread is None:
                self._loop_thread = EventLoopThread(name="outbox-flush")
            return self._loop_thread

    def close(self) -> None:
        """Stop the background event loop of sync flushes, if one runs, and forget its Temporal
        client; a later sync flush starts them again."""
        with self._loop_lock:
            loop_thread, self._loop_thread = self._loop_thread, None
        if loop_thread is not None:
            loop_thread.close()
            self._clients.pop(loop_thread.loop, None)


def _unanswered(shard: ShardRef, detail: str) -> FlushResult:
    log.warning("flush of shard %s got no answer from Temporal: %s", shard.key, detail)
    return FlushResult(shard.key, FlushOutcome.UNAVAILABLE, detail=detail)


def _retrieve_start_outcome(operation: WithStartWorkflowOperation[Any, Any]) -> None:
    """Retrieve the outcome of the operation's start once set: the flush never asks for the
    handle (it reports a failed start itself), and asyncio logs an unretrieved exception."""
    future = getattr(operation, "_workflow_handle", None)
    if isinstance(future, asyncio.Future):

        def retrieve(done: asyncio.Future[Any]) -> None:
            if not done.cancelled():
                done.exception()

        future.add_done_callback(retrieve)


# -- outbox_context ------------------------------------------------------------------------------


@dataclass
class Written:
    app: OutboxApp
    up_to: int
    flush: bool


class FlushingContext:
    """What this :class:`OutboxContext` and Django's share: the rows committed in the block, by
    shard, and their flush when it ends."""

    _log = log
    # How the warning about rows that had not committed tells the user to wait for them.
    _commit_hint = "commit inside the block to wait for them"

    def __init__(self, *, flush: bool, timeout: float, flusher: Flusher | None) -> None:
        check_timeout(timeout)
        self._flush = flush
        self._timeout = timeout
        self._flusher = flusher
        self._committed: dict[ShardRef, Written] = {}
        self.report = FlushReport()

    @staticmethod
    def _add(into: dict[ShardRef, Written], shard: ShardRef, written: Written) -> None:
        known = into.get(shard)
        if known is None:
            into[shard] = written
        else:
            known.up_to = max(known.up_to, written.up_to)
            known.flush = known.flush or written.flush

    def __enter__(self) -> Self:
        raise NotImplementedError

    def _close(self, failed: bool) -> list[str]:
        """Close the block; the shards of its rows that have not committed, when no enclosing
        context takes them over."""
        raise NotImplementedError

    def _flusher_for(self, app: OutboxApp) -> Flusher | str:
        """The flusher of ``app``, or why there is none (every shard answers unavailable)."""
        return self._flusher if self._flusher is not None else app_flusher(app)

    def _flushes(self, failed: bool) -> Iterator[tuple[Flusher, dict[ShardRef, int]]]:
        """Close the block; each flusher with the shards it flushes now."""
        not_committed = self._close(failed)
        if failed:
            return
        if not_committed:
            self.report.not_committed = not_committed
            self._log.warning(
                "outbox_context ended before its rows committed (shards %s): they are "
                "handled asynchronously; %s",
                ", ".join(not_committed),
                self._commit_hint,
            )
        by_app: dict[OutboxApp, dict[ShardRef, int]] = {}
        for shard, written in self._committed.items():
            if written.flush:
                by_app.setdefault(written.app, {})[shard] = written.up_to
        for app, targets in by_app.items():
            flusher = self._flusher_for(app)
            if isinstance(flusher, str):
                self.report.results += unavailable(targets, flusher)
            else:
                yield flusher, targets

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        for flusher, targets in self._flushes(exc_type is not None):
            self.report.results += flusher.flush_sync(targets, self._timeout)

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        for flusher, targets in self._flushes(exc_type is not None):
            self.report.results += await flusher.flush(targets, self._timeout)


class OutboxContext(FlushingContext):
    """See :func:`outbox_context`. Use with ``with`` (a ``Session`` or ``Connection``) or
    ``async with`` (an ``AsyncSession`` or ``AsyncConnection``); ``report`` holds the answer
    once the block has ended."""

    def __init__(
        self, session: Any, *, flush: bool, timeout: float, flusher: Flusher | None
    ) -> None:
        super().__init__(flush=flush, timeout=timeout, flusher=flusher)
        self._session = session
        self._pending: dict[ShardRef, Written] = {}
        self._parent: OutboxContext | None = None

    def record_row(self, app: OutboxApp, shard: ShardRef, row_id: int) -> None:
        """Note a row written in this context (called by ``app.write``)."""
        self._add(self._pending, shard, Written(app, row_id, self._flush))

    def _on_commit(self) -> None:
        for shard, written in self._pending.items():
            self._add(self._committed, shard, written)
        self._pending.clear()

    def __enter__(self) -> Self:
        info = session_info(self._session)
        stack: list[OutboxContext] = info.setdefault(CONTEXTS, [])
        self._parent = stack[-1] if stack else None
        stack.append(self)
        if not info.get(LISTENING):
            _listen(self._session)
            info[LISTENING] = True
        return self

    def _close(self, failed: bool) -> list[str]:
        stack: list[OutboxContext] = session_info(self._session).get(CONTEXTS, [])
        if stack and stack[-1] is self:
            stack.pop()
        if failed or not self._pending:
            return []
        if self._parent is None:
            return [shard.key for shard in self._pending]
        # Commits with the enclosing transaction: the enclosing context waits for them.
        for shard, written in self._pending.items():
            self._add(self._parent._pending, shard, written)
        return []


def outbox_context(
    session: Any,
    *,
    flush: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
    flusher: Flusher | None = None,
) -> OutboxContext:
    """Track the outbox rows written with ``session`` inside the block.

    With ``flush=True``, when the block ends, wait (at most ``timeout`` seconds) until every
    shard written to has handled the rows that committed inside the block; ``.report`` says,
    per shard, ``handled``, ``blocked``, ``skipped``, ``deferred``, ``timed_out`` or
    ``unavailable``. Commit inside the block::

        with outbox_context(session, flush=True) as outbox:
            app.write(session, category=..., shard_identifier=..., object_identifier=...)
            session.commit()
        assert outbox.report.handled

    Contexts nest: rows written in an inner ``flush=False`` context are not waited for; rows
    that commit only after an inner context ended are waited for by the enclosing one. With
    ``flush=False`` (the default) rows are handled asynchronously, as without a context.
    ``flusher`` defaults to the app's (see :meth:`OutboxApp.configure_flush`).
    """
    return OutboxContext(session, flush=flush, timeout=timeout, flusher=flusher)


def app_flusher(app: OutboxApp) -> Flusher:
    """The flusher of ``app`` (:meth:`OutboxApp.configure_flush`), built on first use."""
    route = app.flush_route
    if not isinstance(route.flusher, Flusher):
        route.flusher = Flusher(app, route.settings, client=route.client)
    return route.flusher


def _listen(session: Any) -> None:
    """Move the contexts' rows to committed on commit, forget them on rollback."""
    target = sync_target(session)
    info = session_info(session)

    def committed(*_: Any) -> None:
        for context in info.get(CONTEXTS, []):
            context._on_commit()

    def rolled_back(*_: Any) -> None:
        for context in info.get(CONTEXTS, []):
            context._pending.clear()

    if isinstance(target, Connection):
        event.listen(target, "commit", committed)
        event.listen(target, "rollback", rolled_back)
    else:
        event.listen(target, "after_commit", committed)
        event.listen(target, "after_rollback", rolled_back)
