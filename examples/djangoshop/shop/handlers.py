"""The handlers, run by the worker (``manage.py outbox_worker``). They are plain functions that
use the ORM: each runs in one of the worker's handler threads, with its own connection, which
the command keeps usable between calls. Delivery is at least once: every handler is idempotent.
"""

from __future__ import annotations

import logging

from django.utils import timezone

from examples.djangoshop.shop.models import Invitation, Organization, Project, SearchEntry
from examples.djangoshop.shop.outbox import Category, app
from outbox_bridge import OutboxMessage

log = logging.getLogger("examples.djangoshop")


@app.handler(Category.ORGANIZATION_UPDATE, Category.PROJECT_UPDATE)
def index(message: OutboxMessage) -> None:
    """Index the object as it is now (rows coalesce: a burst of saves is indexed once)."""
    model = Organization if message.category == Category.ORGANIZATION_UPDATE else Project
    kind = model.__name__.lower()
    found = model.objects.filter(pk=message.object_identifier).first()
    if found is None:  # deleted since
        SearchEntry.objects.filter(kind=kind, object_id=message.object_identifier).delete()
        return
    SearchEntry.objects.update_or_create(
        kind=kind, object_id=message.object_identifier, defaults={"title": found.name}
    )


@app.handler(Category.INVITATION)
def send_invitation(message: OutboxMessage) -> None:
    """Send the invitation's e-mail once (here: log it and record when)."""
    invitation = Invitation.objects.filter(pk=message.object_identifier, sent_at=None).first()
    if invitation is None:  # sent already, or withdrawn
        return
    log.info("inviting %s to organization %d", invitation.email, message.shard_identifier)
    Invitation.objects.filter(pk=invitation.pk).update(sent_at=timezone.now())
