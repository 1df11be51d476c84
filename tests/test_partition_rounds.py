"""Unit test of how many groups of each shard a partition's round takes (no servers)."""

from __future__ import annotations

from outbox_bridge.runtime.partition_drain import MAX_GROUPS_PER_SHARD, groups_per_shard
from outbox_bridge.workflows.models import PartitionOptions


def test_a_round_of_few_shards_takes_more_groups_of_each() -> None:
    options = PartitionOptions(max_shards=200, max_groups=100)
    # A full round: max_groups of each shard.
    assert groups_per_shard(options, 200) == 100
    # Fewer shards: about as many groups in all, up to the cap per shard.
    assert groups_per_shard(options, 40) == 500
    assert groups_per_shard(options, 1) == MAX_GROUPS_PER_SHARD
    # Never fewer than max_groups, and an empty round does not divide by zero.
    assert groups_per_shard(PartitionOptions(max_shards=5, max_groups=100), 5) == 100
    assert groups_per_shard(options, 0) == MAX_GROUPS_PER_SHARD
