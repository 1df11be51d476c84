"""outbox-bridge: a transactional outbox for Python services, executed by Temporal.

The names below are the public API, loaded on first use: importing ``outbox_bridge`` (or a
subpackage, such as the workflow definitions Temporal's sandbox re-imports) costs nothing, and
an application that only writes rows (``OutboxApp``, ``app.write``, ``OutboxModel``) loads
SQLAlchemy, pydantic and the OpenTelemetry API, never the worker's Temporal client, the
OpenTelemetry SDK or the command line. CONTRIBUTING.md describes the layers.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str

    from outbox_bridge.config import OutboxSettings
    from outbox_bridge.db.install import create_outbox_tables
    from outbox_bridge.db.schema import outbox_table
    from outbox_bridge.errors import (
        CategoryScopeError,
        ConfigurationError,
        EmbeddedServiceError,
        InvalidRowError,
        MissingHandlerError,
        MissingPrivilegeError,
        OutboxError,
        OutboxModelError,
        PayloadDecodeError,
        PayloadTooLargeError,
        RegistryError,
        SchemaLockError,
        SchemaMismatchError,
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
_MODULES = {
    "outbox_bridge.config": ["OutboxSettings"],
    "outbox_bridge.db.install": ["create_outbox_tables"],
    "outbox_bridge.db.schema": ["outbox_table"],
    "outbox_bridge.errors": [
        "CategoryScopeError",
        "ConfigurationError",
        "EmbeddedServiceError",
        "InvalidRowError",
        "MissingHandlerError",
        "MissingPrivilegeError",
        "OutboxError",
        "OutboxModelError",
        "PayloadDecodeError",
        "PayloadTooLargeError",
        "RegistryError",
        "SchemaLockError",
        "SchemaMismatchError",
        "ShardFaultError",
        "ShardLockedError",
        "ShardNameError",
        "UnknownCategoryError",
    ],
    "outbox_bridge.flush": ["Flusher", "FlushReport", "OutboxContext", "outbox_context"],
    "outbox_bridge.identifiers": ["next_object_identifier", "next_object_identifier_async"],
    "outbox_bridge.orm": ["OutboxModel", "write_outbox_rows", "write_outbox_rows_async"],
    "outbox_bridge.registry": ["Handler", "OutboxApp", "OutboxMessage", "OutboxTable"],
    "outbox_bridge.runtime.outbox_plugin": ["OutboxPlugin"],
    "outbox_bridge.workflows.models": ["FlushResult"],
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

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
    "MissingPrivilegeError",
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
    "PayloadTooLargeError",
    "RegistryError",
    "SchemaLockError",
    "SchemaMismatchError",
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


def __getattr__(name: str) -> Any:
    value: Any
    if name == "__version__":
        try:
            value = importlib.metadata.version("outbox-bridge")
        except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
            value = "0+unknown"
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'outbox_bridge' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "__version__"})
