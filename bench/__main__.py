"""``python -m bench <workload>|all``: see ``--help``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from bench import corelog, tuning
from bench.context import DEFAULT_OUT, BenchConfig
from bench.runner import WORKLOADS, quiet_logs, run


def parse(argv: list[str] | None = None) -> tuple[list[str], BenchConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark outbox-bridge against a direct PostgreSQL drain. Each run starts "
        "its own embedded PostgreSQL and Temporal dev servers in a temporary directory, unless "
        "OUTBOX_DATABASE_URL / TEMPORAL_ADDRESS are set.",
    )
    parser.add_argument(
        "workload",
        choices=[*WORKLOADS, "all"],
        help="what to measure; all: every workload in this order. io-remote: io with the "
        "worker's database 2 ms away each way (through a delaying proxy), against io measured "
        "locally in the same run",
    )
    parser.add_argument(
        "--temporal",
        choices=["file", "memory", "both"],
        default=None,
        help="Temporal dev server storage: its SQLite file (WAL) or memory. Default: both for "
        "throughput workloads, file for latency.",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply row and shard counts (latency: its duration)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument(
        "--latency-seconds",
        type=float,
        default=None,
        help="writer duration of the latency workload (default 60 × scale)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=24 * 60.0,
        help="seconds the whole invocation may take; drains are capped to fit",
    )
    tuning.add_arguments(parser)
    parser.add_argument(
        "--handler-yield",
        action="store_true",
        help="every handler call yields to the event loop once, as a handler doing I/O would",
    )
    args = parser.parse_args(argv)
    if args.scale <= 0:
        parser.error("--scale must be positive")
    tuned = tuning.from_arguments(parser, args)
    config = BenchConfig.from_environment(
        scale=args.scale,
        out=args.out,
        temporal=args.temporal,
        latency_seconds=args.latency_seconds,
        budget=args.budget,
        handler_yield=args.handler_yield,
        tuning=tuned,
    )
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    return names, config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peers"]:
        from bench.peers import cli

        return cli.main(argv[1:])
    names, config = parse(argv)
    quiet_logs()
    corelog.install()
    try:
        asyncio.run(run(names, config))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    code = main()
    # A process that ran a Temporal worker can crash in interpreter teardown: leave explicitly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
