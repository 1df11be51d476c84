"""A steady producer: one row per transaction at a fixed rate, recording commit wall times."""

from __future__ import annotations

import random
import threading
import time

from bench.app import CATEGORIES
from bench.rows import SCOPE, connect


class SteadyWriter:
    """Commit ``rate`` rows per second for ``seconds`` over ``shards`` shards (each row its own
    coalescing group), from a thread with its own connection. ``commits`` maps each id to the
    wall time at which its COMMIT returned."""

    def __init__(
        self, database_url: str, table: str, *, rate: float, shards: int, seconds: float
    ) -> None:
        self._url = database_url
        self._table = table
        self.rate = rate
        self.shards = shards
        self.total = max(1, round(rate * seconds))
        self.commits: dict[int, float] = {}
        self.started_wall = 0.0
        self.max_lag = 0.0
        self._stop = threading.Event()

    @property
    def written(self) -> int:
        return len(self.commits)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        rng = random.Random(7)
        insert = (
            f"INSERT INTO {self._table} "
            "(shard_scope, shard_identifier, category, object_identifier) "
            "VALUES (%s, %s, %s, %s) RETURNING id"
        )
        with connect(self._url) as conn:
            began = time.monotonic()
            self.started_wall = time.time()
            for index in range(self.total):
                delay = began + index / self.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:
                    self.max_lag = max(self.max_lag, -delay)
                if self._stop.is_set():
                    return
                values = (SCOPE, rng.randrange(self.shards) + 1, CATEGORIES[index % 5], index + 1)
                row = conn.execute(insert, values).fetchone()
                conn.commit()
                assert row is not None
                self.commits[int(row[0])] = time.time()
