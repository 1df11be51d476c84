"""The app that puts the outbox in the Django admin."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxAdminConfig(AppConfig):
    name = "outbox_bridge.contrib.django.admin"
    label = "outbox_bridge_admin"  # "admin" is django.contrib.admin's
    verbose_name = "outbox-bridge admin"
