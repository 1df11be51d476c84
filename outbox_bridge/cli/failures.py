"""How the commands fail: one readable line on stderr that says what to do, and an exit status
(2: a setting or a name to fix; 1: Temporal refused or has nothing to show)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Coroutine, Iterator
from typing import Any, NoReturn, TypeVar

import click
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from outbox_bridge.errors import OutboxError

T = TypeVar("T")


@contextlib.contextmanager
def exits_on_failure(*, shard: str | None = None) -> Iterator[None]:
    """On a known failure in the block, print one line and exit."""
    try:
        yield
    except OutboxError as exc:
        fail(f"error: {exc}", 2)
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause
        fail(f"shard {shard} refused: {getattr(cause, 'message', cause)}")
    except RPCError as exc:
        fail(temporal_failure(exc, shard))


def run_or_exit(work: Coroutine[Any, Any, T], *, shard: str | None = None) -> T:
    """Run ``work``; on a known failure print one line and exit."""
    with exits_on_failure(shard=shard):
        return asyncio.run(work)


def fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"outbox-bridge: {message}", err=True)
    sys.exit(code)


def temporal_failure(exc: RPCError, shard: str | None) -> str:
    """What Temporal's answer means for the command, and what to do."""
    message = " ".join(exc.message.split())
    if exc.status == RPCStatusCode.NOT_FOUND and message.lower().startswith("namespace"):
        return (
            f"error: Temporal says: {message} Set TEMPORAL_NAMESPACE (--temporal-namespace) "
            "to the worker's namespace"
        )
    if exc.status == RPCStatusCode.NOT_FOUND and shard is not None:
        return (
            f"shard {shard} has no workflow of its own: a partition drains it when it has "
            "rows (see `outbox-bridge shards`), and it gets one when it needs attention (a "
            "failing handler, a skip, a deferred row, a flush)"
        )
    if "search attribute" in message:
        return (
            f"error: Temporal says: {message}. The namespace lacks outbox-bridge's search "
            "attributes: start a worker on it once (it registers them)"
        )
    if exc.status in (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED):
        return (
            f"error: Temporal did not answer ({message}); check that it runs at "
            "TEMPORAL_ADDRESS (--temporal-address) and try again"
        )
    if exc.status in (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED):
        return (
            f"error: Temporal refused the request ({message}); check TEMPORAL_API_KEY or the "
            "TLS client certificate (TEMPORAL_TLS_CERT, TEMPORAL_TLS_KEY)"
        )
    return f"error: Temporal answered: {message}"
