"""An upgrade of outbox-bridge (or of the workflow code) still replays the histories this
service's workers recorded: exported with `outbox-bridge history export` into histories/."""

from __future__ import annotations

from pathlib import Path

from outbox_bridge.testing import assert_replays

HISTORIES = Path(__file__).parent / "histories"


def test_recorded_histories_replay() -> None:
    assert_replays(HISTORIES)
