"""A team adds the outbox to its existing Temporal worker by following the plugin page alone.

The page's program runs as written, in a project of its own: only the addresses it hard-codes
point at the test's servers, and the settings it leaves out come from the environment, as the
page says. Its rows are handled beside the team's own workflow, and SIGTERM stops it cleanly.
"""

from __future__ import annotations

import re
import signal
import uuid
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from tests.harness import Servers, unique_table, wait_until
from tests.sample_app import CALLS_DDL, CALLS_TABLE, SampleCategory, SampleScope
from tests.support import ROOT, clean_env, run_cli, worker_process

PAGE = ROOT / "docs" / "how-to" / "plugin.md"

# The modules the page imports from the team's project.
OUTBOX_MODULE = "from tests.sample_app import app  # handlers record their calls\n"
ORDERS_MODULE = """
from datetime import timedelta

from temporalio import activity, workflow


@activity.defn
async def charge(order: int) -> str:
    return f"charged {order}"


@workflow.defn
class OrderWorkflow:
    @workflow.run
    async def run(self, order: int) -> str:
        return await workflow.execute_activity(
            charge, order, start_to_close_timeout=timedelta(seconds=30)
        )
"""


def page_program() -> str:
    """The page's first Python block: the program a reader copies."""
    found = re.search(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    assert found, f"{PAGE} has no Python block"
    return found.group(1)


def write_project(folder: Path, servers: Servers) -> Path:
    program = page_program()
    for written, actual in [
        ('"temporal:7233"', repr(servers.temporal_address)),
        ('"postgresql://app:secret@db/app"', repr(servers.database_url)),
    ]:
        assert written in program, f"the page's program no longer has {written}"
        program = program.replace(written, actual)
    package = folder / "myapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "outbox.py").write_text(OUTBOX_MODULE)
    (package / "orders.py").write_text(ORDERS_MODULE)
    (folder / "main.py").write_text(program)
    # Not part of the project: the outbox's log lines on stderr, for a failure's message.
    (folder / "sitecustomize.py").write_text("import logging\nlogging.basicConfig()\n")
    return folder / "main.py"


async def handled(engine: AsyncEngine, table: str) -> int:
    async with engine.connect() as conn:
        found = await conn.execute(
            text(f"SELECT count(*) FROM {CALLS_TABLE} WHERE outbox_table = :t"), {"t": table}
        )
        return int(found.scalar_one())


async def table_exists(engine: AsyncEngine, table: str) -> bool:
    async with engine.connect() as conn:
        found = await conn.execute(text("SELECT to_regclass(:t) IS NOT NULL"), {"t": table})
        return bool(found.scalar_one())


async def test_the_plugin_page_program_runs_the_outbox_in_the_teams_worker(
    servers: Servers, engine: AsyncEngine, client: Client, tmp_path: Path
) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"), {"k": CALLS_TABLE}
        )
        await conn.execute(text(CALLS_DDL))
    table = unique_table()
    main = write_project(tmp_path, servers)
    env = clean_env(
        PYTHONPATH=f"{tmp_path}:{ROOT}",
        SAMPLE_OUTBOX_TABLE=table,
        OUTBOX_DATABASE_URL=servers.database_url,  # where the sample handlers record calls
        OUTBOX_TASK_QUEUE=f"outbox-docs-{uuid.uuid4().hex[:8]}",
    )
    # As the page says: the tables first, by their owner; the plugin only checks them.
    init = await run_cli("init-db", env={**env, "OUTBOX_APP": "tests.sample_app:app"})
    assert init.code == 0, init.output
    assert await table_exists(engine, table)
    async with worker_process(
        env=env, script=str(main), cwd=tmp_path, ready=lambda _: True, what="the program"
    ) as worker:
        rows = [(SampleScope.ORGANIZATION, 5, SampleCategory.PROJECT_UPDATE, n) for n in (1, 2)]
        rows.append((SampleScope.USER, 9, SampleCategory.USER_UPDATE, 3))
        async with engine.begin() as conn:
            for scope, shard, category, obj in rows:
                await conn.execute(
                    text(
                        f"INSERT INTO {table} (shard_scope, shard_identifier, category, "
                        "object_identifier) VALUES (:scope, :shard, :category, :obj)"
                    ),
                    {"scope": int(scope), "shard": shard, "category": int(category), "obj": obj},
                )
        # The team's own workflow runs on its queue, beside the outbox.
        result = await client.execute_workflow(
            "OrderWorkflow", 7, id=f"order-{uuid.uuid4().hex[:8]}", task_queue="orders"
        )
        assert result == "charged 7"
        await wait_until(
            lambda: _all_handled(engine, table, len(rows)),
            timeout=120,
            what=f"the rows handled\n{worker}",
        )
        worker.proc.send_signal(signal.SIGTERM)
        code = await worker.finish(timeout=60)
    assert code == 0, str(worker)
    assert "Traceback" not in worker.stderr, str(worker)


async def _all_handled(engine: AsyncEngine, table: str, rows: int) -> bool:
    return await handled(engine, table) == rows
