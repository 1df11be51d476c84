"""What outbox-bridge keeps in a SQLAlchemy session's ``info``: the open outbox contexts that
``app.write`` reports its rows to (the contexts, which flush through Temporal, are
:mod:`outbox_bridge.flush`'s).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

from outbox_bridge.workflows.models import ShardRef

# Keys in the session's info: the stack of open contexts, and whether the commit and rollback
# events of the session are listened to.
CONTEXTS = "outbox_bridge.contexts"
LISTENING = "outbox_bridge.listening"


class RowRecorder(Protocol):
    """An open outbox context, as ``app.write`` sees it."""

    def record_row(self, app: Any, shard: ShardRef, row_id: int) -> None: ...


def sync_target(session: Any) -> Any:
    """The sync Session or Connection behind ``session`` (async ones wrap one)."""
    for attribute in ("sync_session", "sync_connection"):
        inner = getattr(session, attribute, None)
        if inner is not None:
            return inner
    return session


def session_info(session: Any) -> dict[str, Any]:
    """The ``info`` dictionary of ``session``, or :class:`TypeError` for anything else."""
    info = getattr(sync_target(session), "info", None)
    if not isinstance(info, dict):
        raise TypeError(
            f"outbox_context needs a SQLAlchemy Session, AsyncSession, Connection or "
            f"AsyncConnection, got {type(session).__name__}"
        )
    return info


def record_write(session: Any, app: Any, shard: ShardRef, row_id: int) -> None:
    """Called by ``app.write``: note the row in the innermost open context, if any."""
    try:
        stack: list[RowRecorder] | None = session_info(session).get(CONTEXTS)
    except TypeError:
        return
    if stack:
        stack[-1].record_row(app, shard, row_id)


def sync_result(result: Any, call: str) -> Any:
    """``result`` of ``session.execute`` in ``call`` (``app.write``, ...); :class:`TypeError`
    when the session is async, and nothing ran."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if close is not None:
            close()
        raise TypeError(f"{call}() got an async session; use await {call}_async()")
    return result
