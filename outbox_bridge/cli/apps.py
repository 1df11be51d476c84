"""Which app a command runs: the one ``--app`` names (``module:attribute``), or the demo's."""

from __future__ import annotations

import os
import sys

from outbox_bridge import demo, registry
from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import RegistryError
from outbox_bridge.registry import OutboxApp


def load_app(spec: str) -> OutboxApp:
    """Import ``module:attribute`` (from the working directory too) and return the
    :class:`OutboxApp` it names."""
    _import_from_working_directory()
    return registry.load_app(spec)


def _import_from_working_directory() -> None:
    """Make the app importable from the working directory, as with ``python -m outbox_bridge``
    (whose path starts with it); the ``outbox-bridge`` script's path starts with its own
    folder instead."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def command_app(settings: OutboxSettings) -> OutboxApp | None:
    """The app named by ``--app`` (``module:attribute``), the demo app with ``--demo``, or None
    when neither is given."""
    if settings.demo and settings.app:
        raise RegistryError("--demo runs the demo app; do not also give --app")
    if settings.demo:
        return demo.app
    return load_app(settings.app) if settings.app else None


def worker_app(settings: OutboxSettings) -> OutboxApp:
    """The app the worker runs: :func:`command_app`, which must name one."""
    app = command_app(settings)
    if app is None:
        raise RegistryError(
            "no app to run: set OUTBOX_APP=module:attribute (or --app), or try --demo"
        )
    return app
