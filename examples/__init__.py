"""Examples of outbox-bridge in the stacks it fits into."""
