"""The examples keep working: the FastAPI example serves requests against the test servers,
and the Django example's own tests pass against them.

The FastAPI example's tables (example_outbox, example_organization, example_project) are used
by its test only; the Django example's tests create a test database of their own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from pydantic import SecretStr
from sqlalchemy import func, select

from examples.projects import api as example_api
from examples.projects import outbox as example
from tests.django_support import database_settings
from tests.harness import Servers, fast_settings, running_worker, table_empty
from tests.support import clean_env

ROOT = Path(__file__).resolve().parents[1]


async def test_projects_example_waits_for_its_rows(servers, engine) -> None:
    async with running_worker(servers, example.app, fast_settings()) as settings:
        service = example_api.create_api(
            settings.model_copy(
                update={
                    "database_url": SecretStr(servers.database_url),
                    "temporal_address": servers.temporal_address,
                }
            )
        )
        async with service.router.lifespan_context(service):
            transport = httpx.ASGITransport(app=service)
            async with httpx.AsyncClient(transport=transport, base_url="http://example") as http:
                answer = await http.post("/organizations", json={"name": "acme"})
                assert answer.status_code == 201, answer.text
                organization = answer.json()
                shard = f"ORGANIZATION:{organization['id']}"
                assert organization["handled"] is True
                assert organization["shards"] == {shard: "handled"}

                answer = await http.post(
                    f"/organizations/{organization['id']}/projects", json={"name": "apollo"}
                )
                assert answer.status_code == 201, answer.text
                project = answer.json()
                assert project["handled"] is True
                assert project["shards"] == {
                    shard: "handled",
                    f"AUDIT_LOG:{organization['id']}": "handled",
                }

                missing = await http.post("/organizations/0/projects", json={"name": "x"})
                assert missing.status_code == 404

        assert await table_empty(engine, example.app)
        async with engine.connect() as conn:
            names = (await conn.execute(select(example.Project.name))).scalars().all()
            count = (
                await conn.execute(select(func.count()).select_from(example.Organization))
            ).scalar_one()
        assert "apollo" in names and count >= 1


def test_the_django_example_s_own_tests_pass(servers: Servers, tmp_path: Path) -> None:
    """examples/djangoshop's tests: its models and views write rows, its migration creates the
    outbox table, its handlers run in the test (drain_outbox_django), and its requests wait
    for the app's worker on the test database (outbox_worker_django)."""
    database = database_settings(servers)
    env = clean_env(
        PGHOST=database["HOST"],
        PGPORT=database["PORT"],
        PGUSER=database["USER"],
        PGPASSWORD=database["PASSWORD"],
        PGDATABASE="djangoshop",
        OUTBOX_TEST_TEMPORAL_ADDRESS=servers.temporal_address,
    )
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the example's pytest.ini names its own settings
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "examples/djangoshop",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:asyncio",  # no async test there (and its settings would be unset)
            "-W",
            "error",  # like this suite: a warning fails the run
            "--basetemp",
            str(tmp_path / "pytest"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout, result.stdout
