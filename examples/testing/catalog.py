"""A catalog service's outbox: saving a product indexes it in the search service.

Saving or deleting a ``Product`` writes its outbox row in the same flush (``OutboxModel``). The
row's shard is the product's catalog, so the changes of one catalog are indexed in order; its
payload carries what the index shows. ``search_index`` stands for the search service's client:
the tests look into it, and make it fail.

The tests beside this module are the project's own: ``pytest`` in this folder runs them (see
examples/README.md).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from sqlalchemy import BigInteger, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox_bridge import OutboxApp, OutboxMessage, OutboxModel, OutboxTable


class Scope(IntEnum):
    CATALOG = 1


class Category(IntEnum):
    PRODUCT_UPDATE = 1


app = OutboxApp(
    scopes={Scope.CATALOG: {Category.PRODUCT_UPDATE}},
    categories=[Category],
    tables=[OutboxTable("catalog_outbox")],
)


class Base(DeclarativeBase):
    pass


class Product(OutboxModel, Base):
    __tablename__ = "catalog_product"
    __outbox_app__ = app
    __outbox_category__ = Category.PRODUCT_UPDATE  # shard: catalog_id, object: id

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    catalog_id: Mapped[int] = mapped_column(BigInteger)
    name: Mapped[str] = mapped_column(String(200))
    price: Mapped[int] = mapped_column(Integer)

    def outbox_payload(self, operation: str) -> Any:
        if operation == "delete":
            return None
        return {"name": self.name, "price": self.price}


class SearchIndex:
    """The search service, as the handler sees it."""

    def __init__(self) -> None:
        self.products: dict[int, dict[str, Any]] = {}
        self.available = True

    def put(self, product_id: int, document: dict[str, Any]) -> None:
        self._check()
        self.products[product_id] = document

    def remove(self, product_id: int) -> None:
        self._check()
        self.products.pop(product_id, None)

    def clear(self) -> None:
        self.products.clear()
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise ConnectionError("the search service is unavailable")


search_index = SearchIndex()


@app.handler(Category.PRODUCT_UPDATE)
def index_product(message: OutboxMessage) -> None:
    # Rows coalesce: the newest row of a product carries its current state (None: deleted).
    if message.payload is None:
        search_index.remove(message.object_identifier)
    else:
        search_index.put(message.object_identifier, message.payload)
