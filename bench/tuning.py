"""Runtime constants a benchmark run may change for an A/B comparison, in this process only.

The worker runs in the benchmark's process, so a run can set, for itself alone:

- ``delete_chunk_groups`` / ``delete_chunk_seconds``: how many handled groups (or how long
  after the first of them) a drain round waits before deleting them
  (:data:`outbox_bridge.runtime.batch.DELETE_CHUNK_GROUPS` and ``DELETE_CHUNK_SECONDS``);
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
from outbox_bridge.runtime import batch
from outbox_bridge.workflows.models import PartitionOptions

PARTITION_FIELDS = {f.name: f.type for f in dataclasses.fields(PartitionOptions)}


@dataclass(frozen=True)
class Tuning:
    delete_chunk_groups: int | None = None
    delete_chunk_seconds: float | None = None
    partition_options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """What this run changed, and the values in force (for the results)."""
        return {
            "delete_chunk_groups": self.delete_chunk_groups or batch.DELETE_CHUNK_GROUPS,
            "delete_chunk_seconds": self.delete_chunk_seconds or batch.DELETE_CHUNK_SECONDS,
            "partition_options_changed": dict(self.partition_options),
        }

    @property
    def changed(self) -> bool:
        return bool(self.delete_chunk_groups or self.delete_chunk_seconds or self.partition_options)


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
        "--delete-chunk-groups",
        type=int,
        default=None,
        help="A/B runs: delete handled rows once this many groups are waiting (default 10)",
    )
    parser.add_argument(
        "--delete-chunk-seconds",
        type=float,
        default=None,
        help="A/B runs: or this long after the first of them (default 0.05)",
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
    if args.delete_chunk_groups is not None and args.delete_chunk_groups < 1:
        parser.error("--delete-chunk-groups must be at least 1")
    if args.delete_chunk_seconds is not None and args.delete_chunk_seconds <= 0:
        parser.error("--delete-chunk-seconds must be positive")
    return Tuning(args.delete_chunk_groups, args.delete_chunk_seconds, options)


@contextlib.contextmanager
def applied(tuning: Tuning) -> Iterator[None]:
    """Set the constants of ``tuning`` for the duration of the block."""
    saved = (batch.DELETE_CHUNK_GROUPS, batch.DELETE_CHUNK_SECONDS)
    original = OutboxSettings.partition_options
    if tuning.delete_chunk_groups is not None:
        batch.DELETE_CHUNK_GROUPS = tuning.delete_chunk_groups
    if tuning.delete_chunk_seconds is not None:
        batch.DELETE_CHUNK_SECONDS = tuning.delete_chunk_seconds
    if tuning.partition_options:

        def partition_options(self: OutboxSettings, *args: Any, **kwargs: Any) -> PartitionOptions:
            return dataclasses.replace(original(self, *args, **kwargs), **tuning.partition_options)

        OutboxSettings.partition_options = partition_options  # type: ignore[method-assign]
    try:
        yield
    finally:
        batch.DELETE_CHUNK_GROUPS, batch.DELETE_CHUNK_SECONDS = saved
        OutboxSettings.partition_options = original  # type: ignore[method-assign]
