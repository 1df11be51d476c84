"""The checks of an outbox row's values and its INSERT, run in the caller's transaction.

The registry resolves a row's table, category and scope (:meth:`OutboxApp.write`); this module
checks the rest and builds the INSERT. Nothing here commits: the row commits, or rolls back,
with the model change it describes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import IntEnum
from typing import Any, Required, TypedDict

from pydantic import BaseModel
from sqlalchemy import Insert, Table, insert

from outbox_bridge.errors import InvalidRowError, PayloadTooLargeError
from outbox_bridge.workflows.models import ShardRef

BIGINT_MIN = -(2**63)
BIGINT_MAX = 2**63 - 1

# A \u0000 escape in JSON text (preceded by an even number of backslashes, i.e. not itself an
# escaped backslash followed by "u0000"): PostgreSQL's jsonb cannot store it.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


class RowFields(TypedDict, total=False):
    """The keyword arguments of one row, as :meth:`OutboxApp.write
    <outbox_bridge.OutboxApp.write>` takes them."""

    category: Required[IntEnum | int]
    shard_identifier: Required[int]
    object_identifier: Required[int]
    payload: Any
    shard_scope: IntEnum | int | None
    region: str | None
    scheduled_for: datetime | timedelta | None
    table: str | None


@dataclass(frozen=True)
class RowSpec:
    """What a producer asks for (:class:`RowFields`); validated by the registry and
    :func:`build_insert`."""

    category: IntEnum | int
    shard_identifier: int
    object_identifier: int
    payload: Any = None
    shard_scope: IntEnum | int | None = None
    region: str | None = None
    scheduled_for: datetime | timedelta | None = None
    table: str | None = None


def bigint(name: str, value: object) -> int:
    """``value`` if it is an integer that fits a bigint column, else :class:`InvalidRowError`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRowError(f"{name} must be an integer, got {type(value).__name__}")
    if not BIGINT_MIN <= value <= BIGINT_MAX:
        raise InvalidRowError(f"{name} {value} does not fit a bigint")
    return int(value)


def byte_size(count: int) -> str:
    """``count`` bytes as people read them: ``3.2 MiB (3,355,443 bytes)``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit} ({count:,} bytes)"
    return f"{count:,} bytes"


def _json_safe(payload: Any) -> tuple[Any, int]:
    """``payload`` as a JSON value jsonb accepts, and the UTF-8 bytes of its JSON text, else
    :class:`InvalidRowError`: refused here, a database error would abort the caller's
    transaction, model change included."""
    if isinstance(payload, BaseModel):
        try:
            payload = payload.model_dump(mode="json")
        except ValueError as exc:  # pydantic's serialisation errors
            raise InvalidRowError(f"payload model cannot be dumped to JSON ({exc})") from None
    try:
        dumped = json.dumps(payload, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRowError(
            f"payload is not JSON-serialisable ({exc}); pass JSON values or a pydantic model"
        ) from None
    if _JSON_NUL.search(dumped):
        raise InvalidRowError(
            "payload contains a NUL character (\\u0000), which PostgreSQL cannot store in JSON"
        )
    try:
        size = len(dumped.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRowError(
            "payload contains a lone surrogate (invalid Unicode), which PostgreSQL cannot store"
        ) from None
    return payload, size


def _when(value: datetime | timedelta | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        if not math.isfinite(value.total_seconds()):
            raise InvalidRowError("scheduled_for delay must be finite")
        try:
            return datetime.now(UTC) + value
        except OverflowError:
            raise InvalidRowError(f"scheduled_for delay {value} is out of range") from None
    if not isinstance(value, datetime):
        raise InvalidRowError("scheduled_for must be a datetime or a timedelta")
    if value.tzinfo is None:
        raise InvalidRowError(
            "scheduled_for must be timezone-aware (naive datetimes are ambiguous)"
        )
    return value


@dataclass(frozen=True)
class PreparedRow:
    """A validated row: its INSERT ... RETURNING id, the shard it goes to, and what its producer
    span names."""

    statement: Insert
    shard: ShardRef
    category: str
    object_identifier: int


def build_insert(
    table: Table,
    spec: RowSpec,
    *,
    regional: bool,
    category: IntEnum,
    scope: IntEnum,
    max_payload_bytes: int,
) -> PreparedRow:
    """Check ``spec``'s values and build its INSERT ... RETURNING id into ``table``, for the
    ``category`` and ``scope`` the registry resolved. A payload whose JSON text (as
    ``json.dumps`` writes it, which is how PostgreSQL prints jsonb) takes more than
    ``max_payload_bytes`` UTF-8 bytes raises :class:`PayloadTooLargeError`."""
    values: dict[str, Any] = {
        "shard_scope": int(scope),
        "shard_identifier": bigint("shard_identifier", spec.shard_identifier),
        "category": int(category),
        "object_identifier": bigint("object_identifier", spec.object_identifier),
    }
    values["payload"], size = _json_safe(spec.payload)
    if size > max_payload_bytes:
        raise PayloadTooLargeError(
            f"the payload of {category.name} for object {values['object_identifier']} is "
            f"{byte_size(size)}, over the limit of {byte_size(max_payload_bytes)} "
            "(max_payload_bytes): keep large data elsewhere (a table, object storage) and put "
            "its key in the payload, or raise OutboxApp(max_payload_bytes=...) as far as the "
            "workers' memory allows"
        )
    if regional:
        if not isinstance(spec.region, str) or not spec.region:
            raise InvalidRowError(f"table {table.name} is regional: every row needs a region")
        if "\x00" in spec.region:
            raise InvalidRowError("region must not contain a NUL character")
        values["region"] = spec.region
    elif spec.region is not None:
        raise InvalidRowError(f"table {table.name} is not regional: region must be None")
    scheduled_for = _when(spec.scheduled_for)
    if scheduled_for is not None:
        values["scheduled_for"] = scheduled_for
    shard = ShardRef(
        table.name, int(scope), scope.name, values["shard_identifier"], values.get("region")
    )
    statement = insert(table).values(**values).returning(table.c.id)
    return PreparedRow(statement, shard, category.name, values["object_identifier"])
