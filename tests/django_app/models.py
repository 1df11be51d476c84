"""Models that write their outbox rows (``OutboxModel``), and one that does not."""

from __future__ import annotations

from typing import Any

from django.db import models

from outbox_bridge.contrib.django.models import OutboxModel
from outbox_bridge.declarations import Operation
from tests.django_app.outbox import app
from tests.harness import Category


class Replicated(OutboxModel):
    __outbox_app__ = app

    class Meta:
        abstract = True


class Organization(Replicated):
    # The scope's own model: its primary key is the shard identifier.
    __outbox_category__ = Category.ORGANIZATION_UPDATE

    name = models.CharField(max_length=200)


class Project(Replicated):
    # organization_id (the foreign key's column) is the shard identifier.
    __outbox_category__ = Category.PROJECT_UPDATE

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE)
    name = models.CharField(max_length=200)

    def outbox_payload(self, operation: Operation) -> Any:
        return {"operation": operation, "name": self.name}


class Note(models.Model):
    """No outbox row: a model change beside the rows."""

    text = models.TextField()
