"""A FastAPI service whose ORM models write outbox rows; see examples/README.md."""
