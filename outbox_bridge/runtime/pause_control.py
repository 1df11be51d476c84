"""The paused categories and scopes of the app's tables as the worker serves them: names
resolved against the app, the ``change_pauses`` activity, and the view of the pauses that the
active bridge keeps current in the ``OutboxControl`` workflow."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client
from temporalio.service import RPCError

from outbox_bridge.db.pauses import (
    Pause,
    PauseEnd,
    add_pause,
    end_timed_pauses,
    read_pauses,
    remove_pause,
)
from outbox_bridge.db.timestamps import iso_utc
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.shards import workflow_code_memo
from outbox_bridge.workflows.inputs import InvalidInput, clipped, pause_end
from outbox_bridge.workflows.models import (
    ControlInput,
    PauseChangeInput,
    PauseInfo,
    PauseKind,
    PausesView,
)

log = logging.getLogger(__name__)

CONTROL_WORKFLOW = "OutboxControl"


def member_number(app: OutboxApp | None, kind: PauseKind, text: str, where: str) -> int:
    """The number of the category or scope ``text`` names: a number, or a name of ``app`` (any
    case); ``where`` says which app, for the error."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    if app is None:
        raise ConfigurationError(f"{kind} {text!r}: without the app, give it by number; {where}")
    members = app.categories if kind == PauseKind.CATEGORY else app.scopes
    for member in members:
        if member.name.upper() == text.upper():
            return int(member)
    known = ", ".join(f"{m.name} ({int(m)})" for m in members)
    raise ConfigurationError(
        f"unknown {kind} {text!r} in {where}; its {kind} names are: {known}. A {kind} the app "
        "does not register can be given by its number"
    )


def timed_end(for_seconds: object, until: object) -> PauseEnd | None:
    """The end of a pause asked with ``for_seconds`` or ``until`` (None: until unpaused).
    Raises :class:`ConfigurationError` for a bad value or an ``until`` already past."""
    try:
        seconds, moment = pause_end(for_seconds, until)
    except InvalidInput as exc:
        raise ConfigurationError(str(exc)) from None
    if moment is not None and moment <= datetime.now(UTC):
        raise ConfigurationError(f"until {moment.isoformat()} has passed: give a time to come")
    if seconds is None and moment is None:
        return None
    return PauseEnd(at=moment, seconds=seconds)


def member_name(app: OutboxApp | None, kind: PauseKind, number: int) -> str:
    """The name of category or scope ``number`` in ``app``, else the number."""
    if app is None:
        return str(number)
    member = app.category(number) if kind == PauseKind.CATEGORY else app.scope(number)
    return member.name if member is not None else str(number)


def view_of(app: OutboxApp | None, pauses: list[Pause]) -> PausesView:
    return PausesView(
        [
            PauseInfo(
                kind=p.kind,
                number=p.number,
                name=clipped(member_name(app, p.kind, p.number)),
                reason=clipped(p.reason),
                paused_by=clipped(p.paused_by),
                since=iso_utc(p.since),
                paused_via=None if p.paused_via is None else clipped(p.paused_via),
                ends_at=None if p.ends_at is None else iso_utc(p.ends_at),
            )
            for p in pauses
        ]
    )


class PauseControl:
    """Changes and reads the pauses of the app's tables (the worker's side)."""

    def __init__(self, app: OutboxApp, engine: AsyncEngine) -> None:
        self._app = app
        self._engine = engine

    async def change(self, request: PauseChangeInput, *, via: str | None = None) -> PausesView:
        """Pause or resume what ``request`` names, and return the table's pauses (``via``: the
        sender of the pause as Temporal recorded it). Raises :class:`ConfigurationError` for a
        name the app does not know."""
        change = request.change
        if (change.category is None) == (change.scope is None):
            raise ConfigurationError("give exactly one of category and scope")
        kind = PauseKind.CATEGORY if change.category is not None else PauseKind.SCOPE
        text = change.category if change.category is not None else change.scope
        number = member_number(self._app, kind, text or "", "the worker's app")
        table = self._app.table(request.table)
        end = timed_end(change.for_seconds, change.until) if request.paused else None
        async with self._engine.begin() as conn:
            if request.paused:
                by = change.by.strip() or "the control workflow"
                reason = change.reason.strip()
                await add_pause(conn, table, kind, number, reason, by, via=via, end=end)
            else:
                await remove_pause(conn, table, kind, number)
            return view_of(self._app, await read_pauses(conn, table))

    async def end_timed(self, table: str) -> None:
        """Delete the timed pauses of ``table`` that have ended (they hold nothing since their
        end), and log each."""
        async with self._engine.begin() as conn:
            ended = await end_timed_pauses(conn, self._app.table(table))
        for p in ended:
            name = member_name(self._app, p.kind, p.number)
            log.info("the timed pause of %s %s in %s ended", p.kind, name, table)

    async def view(self, table: str) -> PausesView:
        async with self._engine.connect() as conn:
            return view_of(self._app, await read_pauses(conn, self._app.table(table)))


class ControlViews:
    """Keeps each table's ``OutboxControl`` workflow running and showing the table's pauses
    (one signal-with-start of ``refresh`` per change, none otherwise), and deletes the timed
    pauses that have ended."""

    def __init__(self, control: PauseControl, client: Client, task_queue: str) -> None:
        self._control = control
        self._client = client
        self._task_queue = task_queue
        self._shown: dict[str, PausesView] = {}

    async def refresh(self, tables: list[str]) -> None:
        for table in tables:
            try:
                await self._control.end_timed(table)
                view = await self._control.view(table)
                if self._shown.get(table) == view:
                    continue
                await self._client.start_workflow(
                    CONTROL_WORKFLOW,
                    ControlInput(table, view),
                    id=f"outbox:{table}:control",
                    task_queue=self._task_queue,
                    memo=workflow_code_memo(),
                    start_signal="refresh",
                    start_signal_args=[view],
                )
            except (SQLAlchemyError, RPCError) as exc:
                log.warning("cannot show the pauses of %s in its control workflow: %s", table, exc)
                continue
            self._shown[table] = view
