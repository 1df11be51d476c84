"""Django integration (see the Django page): outbox rows written with Django's connections;
the worker runs on SQLAlchemy and psycopg against the same database.

Nothing is imported here: the producer's modules load without the worker's (CONTRIBUTING.md,
"Layers").
"""
