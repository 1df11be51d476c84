from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from tests.harness import Servers, connect_client, new_engine, start_servers


@pytest.fixture(scope="session")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Servers]:
    started = await start_servers(tmp_path_factory.mktemp("servers"))
    try:
        yield started
    finally:
        started.temporal.stop()
        if started.postgres is not None:
            started.postgres.stop()


@pytest.fixture(scope="session")
async def engine(servers: Servers) -> AsyncIterator[AsyncEngine]:
    eng = new_engine(servers)
    yield eng
    await eng.dispose()


@pytest.fixture(scope="session")
async def client(servers: Servers) -> Client:
    return await connect_client(servers)
