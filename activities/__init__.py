"""Temporal activity definitions of outbox-bridge."""

from outbox_bridge.activities.outbox import OutboxActivities

__all__ = ["OutboxActivities"]
