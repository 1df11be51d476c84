from outbox_bridge.cli import main

main(prog_name="outbox-bridge")
