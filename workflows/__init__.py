"""Temporal workflow definitions of outbox-bridge."""

from workflows.shard import OutboxShard

__all__ = ["OutboxShard"]
