"""System checks of the ``OUTBOX_BRIDGE`` setting: what the ``outbox_worker`` command and
the flushes configured from Django settings would refuse, found at start-up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, Warning

from outbox_bridge.contrib.django.conf import (
    SETTING,
    OutboxConfigurationError,
    app_spec,
    flush_timeout,
    outbox_app,
    outbox_settings,
)

SETTINGS_ID = "outbox_bridge.E001"
APP_ID = "outbox_bridge.E002"
NO_APP_ID = "outbox_bridge.W001"


def check_outbox_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """``OUTBOX_BRIDGE`` maps onto the settings, its database is PostgreSQL, and its app can
    be loaded."""
    try:
        outbox_settings()
        flush_timeout(1.0)
    except OutboxConfigurationError as exc:
        return [Error(str(exc), hint=f"See the {SETTING} setting.", id=SETTINGS_ID)]
    try:
        spec = app_spec()
        if spec is None:
            return [
                Warning(
                    f"{SETTING}['APP'] is not set: the outbox_worker command cannot run, and "
                    "flushes are configured from the environment only.",
                    hint=f"Set {SETTING}['APP'] = 'module:attribute' naming your OutboxApp.",
                    id=NO_APP_ID,
                )
            ]
        outbox_app()
    except OutboxConfigurationError as exc:
        return [Error(str(exc), id=APP_ID)]
    return []
