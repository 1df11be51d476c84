"""The Django app of the Django integration's tests: two models that write their outbox rows,
views that write rows and flush, and a migration that creates the outbox tables."""
