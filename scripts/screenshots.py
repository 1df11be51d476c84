"""Take the Temporal UI screenshots of the documentation from a running demo.

    python scripts/screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

Starts ``python worker.py --demo`` in a temporary data directory (embedded PostgreSQL, Temporal
dev server and UI on free ports), with the demo's settings as the quick start runs them. It
walks through the quick start with shard ``ORGANIZATION:7``, blocked by the demo's planned
outage: photographs it blocked, skips it with a reason (``outbox-bridge skip``), photographs
it skipped, and resumes it (``outbox-bridge resume``) at the end. Captured with headless
Chromium:

- ``ui-shard-list.png``: the workflow list filtered with ``WorkflowType="OutboxShard"``;
- ``ui-blocked-shard.png``: ``ORGANIZATION:7``'s first view while blocked: its timeline labels
  the pending category activity with what it is blocked on and since when;
- ``ui-skipped-shard.png``: ``ORGANIZATION:7``'s first view once skipped: its timeline labels
  the timer it waits on with who skipped it, when, and why;
- ``ui-skipped-query.png``: the saved query ``WorkflowType="OutboxShard" AND
  OutboxState="skipped"`` in the workflow list, listing the skipped shard;
- ``ui-deferred-shard.png``: a deferred shard's first view, its timer labelled with the time it
  waits for (only when the demo defers one meanwhile);
- ``ui-partition.png``: an ``OutboxPartition`` workflow and its drain activity (only when the
  worker runs partitions);
- ``ui-pauses.png``: the table's ``OutboxControl`` workflow after its ``pause`` update paused
  ``PROJECT_UPDATE``: its first view lists the active pauses (the category is resumed after).

A step that fails says why: a command's error output, or what the page showed instead.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``), with
the standard library only: no browser download, no driver package. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle

from outbox_bridge.demo import OUTAGE_ORGANIZATION
from outbox_bridge.demo import app as demo_app
from outbox_bridge.workflows.models import (
    PartitionOptions,
    PartitionStatus,
    PauseChange,
    PausesView,
    ShardState,
    ShardStatus,
)

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HEIGHT = 1400, 900
SKIP_REASON = "project replica down, ticket OPS-1234"
PAUSE_REASON = "search index rebuild, ticket OPS-1240"
# What the UI's result panel says while the run is open (its header's status may lag).
RUNNING = "Results will appear upon completion"

# The quick start's shard, blocked by the demo's planned outage (5 minutes by default).
OUTAGE_SHARD = f"ORGANIZATION:{OUTAGE_ORGANIZATION}"
OUTAGE_WORKFLOW = f"outbox:{demo_app.table().name}:{OUTAGE_SHARD}"
# The commands the script runs, named here so that a test can parse them with the command line.
SKIP = ("skip", OUTAGE_SHARD, "--reason", SKIP_REASON)
RESUME = ("resume", OUTAGE_SHARD)
STATUS = ("status", OUTAGE_SHARD)
COMMANDS = (SKIP, RESUME, STATUS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- Chromium over the DevTools protocol --------------------------------------------------------


class Browser:
    """Headless Chromium, spoken to over ``--remote-debugging-pipe`` (fds 3 and 4)."""

    def __init__(self, executable: str, profile: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_pipes() -> None:  # in the child: its fd 3 reads commands, fd 4 writes answers
            # Above 9 first: the pipes may already sit on fds 3 or 4.
            reads = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
            writes = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(reads, 3)
            os.dup2(writes, 4)

        self._process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=wire_pipes,
            pass_fds=(3, 4),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._target: str | None = None
        self._session = ""

    def send(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._read()
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return dict(answer.get("result", {}))

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return dict(json.loads(raw))

    def evaluate(self, expression: str) -> Any:
        result = self.send(
            "Runtime.evaluate",
            session=True,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        return result.get("result", {}).get("value")

    def open(self, url: str) -> None:
        """Open ``url`` in a new tab (the UI loads some panels only on a fresh page load)."""
        if self._target is not None:
            self.send("Target.closeTarget", targetId=self._target)
        self._target = self.send("Target.createTarget", url="about:blank")["targetId"]
        attached = self.send("Target.attachToTarget", targetId=self._target, flatten=True)
        self._session = attached["sessionId"]
        self.send(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=WIDTH,
            height=HEIGHT,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.send("Page.navigate", session=True, url=url)

    def page_text(self) -> str:
        """The text of the page and of its frames (the UI renders current details in one)."""
        return str(
            self.evaluate(
                """[document.body.innerText, ...[...document.querySelectorAll('iframe')].map(
                    f => { try { return f.contentDocument.body.innerText; } catch { return ''; } }
                )].join('\\n')"""
            )
            or ""
        )

    def wait_for_text(self, *texts: str, timeout: float = 30) -> None:
        """Wait until the page shows every one of ``texts`` (and a moment for it to settle)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = self.page_text()
            if all(text in shown for text in texts):
                time.sleep(1.5)
                return
            time.sleep(0.5)
        raise TimeoutError(f"the page did not show {texts}; it shows: {self.page_text()[:2000]!r}")

    def open_showing(self, url: str, *texts: str, tries: int = 4, timeout: float = 15) -> None:
        """Open ``url`` until it shows ``texts``: the UI asks a workflow for its current details
        once per page load, and a busy workflow may not answer that one query."""
        for attempt in range(tries):
            self.open(url)
            try:
                self.wait_for_text(*texts, timeout=timeout)
                return
            except TimeoutError:
                if attempt == tries - 1:
                    raise

    def show_raw_query(self) -> None:
        """Open the workflow list's query editor (the button right of "Clear all"), which shows
        the query as typed: the filter chips misread a query that names an attribute's value."""
        self.evaluate(
            """(() => {
            const clear = [...document.querySelectorAll('button')]
                .find(e => e.innerText.trim() === 'Clear all');
            const buttons = [...clear.closest('.w-full').querySelectorAll('button')];
            buttons[buttons.length - 1].click();
        })()"""
        )
        time.sleep(1.5)

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close")
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
        os.close(self._to_browser)
        os.close(self._from_browser)


# -- the demo -------------------------------------------------------------------------------


@contextlib.contextmanager
def demo(workdir: Path, temporal_port: int, ui_port: int) -> Iterator[None]:
    log = (workdir / "worker.log").open("w")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "TEMPORAL_"))}
    worker = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "worker.py"),
            "--demo",
            "--data-dir",
            str(workdir / "data"),
            "--temporal-port",
            str(temporal_port),
            "--temporal-ui-port",
            str(ui_port),
            "--health-port",
            "0",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield
    except BaseException:
        log.flush()
        tail = (workdir / "worker.log").read_text(errors="replace").splitlines()[-30:]
        print("the demo worker's last log lines:", *tail, sep="\n  ", file=sys.stderr)
        raise
    finally:
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()


class CommandFailed(RuntimeError):
    pass


def cli_argv(*args: str, temporal_port: int) -> list[str]:
    """The arguments of ``outbox-bridge ARGS --demo`` against the demo's Temporal server."""
    return [*args, "--demo", "--temporal-address", f"127.0.0.1:{temporal_port}"]


def cli(*args: str, temporal_port: int) -> str:
    """Run ``outbox-bridge ARGS --demo`` against the demo's Temporal server, as the user
    ``oncall``, and return its output; :class:`CommandFailed` carries its error output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "TEMPORAL_"))}
    env.update(LOGNAME="oncall", USER="oncall")  # what a skip records as "by"
    shown = shlex.join(["outbox-bridge", *args, "--demo"])
    done = subprocess.run(
        [sys.executable, "-m", "outbox_bridge", *cli_argv(*args, temporal_port=temporal_port)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise CommandFailed(f"`{shown}` exited with {done.returncode}:\n{done.stderr}{done.stdout}")
    print(f"$ {shown}\n{done.stdout}")
    return done.stdout


async def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            found = await check()
        except Exception as error:  # not up yet: its last error is reported on time-out
            last = error
        else:
            if found:
                return found
        await asyncio.sleep(1)
    raise TimeoutError(f"gave up waiting for {what}" + (f"; last error: {last!r}" if last else ""))


async def workflows(client: Client, query: str) -> list[tuple[str, str]]:
    return [(w.id, w.run_id) async for w in client.list_workflows(query)]


# -- the pictures ---------------------------------------------------------------------------


def ui_url(ui_port: int, path: str, **query: str) -> str:
    base = f"http://127.0.0.1:{ui_port}/namespaces/default/{path}"
    return f"{base}?{urllib.parse.urlencode(query)}" if query else base


async def take(args: argparse.Namespace, workdir: Path) -> list[str]:
    temporal_port, ui_port = free_port(), free_port()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    missing: list[str] = []
    # The browser starts first, while this process has no other thread (it forks).
    browser = Browser(args.chromium, workdir / "profile")
    with contextlib.ExitStack() as stack:
        stack.callback(browser.close)
        stack.enter_context(demo(workdir, temporal_port, ui_port))
        client = await wait_for(
            "the Temporal dev server",
            lambda: Client.connect(f"127.0.0.1:{temporal_port}"),
            timeout=120,
        )

        # The quick start: see ORGANIZATION:7 blocked, skip it, resume it (after the pictures).
        outage = client.get_workflow_handle(OUTAGE_WORKFLOW)

        async def outage_blocked() -> bool:
            return await shard_state(outage) == ShardState.BLOCKED

        await wait_for(f"{OUTAGE_SHARD} to be blocked", outage_blocked, timeout=240)
        run_id = (await outage.describe()).run_id
        page = ui_url(ui_port, f"workflows/{OUTAGE_WORKFLOW}/{run_id}")
        browser.open_showing(page, RUNNING, "blocked on PROJECT_UPDATE")
        browser.screenshot(out / "ui-blocked-shard.png")

        cli(*SKIP, temporal_port=temporal_port)
        # The skip went to the shard's current run, which may be newer than the one photographed.
        run_id = (await outage.describe()).run_id
        page = ui_url(ui_port, f"workflows/{OUTAGE_WORKFLOW}/{run_id}")
        browser.open_showing(page, "skipped by oncall at", SKIP_REASON)
        browser.screenshot(out / "ui-skipped-shard.png")
        query = 'WorkflowType="OutboxShard" AND OutboxState="skipped"'
        browser.open(ui_url(ui_port, "workflows", query=query))
        browser.wait_for_text(OUTAGE_WORKFLOW, "Clear all")
        browser.show_raw_query()
        browser.screenshot(out / "ui-skipped-query.png")

        # A deferred shard, if the demo has deferred one meanwhile.
        deferred = await workflows(client, 'OutboxState="deferred" AND ExecutionStatus="Running"')
        if deferred:
            page = "workflows/{}/{}".format(*deferred[0])
            browser.open_showing(ui_url(ui_port, page), "deferred until")
            browser.screenshot(out / "ui-deferred-shard.png")
        else:
            missing.append("ui-deferred-shard.png: no shard was deferred meanwhile")

        # The shard workflows, with the query shown as typed.
        browser.open(ui_url(ui_port, "workflows", query='WorkflowType="OutboxShard"'))
        browser.wait_for_text("outbox:outbox:", "Clear all")
        browser.show_raw_query()
        browser.screenshot(out / "ui-shard-list.png")

        # A partition workflow and what its drain did (only when the worker runs partitions).
        partitions = sorted(await workflows(client, 'WorkflowType="OutboxPartition"'))
        if partitions:
            partition_id, partition_run = await busiest_partition(client, partitions)
            page = f"workflows/{partition_id}/{partition_run}/user-metadata"
            browser.open_showing(ui_url(ui_port, page), partition_id, "Last round")
            browser.screenshot(out / "ui-partition.png")
        else:
            missing.append("ui-partition.png: this worker runs no OutboxPartition workflow")
        await take_pauses(browser, client, ui_port, out)

        cli(*RESUME, temporal_port=temporal_port)
        cli(*STATUS, temporal_port=temporal_port)
    return missing


async def shard_state(handle: WorkflowHandle[Any, Any]) -> ShardState:
    """The state a shard workflow's ``status`` query reports (blocked, skipped, ...)."""
    status: ShardStatus = await handle.query("status", result_type=ShardStatus)
    return status.state


async def take_pauses(browser: Browser, client: Client, ui_port: int, out: Path) -> None:
    """The table's control workflow, a category paused with its update as from the UI."""
    control = client.get_workflow_handle("outbox:outbox:control")
    run_id = (await wait_for("the control workflow", control.describe, timeout=120)).run_id
    change = PauseChange(category="PROJECT_UPDATE", reason=PAUSE_REASON, by="oncall")
    await control.execute_update("pause", change, result_type=PausesView)
    page = f"workflows/outbox:outbox:control/{run_id}"
    browser.open_showing(ui_url(ui_port, page), "paused: category PROJECT_UPDATE", PAUSE_REASON)
    browser.screenshot(out / "ui-pauses.png")
    await control.execute_update(
        "unpause", PauseChange(category="PROJECT_UPDATE"), result_type=PausesView
    )


async def busiest_partition(client: Client, partitions: list[tuple[str, str]]) -> tuple[str, str]:
    """The partition that handled the most rows, once every partition has reported a drain
    round (until then its details show no round)."""
    timeout = PartitionOptions.round_seconds + 120  # the first round ends a round after start

    async def statuses() -> list[PartitionStatus]:
        found: list[PartitionStatus] = []
        for workflow_id, _ in partitions:
            handle = client.get_workflow_handle(workflow_id)
            found.append(await handle.query("status", result_type=PartitionStatus))
        return found if min(status.rounds for status in found) >= 1 else []

    print(f"waiting for the partitions' first round (up to {timeout:.0f} s)")
    reported = await wait_for("a drain round of every partition", statuses, timeout)
    busiest: PartitionStatus = max(reported, key=lambda status: status.rows_handled)
    run_id = (await client.get_workflow_handle(busiest.partition).describe()).run_id
    return busiest.partition, run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument(
        "--chromium",
        default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium",
        help="the Chromium (or Chrome) executable",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="outbox-screenshots-") as workdir:
        missing = asyncio.run(take(args, Path(workdir)))
    for line in missing:
        print(f"not taken: {line}")


if __name__ == "__main__":
    main()
