"""The ``outbox-bridge`` command line: the worker and the tools that inspect and steer shards."""

from outbox_bridge.cli import upgrade  # registers its command on main
from outbox_bridge.cli.commands import main, run, worker

__all__ = ["main", "run", "upgrade", "worker"]
