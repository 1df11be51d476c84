"""The database layer: the outbox tables and every SQL statement run against them."""
