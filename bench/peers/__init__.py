"""``python -m bench peers``: outbox-bridge measured side by side with the Python systems a team
could run its outbox on instead, on the same PostgreSQL, rows, handler body and machine.

Each system is one module here with one :class:`~bench.peers.base.Peer`; adding a system is
adding its module and its line in ``PEERS``.
"""

from __future__ import annotations

import importlib

from bench.peers.base import Peer

# name → module:class. The order of the report.
PEERS = {
    "outbox-bridge": "bench.peers.bridge:OutboxBridge",
    "procrastinate": "bench.peers.procrastinate:Procrastinate",
    "dbos": "bench.peers.dbos:Dbos",
    "pgqueuer": "bench.peers.pgqueuer:PgQueuer",
    "oban": "bench.peers.oban:Oban",
    "django-celery-outbox": "bench.peers.celery_outbox:CeleryOutbox",
}


def load(name: str, interpreter: str | None = None) -> Peer:
    """The system ``name``, its processes run by ``interpreter`` (default: this Python)."""
    module, _, cls = PEERS[name].partition(":")
    peer: Peer = getattr(importlib.import_module(module), cls)(interpreter)
    return peer
