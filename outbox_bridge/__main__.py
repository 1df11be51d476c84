from outbox_bridge.cli.commands import run

run()
