"""Django integration: write outbox rows with Django's connections, from models, migrations,
views and a management command. The worker itself runs on SQLAlchemy and psycopg, against the
same database.

Add ``"outbox_bridge.contrib.django"`` to ``INSTALLED_APPS`` for the ``outbox_worker``
management command, the system checks of the ``OUTBOX_BRIDGE`` setting, and a ``flush`` command
that empties the outbox tables with the model tables (after every transactional test); the
rest works without it.

- :mod:`~outbox_bridge.contrib.django.writes`: :func:`write_row` (and ``write_row_async``),
  ``app.write`` with a Django connection, inside ``transaction.atomic()``.
- :mod:`~outbox_bridge.contrib.django.models`: :class:`OutboxModel`, an abstract model whose
  saves and deletes write their rows; ``write_outbox_rows`` for bulk operations.
- :mod:`~outbox_bridge.contrib.django.operations`: ``CreateOutbox`` and ``DropOutbox``,
  migration operations that create and drop the outbox tables.
- :mod:`~outbox_bridge.contrib.django.flush`: ``outbox_context``, the ``flush_outbox`` view
  decorator and ``OutboxFlushMiddleware``: wait after the commit until the rows are handled.
- :mod:`~outbox_bridge.contrib.django.conf`: the ``OUTBOX_BRIDGE`` setting and a
  ``DATABASES`` entry as :class:`~outbox_bridge.OutboxSettings`.
- :mod:`~outbox_bridge.contrib.django.handlers`: handlers that use the ORM in the worker.
- :mod:`~outbox_bridge.contrib.django.tables`: the outbox tables that Django's ``flush``
  empties.
- :mod:`~outbox_bridge.contrib.django.testing`: drain the outbox in a test, or run the worker
  on the test database.

Nothing is imported here: the modules are imported one by one, the producer's without the
worker's (see CONTRIBUTING.md, "Layers").
"""
