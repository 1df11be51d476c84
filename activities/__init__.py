"""Temporal activity definitions of outbox-bridge (``outbox_bridge.activities``, its only name)."""

if __name__ != "outbox_bridge.activities":
    raise ImportError(f"import outbox_bridge.activities, not {__name__} (one name per module)")
