"""The Django app of outbox-bridge: the ``outbox_worker`` command, the system checks of
``OUTBOX_BRIDGE``, and ``flush`` and ``sqlflush`` commands that empty the outbox tables too."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks

from outbox_bridge.contrib.django.checks import check_outbox_settings


class OutboxBridgeConfig(AppConfig):
    name = "outbox_bridge.contrib.django"
    label = "outbox_bridge"
    verbose_name = "outbox-bridge"

    def ready(self) -> None:
        checks.register(check_outbox_settings, "outbox_bridge")
