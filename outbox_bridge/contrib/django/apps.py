"""The Django app of outbox-bridge: the ``outbox_worker`` command, the system checks of
``OUTBOX_BRIDGE``, ``flush`` and ``sqlflush`` commands that empty the outbox tables too, and
the passwords of ``OUTBOX_BRIDGE``'s URLs masked on Django's error pages."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks

from outbox_bridge.contrib.django.checks import check_outbox_settings
from outbox_bridge.contrib.django.conf import mask_urls_in_error_pages


class OutboxBridgeConfig(AppConfig):
    name = "outbox_bridge.contrib.django"
    label = "outbox_bridge"
    verbose_name = "outbox-bridge"

    def ready(self) -> None:
        checks.register(check_outbox_settings, "outbox_bridge")
        mask_urls_in_error_pages()
