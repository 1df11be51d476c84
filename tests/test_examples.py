"""The examples keep working: the FastAPI example serves requests against the test servers.

The example's tables (example_outbox, example_organization, example_project) are used by this
test only.
"""

from __future__ import annotations

import httpx
from pydantic import SecretStr
from sqlalchemy import func, select

from examples.projects import api as example_api
from examples.projects import outbox as example
from tests.harness import fast_settings, running_worker, table_empty


async def test_projects_example_waits_for_its_rows(servers, engine) -> None:
    async with running_worker(servers, example.app, fast_settings(idle_timeout=0)) as settings:
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
