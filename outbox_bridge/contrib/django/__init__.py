"""Django integration: write outbox rows with Django's connections, from models, migrations,
views and a management command; the worker itself runs on SQLAlchemy and psycopg, against the
same database. ``"outbox_bridge.contrib.django"`` in ``INSTALLED_APPS`` brings the
``outbox_worker`` command, the system checks and a ``flush`` that empties the outbox tables;
the rest works without it.

Nothing is imported here: the modules are imported one by one, the producer's without the
worker's (see CONTRIBUTING.md, "Layers").
"""
