"""The real path: the product's row is committed, the worker's bridge sees it, a Temporal
workflow drains its shard, the handler indexes the product."""

from __future__ import annotations

from catalog import Product, SearchIndex
from sqlalchemy.orm import Session

from outbox_bridge.testing import OutboxDatabase, OutboxWorker


def test_the_worker_indexes_a_saved_product(
    outbox_worker: OutboxWorker, outbox_database: OutboxDatabase, index: SearchIndex
) -> None:
    with Session(outbox_database.engine) as session, session.begin():
        session.add(Product(id=1, catalog_id=7, name="kettle", price=30))

    outbox_worker.wait_handled("CATALOG:7", timeout=30)
    assert index.products == {1: {"name": "kettle", "price": 30}}
