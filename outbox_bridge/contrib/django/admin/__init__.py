"""The outbox in the Django admin (see the Django page, "The admin"): a Django app of its own,
``outbox_bridge.contrib.django.admin`` in ``INSTALLED_APPS``, because its actions reach Temporal
(as the command line's do) and a project that only writes rows loads nothing of the worker.

Nothing is imported here: Django's admin imports this package for the ``outbox_bridge`` app.
"""
