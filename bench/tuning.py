"""Runtime constants a benchmark run may change for an A/B comparison, in this process only.

The worker runs in the benchmark's process, so a run can set, for itself alone:

- ``max_undeleted_groups``: how many groups the worker's drain rounds may have handled and not
  deleted before they take no further group (the worker's setting of that name, by default as
  many as the worker can run calls at once; what a kill -9 repeats besides the calls under way);
- ``handover_after``: seconds a partition retries a shard whose handler failed before the shard
  goes to a workflow of its own (the worker's setting of that name; 0 hands it over at once);
- ``partition_options``: fields of the :class:`~outbox_bridge.workflows.models.PartitionOptions`
  the bridge hands its partitions (``max_shards``, ``max_groups``, ``max_rounds``, ...).

Every run records what it changed (:func:`describe`), and the defaults are restored after it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from outbox_bridge import OutboxSettings
from outbox_bridge.workflows.models import PartitionOptions

PARTITION_FIELDS = {f.name: f.type for f in dataclasses.fields(PartitionOptions)}


@dataclass(frozen=True)
class Tuning:
    max_undeleted_groups: int | None = None
    partition_options: dict[str, Any] = field(default_factory=dict)
    handover_after: float | None = None

    def describe(self) -> dict[str, Any]:
        """What this run changed (for the results; the settings in force, this one's included,
        are in each entry's ``settings``)."""
        return {
            "settings_changed": self.settings(),
            "partition_options_changed": dict(self.partition_options),
        }

    def settings(self) -> dict[str, Any]:
        """The worker settings this run changes."""
        changed: dict[str, Any] = {}
        if self.max_undeleted_groups is not None:
            changed["max_undeleted_groups"] = self.max_undeleted_groups
        if self.handover_after is not None:
            changed["handover_after"] = self.handover_after
        return changed

    @property
    def changed(self) -> bool:
        return bool(self.settings() or self.partition_options)


def parse_partition_option(text: str) -> tuple[str, Any]:
    """``name=value`` for a numeric field of PartitionOptions."""
    name, sep, value = text.partition("=")
    if not sep or name not in PARTITION_FIELDS:
        numeric = [n for n, t in PARTITION_FIELDS.items() if t in ("int", "float")]
        raise ValueError(f"expected NAME=VALUE with NAME one of {', '.join(numeric)}")
    kind = PARTITION_FIELDS[name]
    if kind == "int":
        return name, int(value)
    if kind == "float":
        return name, float(value)
    raise ValueError(f"{name} cannot be set from the command line")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of an A/B run."""
    parser.add_argument(
        "--max-undeleted-groups",
        type=int,
        default=None,
        help="A/B runs: groups the drains may have handled and not deleted (default: as many "
        "as the worker can run calls at once)",
    )
    parser.add_argument(
        "--handover-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="A/B runs: seconds a partition retries a failing shard before its handover "
        "(default: the setting's, 5; 0: at the first failure)",
    )
    parser.add_argument(
        "--partition-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="A/B runs: a PartitionOptions field for this run (repeatable), e.g. max_groups=50",
    )


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Tuning:
    """The tuning the options of :func:`add_arguments` ask for (``parser.error`` if invalid)."""
    try:
        options = dict(parse_partition_option(o) for o in args.partition_option)
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_undeleted_groups is not None and args.max_undeleted_groups < 1:
        parser.error("--max-undeleted-groups must be at least 1")
    if args.handover_after is not None and not 0 <= args.handover_after <= 3600:
        parser.error("--handover-after must be between 0 and 3600 seconds")
    return Tuning(args.max_undeleted_groups, options, args.handover_after)


@contextlib.contextmanager
def applied(tuning: Tuning) -> Iterator[None]:
    """Set the partition options of ``tuning`` for the duration of the block (its settings go
    with the worker's, see :meth:`Tuning.settings`)."""
    original = OutboxSettings.partition_options
    if tuning.partition_options:

        def partition_options(self: OutboxSettings, *args: Any, **kwargs: Any) -> PartitionOptions:
            return dataclasses.replace(original(self, *args, **kwargs), **tuning.partition_options)

        OutboxSettings.partition_options = partition_options  # type: ignore[method-assign]
    try:
        yield
    finally:
        OutboxSettings.partition_options = original  # type: ignore[method-assign]
