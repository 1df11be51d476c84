"""A Django project that writes outbox rows from its models and views, migrates the outbox
tables, runs the worker with ``manage.py outbox_worker`` and waits for its rows in requests.
See examples/README.md."""
