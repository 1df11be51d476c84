"""Temporal workflow definitions of outbox-bridge, kept cheap to import: the sandbox re-imports
them for every new run. Installed as ``outbox_bridge.workflows``, their only name."""

if __name__ != "outbox_bridge.workflows":
    raise ImportError(f"import outbox_bridge.workflows, not {__name__} (one name per module)")
