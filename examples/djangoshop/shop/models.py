"""Organizations and their projects write their outbox rows when they are saved or deleted
(``OutboxModel``): the search index follows them through the handlers. Invitations are rows the
invitation view writes itself. ``SearchEntry`` is the read model the handlers maintain."""

from __future__ import annotations

from typing import Any

from django.db import models

from examples.djangoshop.shop.outbox import Category, app
from outbox_bridge.contrib.django.models import OutboxModel


class Replicated(OutboxModel):
    __outbox_app__ = app

    class Meta:
        abstract = True


class Organization(Replicated):
    # The scope's own model: its id is the shard identifier.
    __outbox_category__ = Category.ORGANIZATION_UPDATE

    name = models.CharField(max_length=200)


class Project(Replicated):
    # organization_id is the shard identifier: an organization's changes are handled in order.
    __outbox_category__ = Category.PROJECT_UPDATE

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE)
    name = models.CharField(max_length=200)

    def outbox_payload(self, operation: str) -> Any:
        # Rows coalesce: the handler reads the current state; the payload says what happened.
        return {"operation": operation}


class Invitation(models.Model):
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE)
    email = models.EmailField()
    sent_at = models.DateTimeField(null=True)


class SearchEntry(models.Model):
    """What the search finds: kept up to date by the outbox handlers, never by the views."""

    kind = models.CharField(max_length=20)
    object_id = models.BigIntegerField()
    title = models.CharField(max_length=200)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "object_id"], name="one_entry")]
