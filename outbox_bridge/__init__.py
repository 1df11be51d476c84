"""outbox-bridge: a transactional outbox for Python services, executed by Temporal."""

from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import (
    CategoryScopeError,
    ConfigurationError,
    EmbeddedServiceError,
    InvalidRowError,
    MissingHandlerError,
    OutboxError,
    OutboxModelError,
    RegistryError,
    ShardLockedError,
    ShardNameError,
    UnknownCategoryError,
)
from outbox_bridge.flush import Flusher, FlushReport, OutboxContext, outbox_context
from outbox_bridge.identifiers import next_object_identifier, next_object_identifier_async
from outbox_bridge.orm import OutboxModel, write_outbox_rows, write_outbox_rows_async
from outbox_bridge.registry import Handler, OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.schema import create_outbox_tables, outbox_table
from workflows.models import FlushResult

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
    "OutboxSettings",
    "OutboxTable",
    "RegistryError",
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
