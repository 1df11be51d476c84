"""Integrations of outbox-bridge with frameworks: Django (:mod:`outbox_bridge.contrib.django`).

Nothing else in the package imports them (see CONTRIBUTING.md, "Layers").
"""
