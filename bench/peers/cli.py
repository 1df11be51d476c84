"""``python -m bench peers``: see ``--help``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.context import DEFAULT_OUT
from bench.cpu import postgres_root
from bench.peers import PEERS, load, report
from bench.peers.database import PRELOAD, embedded, libpq
from bench.peers.run import Options, measure
from bench.peers.workloads import WORKLOADS
from bench.progress import say

INSTALL = "pip install -e '.[bench]'"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench peers",
        description="The same outbox work through outbox-bridge and the systems a team could "
        "use instead, each configured for order per key where it offers it, on one embedded "
        f"PostgreSQL (or OUTBOX_DATABASE_URL; TEMPORAL_ADDRESS for outbox-bridge's Temporal). "
        f"The other systems install with: {INSTALL}",
    )
    parser.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma-separated, of: {', '.join(PEERS)}"
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of: {', '.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply rows and keys (latency: duration)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=50,
        help="calls at once a system's worker may make, where it has such a setting",
    )
    parser.add_argument(
        "--cap",
        type=float,
        default=None,
        help="seconds a system may take to drain a workload before it is stopped and reported "
        "as capped (default: each workload's own, 60 to 300 s)",
    )
    parser.add_argument(
        "--interpreter",
        action="append",
        default=[],
        metavar="SYSTEM=PYTHON",
        help="run SYSTEM's processes on PYTHON, an environment with the system installed (Oban "
        "needs Python 3.12); it imports bench/ from this repository",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where each run's calls, rows and worker output are kept (default: a temporary "
        "directory, removed at the end)",
    )
    return parser


def parse(argv: list[str]) -> tuple[list[str], list[str], argparse.Namespace]:
    p = parser()
    args = p.parse_args(argv)
    peers = [n.strip() for n in args.peers.split(",") if n.strip()]
    workloads = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in peers if n not in PEERS] + [n for n in workloads if n not in WORKLOADS]
    if unknown:
        p.error(f"unknown peers or workloads: {', '.join(unknown)}")
    if args.scale <= 0 or args.concurrency < 1:
        p.error("--scale must be positive and --concurrency at least 1")
    pairs = [item.partition("=") for item in args.interpreter]
    if any(not sep or name not in PEERS or not path for name, sep, path in pairs):
        p.error(f"--interpreter takes SYSTEM=PYTHON, SYSTEM one of: {', '.join(PEERS)}")
    args.interpreter = {name: path for name, _, path in pairs}
    return peers, workloads, args


def systems(peers: list[str], interpreters: dict[str, str]) -> dict[str, dict[str, Any]]:
    """What each system is and how it is set up, or why it cannot run here."""
    described = {}
    for name in peers:
        peer = load(name, interpreters.get(name))
        reason = peer.missing()
        described[name] = {**peer.describe(), **({"reason": reason} if reason else {})}
        if not reason:
            described[name]["versions"] = peer.versions()
    return described


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def new_report(peers: list[str], workloads: list[str], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "kind": "peers",
        "scale": args.scale,
        "concurrency": args.concurrency,
        "cap_s": args.cap,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, {platform.python_implementation()} "
        f"{platform.python_version()}, load average at start {loadavg()}",
        "statements_source": f"{PRELOAD} (top-level statements) and pg_stat_database",
        "systems": systems(peers, args.interpreter),
        "workloads": {
            w: {"name": w, "summary": WORKLOADS[w].summary, "entries": []} for w in workloads
        },
    }


async def run(peers: list[str], workloads: list[str], args: argparse.Namespace) -> dict[str, Any]:
    result = new_report(peers, workloads, args)
    missing = {n: s["reason"] for n, s in result["systems"].items() if s.get("reason")}
    for name, reason in missing.items():
        say("peers", f"{name} will not run: {reason}")
    with _work_dir(args.work_dir) as base:
        given = os.environ.get("OUTBOX_DATABASE_URL")
        server = embedded(base / "postgres") if not given else contextlib.nullcontext(libpq(given))
        with server as url:
            options = Options(
                scale=args.scale,
                concurrency=args.concurrency,
                base_dir=base,
                admin_url=url,
                postgres=None if given else postgres_root(base / "postgres"),
                cap=args.cap,
                interpreters=args.interpreter,
                temporal_address=os.environ.get("TEMPORAL_ADDRESS"),
            )
            for workload in workloads:
                for name in peers:
                    say(name, f"{workload} ...")
                    before = loadavg()
                    entry = await measure(name, WORKLOADS[workload], options)
                    entry["loadavg"] = before
                    entry["loadavg_after"] = loadavg()
                    result["workloads"][workload]["entries"].append(entry)
                    report.write(args.out, result)
                print(report.markdown_table(result["workloads"][workload]), flush=True)
                report.chart(args.out, result)
    say("peers", f"results in {args.out / 'peers.md'}, {args.out / 'peers.json'}, chart "
        f"{args.out / 'peers.png'}")  # fmt: skip
    return result


@contextlib.contextmanager
def _work_dir(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="outbox-peers-") as tmp:
        yield Path(tmp)


def main(argv: list[str]) -> int:
    peers, workloads, args = parse(argv)
    asyncio.run(run(peers, workloads, args))
    return 0
