"""Oban for Python (``oban`` 0.7): not measured here.

Every release of ``oban`` from 0.5 on needs Python 3.12 or later; this project runs on 3.11, so
the bench extra installs it only on 3.12+ and the report names it as not run, with that reason.
"""

from __future__ import annotations

import contextlib

from bench.peers.base import Enqueue, Peer, RunSpec


class Oban(Peer):
    name = "oban"
    distributions = ("oban",)
    module = "oban"
    python = (3, 12)
    ordered = False
    coroutines = True
    setting = "not run: no adapter (it needs Python >= 3.12)"

    def install_schema(self, spec: RunSpec) -> None:
        raise NotImplementedError(self.setting)

    def producer(self, spec: RunSpec) -> contextlib.AbstractContextManager[Enqueue]:
        raise NotImplementedError(self.setting)

    def serve(self, spec: RunSpec, role: str) -> None:
        raise NotImplementedError(self.setting)
