"""An application's scopes held in a variable of its own enums: `mypy --strict` over the tree
(``test_mypy_strict_finds_nothing``) checks that ``OutboxApp`` accepts them, as a team's code
would write them. Imported by nothing."""

from __future__ import annotations

from enum import IntEnum

from outbox_bridge import OutboxApp


class Scope(IntEnum):
    ORGANIZATION = 1


class Category(IntEnum):
    PROJECT_UPDATE = 2


SCOPES = {Scope.ORGANIZATION: {Category.PROJECT_UPDATE}}
app = OutboxApp(scopes=SCOPES, categories=[Category])
