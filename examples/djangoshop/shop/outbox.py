"""The example's outbox: one scope, ORGANIZATION, so that an organization's changes are handled
in order; its categories; and the app, which ``OUTBOX_BRIDGE["APP"]`` names. The handlers are in
``handlers.py``, registered when Django is set up (``ShopConfig.ready``)."""

from __future__ import annotations

from enum import IntEnum

from outbox_bridge import OutboxApp, OutboxTable


class Scope(IntEnum):
    ORGANIZATION = 1


class Category(IntEnum):
    ORGANIZATION_UPDATE = 1  # written by Organization saves and deletes
    PROJECT_UPDATE = 2  # written by Project saves and deletes
    INVITATION = 3  # written by the invitation view: send the e-mail


app = OutboxApp(
    scopes={
        Scope.ORGANIZATION: {
            Category.ORGANIZATION_UPDATE,
            Category.PROJECT_UPDATE,
            Category.INVITATION,
        }
    },
    categories=[Category],
    tables=[OutboxTable("shop_outbox")],
)
