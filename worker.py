"""Run the outbox-bridge worker: ``python worker.py [options]``.

The same as ``outbox-bridge worker`` (see ``--help``). The wiring lives in
``outbox_bridge.runtime.worker``; the Temporal definitions in ``workflows/`` and ``activities/``.
"""

from outbox_bridge.cli import worker

if __name__ == "__main__":
    worker.main(prog_name="worker.py")
