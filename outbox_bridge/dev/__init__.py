"""What development, the demo and tests run beside the outbox: embedded servers, history replay."""
