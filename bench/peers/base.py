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
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from bench.peers.checker import Row

ROOT = Path(__file__).resolve().parents[2]
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

    def __init__(self, interpreter: str | None = None) -> None:
        # The Python its processes run on: this one, or one with the system installed.
        self.interpreter = interpreter or sys.executable

    def missing(self) -> str | None:
        """Why the system cannot run here (None when it can)."""
        found = self._probe()
        version = tuple(found.pop("python"))
        if version < self.python:
            wanted = ".".join(map(str, self.python))
            where = "" if self.interpreter == sys.executable else f" {self.interpreter}"
            return (
                f"needs Python >= {wanted} (this{where} is {'.'.join(map(str, version))}): "
                f"give one where it is installed with --interpreter {self.name}=PATH"
            )
        absent = [d for d in self.distributions if d not in found] + found.get("no_module", [])
        if absent:
            return f"not installed ({', '.join(absent)}): pip install -e '.[bench]'"
        return None

    def versions(self) -> dict[str, str]:
        found = self._probe()
        return {d: str(found[d]) for d in self.distributions if d in found}

    def _probe(self) -> dict[str, Any]:
        """The interpreter's version and the system's distributions' versions, asked of the
        interpreter itself when it is not this one."""
        if self.interpreter == sys.executable:
            return _probe(self.distributions, self.module)
        script = (
            "import json, sys; from bench.peers.base import _probe; "
            f"print(json.dumps(_probe({list(self.distributions)!r}, {self.module!r})))"
        )
        done = subprocess.run(
            [self.interpreter, "-c", script], cwd=ROOT, capture_output=True, text=True,
            timeout=60, check=True,
        )  # fmt: skip
        found: dict[str, Any] = json.loads(done.stdout)
        return found

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


def _probe(distributions: Sequence[str], module: str) -> dict[str, Any]:
    """This Python's version, the versions of ``distributions`` installed, and ``module``
    under ``no_module`` if it does not import."""
    found: dict[str, Any] = {"python": list(sys.version_info[:2])}
    for distribution in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[distribution] = importlib.metadata.version(distribution)
    if importlib.util.find_spec(module) is None:
        found["no_module"] = [module]
    return found


@contextlib.contextmanager
def single(enqueue: Enqueue) -> Iterator[Enqueue]:
    """A producer that needs nothing kept open between transactions."""
    yield enqueue
