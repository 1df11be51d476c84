"""Temporal workflow definitions of outbox-bridge (the workflow is in ``workflows.shard``).

Kept empty: every new workflow run re-imports its module in the sandbox, so this package must be
cheap to import.
"""
