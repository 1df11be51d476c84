from __future__ import annotations

import pytest

from outbox_bridge import OutboxTable, RegistryError, ShardNameError
from outbox_bridge.workflows.models import ShardRef
from tests.harness import Recorder, make_app


def test_shard_names_parse_to_workflow_ids() -> None:
    app = make_app("outbox", Recorder())
    from outbox_bridge.runtime.shards import parse_shard

    shard = parse_shard("organization:42", app)
    assert shard == ShardRef("outbox", 1, "ORGANIZATION", 42, None)
    assert shard.workflow_id == "outbox:outbox:ORGANIZATION:42"
    assert parse_shard("1:42", app).scope_name == "ORGANIZATION"


def test_regional_shard_names_lead_with_the_region() -> None:
    from outbox_bridge.runtime.shards import parse_shard

    app = make_app("control_outbox", Recorder(), regional=True)
    shard = parse_shard("eu:USER:7", app)
    assert shard.workflow_id == "outbox:control_outbox:eu:USER:7"
    assert shard.key == "eu:USER:7"
    with pytest.raises(ShardNameError, match="REGION:SCOPE:ID"):
        parse_shard("USER:7", app)


@pytest.mark.parametrize("name", ["ORGANIZATION", "ORGANIZATION:x", ":1", "A:B:C"])
def test_malformed_shard_names_are_refused(name: str) -> None:
    from outbox_bridge.runtime.shards import parse_shard

    with pytest.raises((ShardNameError, RegistryError)):
        parse_shard(name, make_app("outbox", Recorder()))


def test_unknown_scope_names_the_known_ones() -> None:
    from outbox_bridge.runtime.shards import parse_shard

    with pytest.raises(RegistryError, match="ORGANIZATION, USER"):
        parse_shard("TEAM:1", make_app("outbox", Recorder()))
    assert OutboxTable("outbox").name == "outbox"
