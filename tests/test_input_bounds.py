"""The bounds of signal and update inputs (``workflows/inputs.py``): the settings never make
options the workflows refuse, the senders refuse before sending, and the reference documents
every bound as the code has it."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from outbox_bridge.cli.flags import required_reason
from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import InvalidControlInput
from outbox_bridge.runtime.calls import MAX_ERROR_MESSAGE
from outbox_bridge.runtime.shards import ShardStarter, checked
from outbox_bridge.workflows.inputs import (
    MAX_SKIP_SHARDS,
    MAX_TEXT,
    PARTITION_BOUNDS,
    SHARD_BOUNDS,
    InvalidInput,
    check_handover,
    check_partition_options,
    check_pause_change,
    check_shard_options,
    check_skip,
    decode,
)
from outbox_bridge.workflows.models import (
    HandlerFailure,
    HandoverInput,
    HeadGroup,
    HeldFor,
    PartitionOptions,
    PauseChange,
    ShardOptions,
    SkipInput,
)

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "workflows.md"


@pytest.mark.parametrize("edge", ["low", "high"])
def test_the_settings_never_make_options_the_workflows_refuse(edge: str) -> None:
    fields = OutboxSettings.model_fields
    values = {}
    for name in (
        "handler_timeout",
        "heartbeat_timeout",
        "initial_retry_interval",
        "max_retry_interval",
        "drain_max_groups",
        "drain_time_budget",
        "max_history_events",
        "poll_interval",
        "sweep_interval",
    ):
        limits = {type(m).__name__: m for m in fields[name].metadata}
        if edge == "high":
            values[name] = next(getattr(limits[k], k.lower()) for k in ("Le", "Lt") if k in limits)
        else:
            low = limits.get("Ge") or limits.get("Gt")
            values[name] = low.ge if hasattr(low, "ge") else low.gt + 1e-6  # type: ignore[union-attr]
    settings = OutboxSettings(**values)
    check_partition_options(settings.partition_options(["outbox:t:ORGANIZATION:1"]))
    check_shard_options(settings.shard_options())


def test_the_defaults_are_within_bounds() -> None:
    check_partition_options(PartitionOptions())
    check_shard_options(ShardOptions())


def test_senders_refuse_what_the_workflows_would_refuse() -> None:
    with pytest.raises(InvalidControlInput) as refused:
        checked(check_skip, SkipInput(reason="x" * (MAX_TEXT + 1), by="ann"), "skip")
    assert str(refused.value).startswith("skip: reason is 1,001 characters long, at most 1,000")
    assert "nothing was sent" in str(refused.value)
    with pytest.raises(InvalidControlInput, match=re.escape("drain_max_groups 0 is outside 1..10")):
        ShardStarter(None, task_queue="q", options=ShardOptions(drain_max_groups=0))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (PartitionOptions(max_shards=0), "max_shards 0 is outside 1..10,000"),
        (PartitionOptions(round_seconds=3601), "round_seconds 3601 is outside 1..3,600"),
        (PartitionOptions(poll_interval_seconds=0), "poll_interval_seconds 0 is outside > 0"),
        (PartitionOptions(max_history_events=9), "max_history_events 9 is outside 10..50,000"),
        (PartitionOptions(time_budget_seconds=float("nan")), "time_budget_seconds nan"),
        (PartitionOptions(max_rounds=2.0), "max_rounds must be an integer"),  # type: ignore[arg-type]
        (PartitionOptions(skip_shards=("ORGANIZATION:1",)), "not a shard workflow id"),
        (
            PartitionOptions(skip_shards=("outbox:t:O:1",) * (MAX_SKIP_SHARDS + 1)),
            "at most 10,000",
        ),
    ],
)
def test_partition_options_out_of_bounds_are_refused(options: PartitionOptions, why: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(why)):
        check_partition_options(options)


def test_other_inputs_out_of_bounds_are_refused() -> None:
    with pytest.raises(InvalidInput, match="max_id -1 is outside"):
        check_handover(HandoverInput(max_id=-1))
    with pytest.raises(InvalidInput, match="held_for must be one of"):
        check_handover(HandoverInput(held_for="everything"))  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="exactly one of category and scope"):
        check_pause_change(PauseChange(category="A", scope="B", reason="r"), pausing=True)
    with pytest.raises(InvalidInput, match="reason is required"):
        check_pause_change(PauseChange(category="A"), pausing=True)
    check_pause_change(PauseChange(category="A"), pausing=False)
    with pytest.raises(InvalidInput, match="takes one SkipInput argument, got 2"):
        decode([{}, {}], SkipInput, check_skip)
    with pytest.raises(InvalidInput, match="is not a SkipInput"):
        decode([[1]], SkipInput, check_skip)


def test_the_reference_documents_every_bound() -> None:
    reference = REFERENCE.read_text()
    for name, bound in {**PARTITION_BOUNDS, **SHARD_BOUNDS}.items():
        assert f"| `{name}` | {bound.text()} |" in reference, name


def test_what_the_worker_itself_hands_over_is_within_bounds() -> None:
    """A handler's longest error message, as the worker cuts it, and a row deferred by
    centuries: a partition's handover of them is never refused."""
    message = "x" * MAX_ERROR_MESSAGE + "… (123456 more characters in the worker's log)"
    check_handover(
        HandoverInput(
            max_id=2**63 - 1,
            held_for=HeldFor.FAILED,
            head=HeadGroup(2, "PROJECT_UPDATE", -(2**63), 1, 2**63 - 1, 3),
            failure=HandlerFailure("ReplicaUnavailable", message),
        )
    )
    check_handover(
        HandoverInput(
            held_for=HeldFor.DEFERRED,
            deferred_until="2300-01-01T00:00:00+00:00",
            deferred_seconds=9.0e9,
        )
    )


def test_the_command_line_refuses_a_reason_the_workflows_would_refuse() -> None:
    assert required_reason(" " + "x" * MAX_TEXT + " ", "skip") == "x" * MAX_TEXT
    with pytest.raises(click.BadParameter, match=re.escape("a skip's reason has at most 1,000")):
        required_reason("x" * (MAX_TEXT + 1), "skip")
