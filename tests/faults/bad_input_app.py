"""The OutboxApp of the bad-input test (``--app tests.faults.bad_input_app:app``): the fault
app's registry on ``$FAULT_OUTBOX_TABLE`` and its regional twin ``<table>_r``.

Its handlers misbehave as a row's payload asks: ``{"return": value}`` returns the value, and
``{"raise": name}`` raises that ``BaseException`` while the row's shard is listed as poison in
``fault_control`` (so the test can fix it). Every call is logged like the fault app's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from outbox_bridge import OutboxApp, OutboxMessage, OutboxTable
from tests.faults.fault_app import SCOPES, TABLE, FaultCategory, control, record, record_async


class HandlerExit(BaseException):
    """A ``BaseException`` subclass of the application's own."""


RAISES: dict[str, Callable[[str], BaseException]] = {
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "GeneratorExit": GeneratorExit,
    "HandlerExit": HandlerExit,
    "CancelledError": asyncio.CancelledError,
}


def misbehaviour(message: OutboxMessage) -> tuple[BaseException | None, object]:
    """What the handler of ``message`` raises, or else returns."""
    payload = message.payload
    if not isinstance(payload, dict):
        return None, None
    if "raise" in payload and message.shard_identifier in control(TABLE).poison_shards:
        return RAISES[payload["raise"]](f"raised by the handler of row {message.id}"), None
    return None, payload.get("return")


def handle_sync(message: OutboxMessage) -> object:
    started = time.time()
    error, value = misbehaviour(message)
    record(message, "sync", started, "failed" if error else "ok")
    if error is not None:
        raise error
    return value


async def handle_async(message: OutboxMessage) -> object:
    started = time.time()
    # Raised here, in the coroutine: not through a thread's future.
    error, value = await asyncio.to_thread(misbehaviour, message)
    await record_async(message, started, "failed" if error else "ok")
    if error is not None:
        raise error
    return value


def make_app(table: str) -> OutboxApp:
    app = OutboxApp(
        scopes=SCOPES,
        categories=[FaultCategory],
        tables=[OutboxTable(table), OutboxTable(f"{table}_r", regional=True)],
    )
    app.handler(
        FaultCategory.ORGANIZATION_UPDATE,
        FaultCategory.PROJECT_UPDATE,
        FaultCategory.MEMBER_UPDATE,
    )(handle_sync)  # type: ignore[arg-type]
    app.handler(FaultCategory.USER_UPDATE)(handle_async)  # type: ignore[arg-type]
    return app


app = make_app(TABLE)
