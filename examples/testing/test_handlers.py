"""The handler, without Temporal: drain_outbox runs it in the test, as the worker would."""

from __future__ import annotations

import pytest
from catalog import Product, SearchIndex, app
from sqlalchemy.orm import Session

from outbox_bridge.testing import HandlerFailedError, OutboxDatabase, drain_outbox, outbox_runner


def test_a_saved_product_is_indexed(outbox_database: OutboxDatabase, index: SearchIndex) -> None:
    with Session(outbox_database.engine) as session:
        session.add(Product(id=1, catalog_id=7, name="kettle", price=30))
        report = drain_outbox(app, session)  # flushes the session, drains in its transaction

    assert index.products == {1: {"name": "kettle", "price": 30}}
    assert report.handled == 1


def test_changes_coalesce_and_a_deletion_removes(
    outbox_database: OutboxDatabase, index: SearchIndex
) -> None:
    with Session(outbox_database.engine) as session:
        kettle = Product(id=1, catalog_id=7, name="kettle", price=30)
        session.add(kettle)
        session.flush()
        kettle.price = 25
        session.flush()
        kettle.price = 20
        report = drain_outbox(app, session)
        # Three rows for the kettle, one handler call with the newest.
        assert index.products == {1: {"name": "kettle", "price": 20}}
        assert (report.handled, report.coalesced) == (1, 2)

        session.delete(kettle)
        drain_outbox(app, session)
        assert index.products == {}


def test_the_block_drains_when_it_ends(outbox_database: OutboxDatabase, index: SearchIndex) -> None:
    with Session(outbox_database.engine) as session:
        with outbox_runner(app, session):
            session.add(Product(id=2, catalog_id=7, name="teapot", price=40))
            assert index.products == {}  # nothing runs before the block ends
        assert index.products == {2: {"name": "teapot", "price": 40}}


def test_an_unavailable_index_fails_the_test_with_the_row(
    outbox_database: OutboxDatabase, index: SearchIndex
) -> None:
    index.available = False
    with Session(outbox_database.engine) as session:
        session.add(Product(id=3, catalog_id=7, name="mug", price=8))
        with pytest.raises(HandlerFailedError) as raised:
            drain_outbox(app, session)

        # The handler's exception is the cause: the traceback goes into the handler.
        assert isinstance(raised.value.__cause__, ConnectionError)
        assert raised.value.failure.message.object_identifier == 3
        assert raised.value.failure.shard == "CATALOG:7"

        # Or collect the failures, and look at them afterwards.
        report = drain_outbox(app, session, raise_on_failure=False)
        assert [failure.message.object_identifier for failure in report.failures] == [3]
