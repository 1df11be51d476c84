"""The example's JSON API. Creating an organization or a project saves a model, which writes
its outbox row; inviting someone writes a row with ``write_row``. Each request waits until the
worker has handled its rows, so that the search finds what the request created at once."""

from __future__ import annotations

import json
from typing import Any

from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET, require_POST

from examples.djangoshop.shop.models import Invitation, Organization, Project, SearchEntry
from examples.djangoshop.shop.outbox import Category, app
from outbox_bridge.contrib.django.flush import OutboxContext, flush_outbox, outbox_context
from outbox_bridge.contrib.django.writes import write_row


def _body(request: HttpRequest) -> dict[str, Any]:
    data = json.loads(request.body or b"{}")
    return data if isinstance(data, dict) else {}


def _created(new_id: int, outbox: OutboxContext) -> JsonResponse:
    return JsonResponse(
        {
            "id": new_id,
            "handled": outbox.report.handled,
            "shards": {result.shard: result.outcome for result in outbox.report},
        },
        status=201,
    )


@require_POST
def create_organization(request: HttpRequest) -> HttpResponse:
    with outbox_context(flush=True) as outbox:
        with transaction.atomic():
            organization = Organization.objects.create(name=_body(request)["name"])
    return _created(organization.pk, outbox)


@require_POST
def create_project(request: HttpRequest, organization: int) -> HttpResponse:
    with outbox_context(flush=True) as outbox:
        with transaction.atomic():
            owner = Organization.objects.filter(pk=organization).first()
            if owner is None:
                raise Http404("no such organization")
            project = Project.objects.create(organization=owner, name=_body(request)["name"])
    return _created(project.pk, outbox)


@require_POST
@flush_outbox  # the same wait, around the whole view; the report goes on the response
def invite(request: HttpRequest, organization: int) -> HttpResponse:
    with transaction.atomic():
        if not Organization.objects.filter(pk=organization).exists():
            raise Http404("no such organization")
        invitation = Invitation.objects.create(
            organization_id=organization, email=_body(request)["email"]
        )
        # An event rather than a model change: one row per invitation (its own object
        # identifier, so that no invitation coalesces with another).
        write_row(
            app,
            category=Category.INVITATION,
            shard_identifier=organization,
            object_identifier=invitation.pk,
        )
    return JsonResponse({"id": invitation.pk}, status=201)


@require_GET
def search(request: HttpRequest) -> HttpResponse:
    query = request.GET.get("q", "")
    entries = SearchEntry.objects.filter(title__icontains=query).order_by("kind", "object_id")
    return JsonResponse(
        {"results": [{"kind": e.kind, "id": e.object_id, "title": e.title} for e in entries]}
    )
