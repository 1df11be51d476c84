"""The outbox's permissions, on a model with no table (the outbox tables are not models)."""

from __future__ import annotations

from django.db import models


class Outbox(models.Model):
    """Holds the permissions of the outbox admin, ``outbox_bridge.<codename>``: ``view_outbox``
    (the shards, pauses and parked groups), ``pause_outbox`` (pause and unpause) and
    ``park_outbox`` (park and unpark)."""

    id = models.BigAutoField(primary_key=True)

    class Meta:
        managed = False
        app_label = "outbox_bridge"  # the permissions read as outbox_bridge.pause_outbox
        verbose_name = "outbox"
        verbose_name_plural = "outbox"
        default_permissions = ("view",)
        permissions = [
            ("pause_outbox", "Can pause and unpause categories and scopes of the outbox"),
            ("park_outbox", "Can park and unpark coalescing groups of the outbox"),
        ]

    def __str__(self) -> str:
        return "outbox"
