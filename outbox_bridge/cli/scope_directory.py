"""Naming a shard without the app: the table holds a scope's number, a shard workflow's id its
name, so the pairs are learned from the table's shard workflows (one visibility query and one
history event per scope). A scope with no workflow within the retention stays unknown.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from temporalio.client import Client

from outbox_bridge.errors import ShardNameError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.shards import WORKFLOW, parse_shard, scope_number, split_shard_name
from outbox_bridge.workflows.models import SCOPE_ATTRIBUTE, ShardInput, ShardRef

# A scope's name as the worker writes it (an enum member's name, or a number).
_SCOPE_NAME = re.compile(r"-?[A-Za-z0-9_]+")
# Scopes learned at most, looking for one that is not there (each costs two calls).
MAX_SCOPES = 200

NO_APP_HINT = (
    "give the worker's app: --app module:attribute (or OUTBOX_APP), or --demo for the demo"
)


class ScopeDirectory:
    """The scopes of one table's shard workflows: name ↔ number, as the worker's app has them."""

    def __init__(self, client: Client, table: str) -> None:
        self._client = client
        self._table = table
        self._by_name: dict[str, int] = {}
        self._complete = False

    async def number(self, name: str) -> tuple[str, int] | None:
        """The scope called ``name`` (any case) as the worker names it, and its number."""
        wanted = {name, name.upper()}
        if not all(_SCOPE_NAME.fullmatch(n) for n in wanted):
            return None
        if not wanted & self._by_name.keys():
            await self._learn(f"{SCOPE_ATTRIBUTE.name} IN ({_quoted(wanted)})")
        matches = sorted(wanted & self._by_name.keys())
        return (matches[0], self._by_name[matches[0]]) if matches else None

    async def name(self, number: int) -> str | None:
        """The name the worker gives scope ``number``."""
        for _ in range(MAX_SCOPES):
            for known, value in self._by_name.items():
                if value == number:
                    return known
            if not await self._learn_another():
                return None
        return None

    async def seen(self) -> str:
        """Every scope with a shard workflow in the table (at most :data:`MAX_SCOPES`), for a
        message: ``ORGANIZATION (1), USER (2)``, or ``none``."""
        for _ in range(MAX_SCOPES):
            if not await self._learn_another():
                break
        known = sorted(self._by_name.items(), key=lambda pair: pair[1])
        return ", ".join(f"{name} ({number})" for name, number in known) or "none"

    async def _learn_another(self) -> bool:
        if self._complete:
            return False
        unseen = f"{SCOPE_ATTRIBUTE.name} NOT IN ({_quoted(self._by_name)})"
        self._complete = not await self._learn(unseen if self._by_name else None)
        return not self._complete

    async def _learn(self, condition: str | None) -> bool:
        """Learn the scope of one shard workflow of the table that meets ``condition``."""
        query = f'WorkflowType="{WORKFLOW}" AND WorkflowId STARTS_WITH "outbox:{self._table}:"'
        if condition is not None:
            query += f" AND {condition}"
        async for execution in self._client.list_workflows(query, limit=1):
            shard = await self._shard_of(execution.id, execution.run_id)
            if shard is not None:
                self._by_name[shard.scope_name] = shard.scope
                return True
        return False

    async def _shard_of(self, workflow_id: str, run_id: str) -> ShardRef | None:
        """The shard in the input of the run's first event."""
        handle = self._client.get_workflow_handle(workflow_id, run_id=run_id)
        async for event in handle.fetch_history_events(page_size=1):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            if not payloads:
                return None
            [started] = await self._client.data_converter.decode(payloads[:1], [ShardInput])
            return started.shard if isinstance(started, ShardInput) else None
        return None


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f'"{name}"' for name in sorted(names))


async def find_shard(
    client: Client, name: str, app: OutboxApp | None, *, table: str | None = None
) -> ShardRef:
    """The shard called ``name`` (see :func:`parse_shard`); without the app, its scope comes
    from the table's shard workflows (:class:`ShardNameError` when they cannot tell)."""
    if app is not None:
        return parse_shard(name, app, table=table)
    table_name = table or "outbox"
    region, scope_text, ident = split_shard_name(
        name, regional=name.count(":") >= 2, table=table_name
    )
    directory = ScopeDirectory(client, table_name)
    number = scope_number(scope_text)
    if number is not None:
        scope_name = await directory.name(number)
        if scope_name is not None:
            return ShardRef(table_name, number, scope_name, ident, region)
        what = f"what the worker calls scope {number}"
    else:
        found = await directory.number(scope_text)
        if found is not None:
            return ShardRef(table_name, found[1], found[0], ident, region)
        what = f"the number of scope {scope_text!r}"
    raise ShardNameError(
        f"shard {name!r}: without the app, {what} is learned from the shard workflows of "
        f"table {table_name}, and none tells it (scopes seen: {await directory.seen()}); "
        f"{NO_APP_HINT}"
    )
