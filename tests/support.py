"""What the test files share to run the project's own programs: a subprocess environment free of
this one's settings, a database URL with a password to look for in outputs, and ``python
worker.py`` run as a subprocess until its banner (or another sign) shows."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import psutil
import pytest
from sqlalchemy.engine import make_url

from tests.harness import wait_until

ROOT = Path(__file__).resolve().parents[1]
# What the worker prints once the bridge runs.
BANNER = "outbox-bridge is running"
# Environment variables that configure the project (or the sample and test apps): a subprocess
# gets none of ours, only those a test gives it.
SETTINGS_PREFIXES = ("OUTBOX_", "TEMPORAL_", "OTEL_", "SAMPLE_OUTBOX")


def clean_env(*drop: str, **extra: str) -> dict[str, str]:
    """The environment of a subprocess: ours without the settings (and without the variables
    whose names start with one of ``drop``), unbuffered, plus ``extra``."""
    prefixes = SETTINGS_PREFIXES + drop
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(prefixes)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def clear_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove the settings from this process's environment for the test's duration, so that
    what a test sets is all the settings read."""
    for key in list(os.environ):
        if key.upper().startswith(SETTINGS_PREFIXES):
            monkeypatch.delenv(key)


def with_password(database_url: str, canary: str) -> tuple[str, str]:
    """``database_url`` with the password ``canary`` (the embedded PostgreSQL trusts any password
    on its Unix socket), and that password; an external database keeps its own, which is then
    the one to look for."""
    url = make_url(database_url)
    if url.password:
        return database_url, str(url.password)
    return url.set(password=canary).render_as_string(hide_password=False), canary


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


# A program that waits on something without a deadline uses no CPU; one that is only slow because
# the machine is loaded does (starting Python and importing the package take 1.5-2.5 s of CPU,
# 20-40 s of wall time at a load of 12-17). So a program is given up on once it (with its
# children) used no CPU for ``timeout`` seconds, or at the latest after STALL_CAP times that.
STALL_CAP = 5
PROGRESS_STEP = 1.0


def cpu_seconds(pid: int) -> float:
    """The CPU time of process ``pid`` and its children so far (0 once it has ended)."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            times = process.cpu_times()
            used = times.user + times.system + times.children_user + times.children_system
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child_times = child.cpu_times()
                used += child_times.user + child_times.system
    except psutil.Error:
        return 0.0
    return used


async def finish_while_progressing(
    proc: asyncio.subprocess.Process, timeout: float
) -> tuple[bytes, bytes]:
    """``proc``'s output once it ended; :class:`TimeoutError` after it used no CPU for
    ``timeout`` seconds (it waits on something that never comes), or after ``STALL_CAP`` times
    ``timeout`` in all (it spins)."""
    output = asyncio.ensure_future(proc.communicate())
    loop = asyncio.get_running_loop()
    started = progressed = loop.time()
    used = cpu_seconds(proc.pid)
    while not output.done():
        now = loop.time()
        if now - progressed > timeout or now - started > STALL_CAP * timeout:
            output.cancel()
            raise TimeoutError
        await asyncio.wait([output], timeout=PROGRESS_STEP)
        if (now_used := cpu_seconds(proc.pid)) > used:
            used, progressed = now_used, loop.time()
    return output.result()


async def run_python(*args: str, env: dict[str, str], timeout: float = 60) -> Run:
    """``python ARGS`` from the repository's root, to its end (see :func:`finish_while_progressing`
    for ``timeout``)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=ROOT,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await finish_while_progressing(proc, timeout)
    except TimeoutError:
        used = cpu_seconds(proc.pid)
        proc.kill()
        out, err = await proc.communicate()
        raise AssertionError(
            f"{args} did not finish: no CPU used for {timeout}s, or {STALL_CAP * timeout}s in all "
            f"({used:.1f} s of CPU used, load average {os.getloadavg()[0]:.1f}): {out!r} {err!r}"
        ) from None
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), err.decode())


# One command at a time runs in a process: its environment and sys.stdout/sys.stderr are the
# process's. The modules of the tests' apps that read the environment when imported (their table),
# imported afresh for each command.
CLI_LOCK = threading.Lock()
FRESH_IMPORTS = ("tests.sample_app", "tests.test_health")


async def run_cli(*args: str, env: Mapping[str, str]) -> Run:
    """``outbox-bridge ARGS`` run in this process, in a thread of its own, with ``env`` as its
    whole environment: its exit code and what it printed, as ``python -m outbox_bridge ARGS``
    gives them, without the 2-3 s of CPU a new interpreter takes to import the package. The
    command runs to its end (``python -m`` is for what needs a process of its own: the entry
    points, signals, what Temporal's core writes to the process's stderr)."""
    return await asyncio.to_thread(_run_cli, list(args), dict(env))


def _run_cli(args: list[str], env: dict[str, str]) -> Run:
    from outbox_bridge.cli import main

    with CLI_LOCK, _environment(env), _fresh_imports(), _thread_output() as (out, err):
        try:
            main.main(args, prog_name="outbox-bridge")
            code = 0
        except SystemExit as exit_:  # what outbox_bridge.cli.run makes of it
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except Exception:
            traceback.print_exc()  # as the interpreter prints an uncaught exception
            code = 1
    return Run(code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _fresh_imports() -> Iterator[None]:
    saved = {name: sys.modules.pop(name) for name in FRESH_IMPORTS if name in sys.modules}
    try:
        yield
    finally:
        for name in FRESH_IMPORTS:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
        for name, module in saved.items():  # the package's attribute, rebound by the import
            package, _, attribute = name.rpartition(".")
            setattr(sys.modules[package], attribute, module)


class _ThreadStream(io.TextIOBase):
    """A stream that takes the writes of one thread and passes every other thread's on."""

    def __init__(self, others: TextIO) -> None:
        self.thread = threading.get_ident()
        self.others = others
        self.captured = io.StringIO()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def _target(self) -> TextIO:
        return self.captured if threading.get_ident() == self.thread else self.others

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return False  # a pipe, as for a subprocess: no colours


@contextlib.contextmanager
def _thread_output() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """This thread's sys.stdout and sys.stderr, and its warnings and errors logged with no
    handler of their own (as Python's last-resort handler prints them in a process that did not
    configure logging)."""
    out, err = _ThreadStream(sys.stdout), _ThreadStream(sys.stderr)
    last_resort = logging.StreamHandler(err)
    last_resort.setLevel(logging.WARNING)
    last_resort.addFilter(lambda record: record.thread == err.thread)
    root = logging.getLogger()
    sys.stdout, sys.stderr = out, err
    root.addHandler(last_resort)
    try:
        yield out.captured, err.captured
    finally:
        root.removeHandler(last_resort)
        sys.stdout, sys.stderr = out.others, err.others


async def init_db(env: dict[str, str], *args: str) -> None:
    """``outbox-bridge init-db ARGS`` with ``env``'s settings, as a deploy runs it before its
    workers (which only check the tables)."""
    result = await run_cli("init-db", *args, env=env)
    assert result.code == 0, result.output


class WorkerProcess:
    """A ``python worker.py`` subprocess, and what it has printed so far."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stdout = ""
        self.stderr = ""
        assert proc.stdout is not None and proc.stderr is not None
        self._readers = [
            asyncio.create_task(self._read(proc.stdout, "stdout")),
            asyncio.create_task(self._read(proc.stderr, "stderr")),
        ]

    async def _read(self, stream: asyncio.StreamReader, name: str) -> None:
        while chunk := await stream.read(4096):
            setattr(self, name, getattr(self, name) + chunk.decode(errors="replace"))

    def text(self) -> str:
        return self.stdout + self.stderr

    async def finish(self, timeout: float) -> int:
        """Wait for the process to exit (after a signal the test sent) and read the rest of its
        output; its exit code."""
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await self.close()
        return code

    async def close(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self._readers), 10)

    def __str__(self) -> str:
        return f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def shows_banner(worker: WorkerProcess) -> bool:
    return BANNER in worker.stdout


@contextlib.asynccontextmanager
async def worker_process(
    *args: str,
    env: dict[str, str],
    ready: Callable[[WorkerProcess], bool] = shows_banner,
    timeout: float = 60,
    what: str = "the worker's banner",
    script: str = "worker.py",
    cwd: Path = ROOT,
) -> AsyncIterator[WorkerProcess]:
    """Run ``python SCRIPT ARGS`` (by default the project's ``worker.py``) until the block
    ends, from the moment ``ready`` holds (by default: it printed its banner). Killed if the
    block leaves it running."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        script,
        *args,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    worker = WorkerProcess(proc)
    try:
        await wait_until(
            lambda: ready(worker) or proc.returncode is not None, timeout=timeout, what=what
        )
        assert proc.returncode is None, f"the worker exited early ({proc.returncode})\n{worker}"
        yield worker
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        with contextlib.suppress(Exception):
            await worker.close()
