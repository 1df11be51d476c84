"""outbox-bridge: a transactional outbox for Python services, executed by Temporal."""

from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import (
    CategoryScopeError,
    ConfigurationError,
    EmbeddedServiceError,
    InvalidRowError,
    MissingHandlerError,
    OutboxError,
    RegistryError,
    ShardLockedError,
    ShardNameError,
    UnknownCategoryError,
)
from outbox_bridge.registry import Handler, OutboxApp, OutboxMessage, OutboxTable
from outbox_bridge.schema import create_outbox_tables, outbox_table

__all__ = [
    "CategoryScopeError",
    "ConfigurationError",
    "EmbeddedServiceError",
    "Handler",
    "InvalidRowError",
    "MissingHandlerError",
    "OutboxApp",
    "OutboxError",
    "OutboxMessage",
    "OutboxSettings",
    "OutboxTable",
    "RegistryError",
    "ShardLockedError",
    "ShardNameError",
    "UnknownCategoryError",
    "create_outbox_tables",
    "outbox_table",
]
