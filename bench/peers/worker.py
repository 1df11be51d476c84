"""The processes a system's run is made of: ``python -m bench.peers.worker PEER LOG_DIR
COMMAND``, the run's :class:`~bench.peers.base.RunSpec` in ``LOG_DIR``.

- ``schema``: the system creates its tables;
- ``enqueue``: every row of ``rows.json`` in one transaction;
- ``write RATE START STOP``: the rows ``[START:STOP]`` of ``rows.json``, one transaction each at
  RATE rows/s, the wall time at which each commit returned appended to ``commits.tsv`` (for
  commit → handler latency);
- ``serve ROLE``: one of the system's worker processes, until SIGTERM.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from bench.peers import load
from bench.peers.base import RunSpec
from bench.peers.calls import configure
from bench.peers.checker import Row

ROWS_FILE = "rows.json"
COMMITS_FILE = "commits.tsv"


def read_rows(log_dir: Path) -> list[Row]:
    return [Row(*row) for row in json.loads((log_dir / ROWS_FILE).read_text())]


def write_rows(log_dir: Path, rows: list[Row]) -> None:
    rows_json = [[r.seq, r.key, r.category, r.obj] for r in rows]
    (log_dir / ROWS_FILE).write_text(json.dumps(rows_json))


def read_commits(log_dir: Path) -> dict[int, float]:
    path = log_dir / COMMITS_FILE
    if not path.exists():
        return {}
    pairs = (line.split("\t") for line in path.read_text().splitlines())
    return {int(seq): float(moment) for seq, moment in pairs}


def _write(peer_name: str, spec: RunSpec, rate: float, start: int, stop: int) -> None:
    rows = read_rows(Path(spec.log_dir))[start:stop]
    with (
        load(peer_name).producer(spec) as enqueue,
        (Path(spec.log_dir) / COMMITS_FILE).open("a", buffering=1) as commits,
    ):
        began = time.monotonic()
        for index, row in enumerate(rows):
            delay = began + index / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            enqueue([row])
            commits.write(f"{row.seq}\t{time.time()}\n")


def main(argv: list[str]) -> None:
    peer_name, log_dir, command, *rest = argv
    spec = RunSpec.load(Path(log_dir))
    configure(Path(log_dir), spec.wait_seconds)
    peer = load(peer_name)
    if command == "schema":
        peer.install_schema(spec)
    elif command == "enqueue":
        with peer.producer(spec) as enqueue:
            enqueue(read_rows(Path(log_dir)))
    elif command == "write":
        _write(peer_name, spec, float(rest[0]), int(rest[1]), int(rest[2]))
    elif command == "serve":
        peer.serve(spec, rest[0])
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a worker's threads (DBOS', Temporal's) must not hold the exit
