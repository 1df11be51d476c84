"""The catalog's fixtures, on top of outbox-bridge's pytest plugin."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from catalog import Base, SearchIndex, app, search_index
from sqlalchemy import MetaData


@pytest.fixture(scope="session")
def outbox_metadata() -> list[MetaData]:
    """Every test database gets the outbox table and the catalog's own tables."""
    return [app.metadata, Base.metadata]


@pytest.fixture(autouse=True)
def index() -> Iterator[SearchIndex]:
    """The search service, empty and available at the start of each test."""
    search_index.clear()
    yield search_index
    search_index.clear()
