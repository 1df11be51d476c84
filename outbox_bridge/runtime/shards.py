"""Naming shards, starting and signalling their workflows, and reading their status."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError

from outbox_bridge.db.scans import FirstRow
from outbox_bridge.errors import (
    ConfigurationError,
    InvalidControlInput,
    RegistryError,
    ShardNameError,
)
from outbox_bridge.producer import BIGINT_MAX, BIGINT_MIN
from outbox_bridge.registry import OutboxApp
from outbox_bridge.workflows.inputs import InvalidInput, check_shard_options
from outbox_bridge.workflows.models import (
    MEMO_CODE_KEY,
    SCOPE_ATTRIBUTE,
    SHARD_ATTRIBUTE,
    STATE_ATTRIBUTE,
    WORKFLOW_CODE,
    Draining,
    HandlerFailure,
    HandoverInput,
    Idle,
    NotifyInput,
    RecheckInput,
    ShardInput,
    ShardOptions,
    ShardRecord,
    ShardRef,
    ShardState,
    ShardStatus,
    SkipInfo,
    Skipped,
)

WORKFLOW = "OutboxShard"
# The shard_scope column is an integer.
SCOPE_MIN, SCOPE_MAX = -(2**31), 2**31 - 1
# How long the bridge waits for a shard workflow's answer to ``status``.
STATUS_QUERY_TIMEOUT = timedelta(seconds=10)

log = logging.getLogger(__name__)

T = TypeVar("T")


def checked(check: Callable[[T], None], value: T, what: str) -> T:
    """``value``, if the outbox's workflows would take it (``check``, from
    ``workflows/inputs.py``); else :class:`InvalidControlInput`, and nothing is sent."""
    try:
        check(value)
    except InvalidInput as exc:
        raise InvalidControlInput(
            f"{what}: {exc}; nothing was sent (the workflows would refuse it). Give a value "
            "within the bounds the workflows reference lists"
        ) from None
    return value


def parse_shard(name: str, app: OutboxApp, *, table: str | None = None) -> ShardRef:
    """``SCOPE:ID`` (``REGION:SCOPE:ID`` for a regional table); SCOPE is a scope's name (any
    case) or number."""
    spec = app.table_spec(table)
    region, scope_text, ident = split_shard_name(name, regional=spec.regional, table=spec.name)
    try:
        scope = app.scope_by_name(scope_text)
    except RegistryError:
        number = scope_number(scope_text)
        if number is None:
            raise RegistryError(
                f"unknown scope {scope_text!r} in shard {name!r}; {known_scopes(app)}. A "
                "scope the app does not register is named by its number, as the worker names "
                f"it (e.g. 9:{ident})"
            ) from None
        return ShardRef(spec.name, number, app.scope_name(number), ident, region)
    return ShardRef(spec.name, int(scope), scope.name, ident, region)


def known_scopes(app: OutboxApp) -> str:
    """The app's scopes, for a message: ``known scopes: ORGANIZATION, USER (numbers 1, 2)``."""
    if not app.scopes:
        return "the app registers no scopes"
    names = ", ".join(scope.name for scope in app.scopes)
    return f"known scopes: {names} (numbers {', '.join(str(int(s)) for s in app.scopes)})"


def split_shard_name(name: str, *, regional: bool, table: str) -> tuple[str | None, str, int]:
    """The region (None outside a regional table), scope text and identifier of a shard's name,
    read from the right (a region may hold ``:``)."""
    expected = 3 if regional else 2
    parts = name.rsplit(":", expected - 1)
    # A region is any text the table accepts (even blank); scope and id are never blank.
    if len(parts) != expected or not all(part.strip() for part in parts[-2:]) or not parts[0]:
        form = "REGION:SCOPE:ID" if regional else "SCOPE:ID"
        raise ShardNameError(
            f"shard {name!r} is not {form} (table {table}); e.g. ORGANIZATION:42, or 9:6003 "
            "for a scope known by its number"
        )
    ident = _integer(parts[-1])
    if ident is None or not BIGINT_MIN <= ident <= BIGINT_MAX:
        raise ShardNameError(
            f"shard identifier {parts[-1]!r} of {name!r} is not an integer that fits a bigint"
        )
    return (parts[0] if regional else None), parts[-2].strip(), ident


def scope_number(text: str) -> int | None:
    """``text`` as a scope number (an integer that fits the ``shard_scope`` column), else None."""
    number = _integer(text)
    return number if number is not None and SCOPE_MIN <= number <= SCOPE_MAX else None


def _integer(text: str) -> int | None:
    stripped = text.strip()
    digits = stripped[1:] if stripped[:1] in ("+", "-") else stripped
    return int(stripped) if digits.isascii() and digits.isdigit() else None


def static_skips(app: OutboxApp, names: list[str] | None) -> frozenset[str]:
    """Workflow ids of the shards named in ``skip_shards`` (each table of the app)."""
    ids = set()
    for name in names or []:
        matched = False
        for table, spec in app.tables.items():
            if (name.count(":") >= 2) == spec.regional:
                ids.add(parse_shard(name, app, table=table).workflow_id)
                matched = True
        if not matched:
            raise ConfigurationError(f"skip_shards: {name!r} names no shard of this app's tables")
    return frozenset(ids)


def static_skip(shard: ShardRef, skipped_ids: frozenset[str]) -> SkipInfo | None:
    """How a shard listed in the skip setting starts: skipped, until resumed."""
    if shard.workflow_id not in skipped_ids:
        return None
    return SkipInfo(reason="listed in the skip_shards setting", by="configuration")


@dataclass
class ShardReport:
    """A shard workflow's ``status`` answer, and whether its workflow still runs."""

    status: ShardStatus
    running: bool
    started: datetime | None = None
    closed: datetime | None = None


async def shard_status(client: Client, shard: ShardRef) -> ShardStatus:
    """:func:`shard_report`'s status."""
    return (await shard_report(client, shard)).status


async def shard_report(client: Client, shard: ShardRef) -> ShardReport:
    """The workflow's ``status`` query, with the attempt count and last failure of a category
    activity being retried (they add no history: the workflow sees only the first failure)."""
    handle = client.get_workflow_handle(shard.workflow_id)
    status: ShardStatus = await handle.query("status", result_type=ShardStatus)
    description = await handle.describe()
    for pending in description.raw_description.pending_activities:
        if status.head is None or pending.activity_type.name != status.head.category_name:
            continue
        # Attempt n is pending once n - 1 attempts failed; the drain's failure is the first.
        status.attempts = max(status.attempts, pending.attempt)
        if pending.HasField("last_failure"):
            # Through the client's converter: its codec may have encoded the message.
            error = await client.data_converter.decode_failure(pending.last_failure)
            error_type = pending.last_failure.application_failure_info.type or "Error"
            status.last_error = HandlerFailure(error_type, getattr(error, "message", str(error)))
    running = description.status == WorkflowExecutionStatus.RUNNING
    return ShardReport(status, running, description.start_time, description.close_time)


def blocked_on_another_head(status: ShardStatus, first: FirstRow | None) -> bool:
    """Whether a shard's workflow is blocked on a group that no longer heads it in the table
    (deleted or changed by an operator): it should try the head again now."""
    head = status.head
    if status.state != ShardState.BLOCKED or head is None:
        return False
    return first is None or not first.heads(head.category, head.object_identifier)


def workflow_code_memo() -> dict[str, Any]:
    """Which generation of the workflow code started a run (``upgrade-check`` reads it)."""
    return {MEMO_CODE_KEY: WORKFLOW_CODE}


def start_arguments(
    shard: ShardRef,
    options: ShardOptions,
    task_queue: str,
    *,
    max_id: int,
    skip: SkipInfo | None = None,
    pending: bool = True,
) -> dict[str, Any]:
    """``Client.start_workflow``'s keyword arguments for ``shard``'s workflow; ``pending``: the
    run drains first."""
    first = Draining() if pending else Idle()
    return {
        "arg": ShardInput(
            shard=shard,
            options=options,
            record=ShardRecord(max_known_id=max_id, phase=Skipped(skip, first) if skip else first),
        ),
        "id": shard.workflow_id,
        "task_queue": task_queue,
        "memo": workflow_code_memo(),
        "search_attributes": TypedSearchAttributes(
            [
                SearchAttributePair(SCOPE_ATTRIBUTE, shard.scope_name),
                SearchAttributePair(SHARD_ATTRIBUTE, shard.key),
                SearchAttributePair(
                    STATE_ATTRIBUTE, ShardState.SKIPPED if skip else ShardState.DRAINING
                ),
            ]
        ),
    }


@dataclass
class ShardStarter:
    """Starts and signals shard workflows, one RPC a call; a failed one is logged and returns
    False (the sweep repairs it)."""

    client: Client
    _: KW_ONLY
    task_queue: str
    options: ShardOptions
    skip_shards: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        checked(check_shard_options, self.options, "the shard options from the settings")

    async def notify(
        self, shard: ShardRef, max_id: int, *, late: bool = False, skip: SkipInfo | None = None
    ) -> bool:
        """Tell the shard's workflow of rows up to ``max_id``, starting it if it is not
        running (skipped, if ``skip`` is given). False if Temporal did not take it."""
        notice = NotifyInput(max_id=max_id, late=late)
        return await self._signal_with_start(shard, "notify", notice, max_id, skip=skip)

    async def hand_over(self, shard: ShardRef, handover: HandoverInput) -> bool:
        """Give the shard to its workflow (the caller holds it for the workflow already)."""
        return await self._signal_with_start(
            shard, "handover", handover, handover.max_id, pending=False
        )

    async def recheck(self, shard: ShardRef, reason: str) -> bool:
        """Tell a blocked shard's running workflow that its head changed in the table."""
        handle = self.client.get_workflow_handle(shard.workflow_id)
        try:
            await handle.signal("recheck", RecheckInput(reason=reason))
        except RPCError as exc:
            log.warning("recheck of shard %s failed: %s", shard.key, exc.message)
            return False
        return True

    async def _signal_with_start(
        self,
        shard: ShardRef,
        signal: str,
        argument: object,
        max_id: int,
        *,
        skip: SkipInfo | None = None,
        pending: bool = True,
    ) -> bool:
        skip = skip or static_skip(shard, self.skip_shards)
        arguments = start_arguments(
            shard, self.options, self.task_queue, max_id=max_id, skip=skip, pending=pending
        )
        try:
            await self.client.start_workflow(
                WORKFLOW, **arguments, start_signal=signal, start_signal_args=[argument]
            )
        except RPCError as exc:
            log.warning("%s of shard %s failed: %s", signal, shard.key, exc.message)
            return False
        return True


async def wake_shard(client: Client, shard: ShardRef, why: str) -> None:
    """Tell the shard's workflow, if one runs, that its head changed in the table (``why``,
    shown in its history): a blocked one tries its head again now, rather than after its
    backoff; another drains again."""
    handle = client.get_workflow_handle(shard.workflow_id)
    with contextlib.suppress(RPCError):  # no workflow runs: a partition drains the shard
        await handle.signal("recheck", RecheckInput(reason=why))
        await handle.signal("notify", NotifyInput(max_id=0, late=True))
