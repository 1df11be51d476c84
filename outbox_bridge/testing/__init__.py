"""Testing an application's outbox: its handlers without Temporal (:func:`drain_outbox`), its
upgrades against its exported histories (:func:`assert_replays`), and the real path through a
worker with the pytest plugin's fixtures (:mod:`outbox_bridge.testing.plugin`).

Names load on first use: pytest loads the plugin in every run, which must not load the worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox_bridge.testing.drain import (
        OutboxRunner,
        drain_outbox,
        drain_outbox_async,
        outbox_runner,
    )
    from outbox_bridge.testing.inprocess_worker import OutboxWorker, worker_settings
    from outbox_bridge.testing.replay import assert_replays
    from outbox_bridge.testing.report import (
        DrainFailure,
        DrainReport,
        HandlerFailedError,
        ShardReport,
    )
    from outbox_bridge.testing.servers import OutboxDatabase, PostgresServer, TemporalServer

_MODULES = {
    "drain": ("OutboxRunner", "drain_outbox", "drain_outbox_async", "outbox_runner"),
    "inprocess_worker": ("OutboxWorker", "worker_settings"),
    "replay": ("assert_replays",),
    "report": ("DrainFailure", "DrainReport", "HandlerFailedError", "ShardReport"),
    "servers": ("OutboxDatabase", "PostgresServer", "TemporalServer"),
}
_EXPORTS = {name: f"outbox_bridge.testing.{m}" for m, names in _MODULES.items() for name in names}

__all__ = [
    "DrainFailure",
    "DrainReport",
    "HandlerFailedError",
    "OutboxDatabase",
    "OutboxRunner",
    "OutboxWorker",
    "PostgresServer",
    "ShardReport",
    "TemporalServer",
    "assert_replays",
    "drain_outbox",
    "drain_outbox_async",
    "outbox_runner",
    "worker_settings",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'outbox_bridge.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
