"""outbox-bridge: a transactional outbox for Python services, executed by Temporal.

The names below are the public API. They are loaded on first use, so that importing
``outbox_bridge`` (or one of its subpackages, such as the workflow definitions Temporal's
sandbox re-imports) costs nothing until something is used.

An application that only writes rows (``OutboxApp``, ``app.write``, ``OutboxModel``) loads the
producer's side of the package: SQLAlchemy, pydantic and the OpenTelemetry API, never the worker's
Temporal client, the OpenTelemetry SDK or the command line. How the package is layered, and what
may import what, is in CONTRIBUTING.md.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str

    from outbox_bridge.config import OutboxSettings
    from outbox_bridge.db.schema import create_outbox_tables, outbox_table
    from outbox_bridge.errors import (
        CategoryScopeError,
        ConfigurationError,
        EmbeddedServiceError,
        InvalidRowError,
        MissingHandlerError,
        OutboxError,
        OutboxModelError,
        PayloadDecodeError,
        RegistryError,
        ShardFaultError,
        ShardLockedError,
        ShardNameError,
        UnknownCategoryError,
    )
    from outbox_bridge.flush import Flusher, FlushReport, OutboxContext, outbox_context
    from outbox_bridge.identifiers import next_object_identifier, next_object_identifier_async
    from outbox_bridge.orm import OutboxModel, write_outbox_rows, write_outbox_rows_async
    from outbox_bridge.registry import Handler, OutboxApp, OutboxMessage, OutboxTable
    from outbox_bridge.runtime.outbox_plugin import OutboxPlugin
    from outbox_bridge.workflows.models import FlushResult

# Where each public name lives.
_EXPORTS = {
    "OutboxSettings": "outbox_bridge.config",
    "create_outbox_tables": "outbox_bridge.db.schema",
    "outbox_table": "outbox_bridge.db.schema",
    "CategoryScopeError": "outbox_bridge.errors",
    "ConfigurationError": "outbox_bridge.errors",
    "EmbeddedServiceError": "outbox_bridge.errors",
    "InvalidRowError": "outbox_bridge.errors",
    "MissingHandlerError": "outbox_bridge.errors",
    "OutboxError": "outbox_bridge.errors",
    "OutboxModelError": "outbox_bridge.errors",
    "PayloadDecodeError": "outbox_bridge.errors",
    "RegistryError": "outbox_bridge.errors",
    "ShardFaultError": "outbox_bridge.errors",
    "ShardLockedError": "outbox_bridge.errors",
    "ShardNameError": "outbox_bridge.errors",
    "UnknownCategoryError": "outbox_bridge.errors",
    "Flusher": "outbox_bridge.flush",
    "FlushReport": "outbox_bridge.flush",
    "OutboxContext": "outbox_bridge.flush",
    "outbox_context": "outbox_bridge.flush",
    "next_object_identifier": "outbox_bridge.identifiers",
    "next_object_identifier_async": "outbox_bridge.identifiers",
    "OutboxModel": "outbox_bridge.orm",
    "write_outbox_rows": "outbox_bridge.orm",
    "write_outbox_rows_async": "outbox_bridge.orm",
    "Handler": "outbox_bridge.registry",
    "OutboxApp": "outbox_bridge.registry",
    "OutboxMessage": "outbox_bridge.registry",
    "OutboxTable": "outbox_bridge.registry",
    "OutboxPlugin": "outbox_bridge.runtime.outbox_plugin",
    "FlushResult": "outbox_bridge.workflows.models",
}

__all__ = [
    "CategoryScopeError",
    "ConfigurationError",
    "EmbeddedServiceError",
    "FlushReport",
    "FlushResult",
    "Flusher",
    "Handler",
    "InvalidRowError",
    "MissingHandlerError",
    "OutboxApp",
    "OutboxContext",
    "OutboxError",
    "OutboxMessage",
    "OutboxModel",
    "OutboxModelError",
    "OutboxPlugin",
    "OutboxSettings",
    "OutboxTable",
    "PayloadDecodeError",
    "RegistryError",
    "ShardFaultError",
    "ShardLockedError",
    "ShardNameError",
    "UnknownCategoryError",
    "create_outbox_tables",
    "next_object_identifier",
    "next_object_identifier_async",
    "outbox_context",
    "outbox_table",
    "write_outbox_rows",
    "write_outbox_rows_async",
]


def _installed_version() -> str:
    try:
        return importlib.metadata.version("outbox-bridge")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = version = _installed_version()
        return version
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'outbox_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "__version__"})
