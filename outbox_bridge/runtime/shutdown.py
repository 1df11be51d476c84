"""Stopping the worker within a grace period (SIGTERM, SIGINT)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

log = logging.getLogger("outbox_bridge.runtime.shutdown")


class ShutdownGrace(Interceptor):
    """A worker interceptor that stops the worker within ``seconds`` (:meth:`stop`): the SDK's
    ``graceful_shutdown_timeout`` waits for local activities (the drains) until their own
    timeout; this cancels them when the grace ends, without retry on this worker."""

    def __init__(self, seconds: float, *, calls_in_flight: Callable[[], int]) -> None:
        self.seconds = seconds
        # Handler calls in a partition's drain, which the Temporal worker cancels itself.
        self._calls_in_flight = calls_in_flight
        self._running: set[asyncio.Task[Any]] = set()
        self._abandoned = False

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _GraceActivityInterceptor(next, self)

    async def stop(self, worker: Worker) -> None:
        """Shut ``worker`` down, cancelling what still runs after the grace."""
        shutdown = asyncio.ensure_future(worker.shutdown())
        await asyncio.wait([shutdown], timeout=self.seconds)
        if not shutdown.done():
            self._abandoned = True
            running = max(len(self._running), self._calls_in_flight())
            if running:
                log.warning(
                    "cancelling %d handler call(s) still running after the shutdown grace of "
                    "%g s; their rows are kept and retried",
                    running,
                    self.seconds,
                )
            for task in self._running:
                task.cancel()
        await shutdown


class _GraceActivityInterceptor(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, grace: ShutdownGrace) -> None:
        super().__init__(next)
        self._grace = grace

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        task = asyncio.current_task()
        if not activity.info().is_local or task is None:
            return await super().execute_activity(input)
        if self._grace._abandoned:
            raise _stopped()
        self._grace._running.add(task)
        try:
            return await super().execute_activity(input)
        except asyncio.CancelledError:
            if not self._grace._abandoned:
                raise  # a skip or a timeout: the SDK reports it as usual
            task.uncancel()
            raise _stopped() from None
        finally:
            self._grace._running.discard(task)


def _stopped() -> ApplicationError:
    # Not retryable: a retry would run in this stopping worker. Benign: stop() logged it.
    return ApplicationError(
        "the worker stopped before this call finished",
        type="WorkerStopped",
        non_retryable=True,
        category=ApplicationErrorCategory.BENIGN,
    )
