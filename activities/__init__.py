"""Temporal activity definitions of outbox-bridge."""

from activities.outbox import OutboxActivities

__all__ = ["OutboxActivities"]
