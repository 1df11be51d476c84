"""Benchmarks of outbox-bridge against a direct PostgreSQL drain.

Every workload inserts the same rows twice: once for the *baseline* (a direct drain in
PostgreSQL, one transaction per coalescing group, see :mod:`bench.baseline`) and once for the
*bridge* (``worker.serve`` run in-process, see :mod:`bench.bridge_run`), and reports both with
the same no-op handler. Run ``python -m bench --help``.
"""
