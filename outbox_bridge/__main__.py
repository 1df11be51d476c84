from outbox_bridge.cli import run

run()
