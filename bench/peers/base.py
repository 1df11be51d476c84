"""The one narrow interface every system of ``python -m bench peers`` is measured through.

A system is one module of ``bench/peers/`` with one :class:`Peer` subclass: it creates its own
tables with its own schema tool, enqueues rows for keys in one transaction as an outbox producer
would, and serves them in a worker process of its own with its own worker API, each call going
through the one handler body of :mod:`bench.peers.calls`. Its library is imported only inside
its methods, which run in processes of their own (:mod:`bench.peers.worker`): the bench itself
never loads a peer.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from bench.peers.checker import Row

SPEC_FILE = "spec.json"
# Enqueues one transaction of rows.
Enqueue = Callable[[Sequence[Row]], None]


@dataclass(frozen=True)
class RunSpec:
    """What one system's run is given: its own database, where calls are logged, the handler's
    wait, how many calls at once its worker may make, and a name unique to the run."""

    database_url: str  # postgresql://… (libpq), the run's own database
    log_dir: str
    name: str  # letters, digits and _: the run's queue, table or application name
    wait_seconds: float = 0.0
    concurrency: int = 50
    temporal_address: str | None = None

    def save(self) -> Path:
        path = Path(self.log_dir) / SPEC_FILE
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def load(cls, log_dir: Path) -> RunSpec:
        return cls(**json.loads((log_dir / SPEC_FILE).read_text()))


class Peer(ABC):
    """A system measured side by side with the others."""

    name: ClassVar[str]
    distributions: ClassVar[tuple[str, ...]]  # PyPI names whose versions the report names
    module: ClassVar[str]  # what must import for the system to run
    python: ClassVar[tuple[int, int]] = (3, 11)  # the oldest Python it installs on
    ordered: ClassVar[bool]  # whether it keeps rows of a key in order, one at a time
    coalescing: ClassVar[bool] = False  # whether a call may answer for older rows of its group
    coroutines: ClassVar[bool]  # whether its worker runs ``async def`` handlers
    needs_temporal: ClassVar[bool] = False
    # The processes its worker side is made of, each started with its role (a relay and a
    # worker, say); all run until SIGTERM, and their CPU is counted together.
    roles: ClassVar[tuple[str, ...]] = ("worker",)
    setting: ClassVar[str]  # how it is configured for order per key (or why it is not)

    def missing(self) -> str | None:
        """Why the system cannot run here (None when it can)."""
        if sys.version_info[:2] < self.python:
            wanted = ".".join(map(str, self.python))
            return f"needs Python >= {wanted} (this is {sys.version.split()[0]})"
        absent = [d for d in self.distributions if not _installed(d)]
        if absent or importlib.util.find_spec(self.module) is None:
            names = ", ".join(absent or [self.module])
            return f"not installed ({names}): pip install -e '.[bench]'"
        return None

    def versions(self) -> dict[str, str]:
        return {d: importlib.metadata.version(d) for d in self.distributions if _installed(d)}

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ordered": self.ordered,
            "coalescing": self.coalescing,
            "handler": "async def" if self.coroutines else "def",
            "setting": self.setting,
        }

    @abstractmethod
    def install_schema(self, spec: RunSpec) -> None:
        """Create the system's tables in the run's database with its own schema tool."""

    @abstractmethod
    def producer(self, spec: RunSpec) -> contextlib.AbstractContextManager[Enqueue]:
        """A producer on one connection: each call enqueues its rows in one transaction."""

    @abstractmethod
    def serve(self, spec: RunSpec, role: str) -> None:
        """Run the system's process ``role`` (one of ``roles``) until SIGTERM; every job calls
        :func:`bench.peers.calls.handle` (or ``handle_async``) with its row."""


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@contextlib.contextmanager
def single(enqueue: Enqueue) -> Iterator[Enqueue]:
    """A producer that needs nothing kept open between transactions."""
    yield enqueue
