"""Every error outbox-bridge raises derives from :class:`OutboxError`.

Driver and SDK errors are translated at the boundary into one of these leaves, with a message
that says what to do next.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Root of every error raised by outbox-bridge."""


class ConfigurationError(OutboxError):
    """The settings are incomplete or contradict each other."""


class InvalidControlInput(OutboxError, ValueError):
    """A signal or update input the outbox's workflows would refuse: nothing was sent."""


class RegistryError(OutboxError):
    """The scope/category registry is malformed (a category in two scopes, in none, ...)."""


class MissingHandlerError(RegistryError):
    """A registered category has no handler; the worker refuses to start."""


class InvalidRowError(OutboxError, ValueError):
    """A row refused at write time: nothing was written."""


class PayloadTooLargeError(InvalidRowError):
    """A payload larger than ``max_payload_bytes`` (the UTF-8 bytes of its JSON text).

    Refused at write time (nothing is written). A row written past the producer (a plain SQL
    ``INSERT``) is never read whole by the worker: its shard blocks on it with this error until
    an operator parks its group, the limit is raised, or the row is shrunk or deleted.
    """


class UnknownCategoryError(OutboxError):
    """A row in the table carries a category this worker's registry does not know.

    The row is kept and its shard blocks until a worker with a handler for it is deployed, or
    an operator skips the shard.
    """


class CategoryScopeError(OutboxError):
    """A row in the table carries a category that belongs to another scope."""


class PayloadDecodeError(OutboxError):
    """A row's payload is stored, but this worker cannot decode it (JSON nested deeper than
    Python's decoder goes, an integer longer than Python converts).

    The row is kept and its shard blocks until the row is fixed or deleted, or an operator
    skips the shard; the message names the row, never the payload.
    """


class ShardFaultError(OutboxError):
    """A step of a drain round failed for one shard, for a reason of its own other than its
    handler (its rows cannot be read, its handled rows cannot be deleted, ...).

    The shard is held like a shard whose handler failed, and retried; the round's other shards
    go on.
    """


class ShardLockedError(OutboxError):
    """Another execution of the same shard still holds the shard lock; the attempt is retried."""


class NothingToParkError(OutboxError):
    """The shard has no row that is not parked already."""


class NothingParkedError(OutboxError):
    """The shard has no parked group (or not the one named)."""


class EmbeddedServiceError(OutboxError):
    """An embedded PostgreSQL or Temporal dev server failed to start."""


class ShardNameError(OutboxError, ValueError):
    """A shard name given on the command line is not ``SCOPE:ID`` or ``REGION:SCOPE:ID``."""


class OutboxModelError(OutboxError):
    """A model declared with :class:`~outbox_bridge.orm.OutboxModel` cannot produce its outbox
    row: its app, category, shard identifier or object identifier cannot be inferred, or an
    instance's identifier is not an integer when it is flushed.

    Raised when the class is mapped for a declaration that does not fit, and from the flush for
    an instance; a failed flush rolls back, so a model change never commits without its row.
    """


class SchemaMismatchError(ConfigurationError):
    """The outbox tables in the database are not what this version expects (a table, column,
    index or the NOTIFY trigger missing or different); the worker refuses to start, naming what
    differs and the command that fixes it. The worker never changes the schema itself."""


class SchemaLockError(OutboxError):
    """``init-db`` could not get a lock on an outbox table in time, however many times it tried:
    a long transaction holds it. Nothing was changed."""


class MissingPrivilegeError(ConfigurationError):
    """The database role lacks a privilege on an outbox table that the work needs; the message
    names the role, the privilege and the table, and the command that prints the GRANT."""
