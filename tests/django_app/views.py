"""Views that write outbox rows, flushed or not."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse

from outbox_bridge.contrib.django.flush import flush_outbox, outbox_context
from outbox_bridge.contrib.django.writes import write_row, write_row_async
from tests.django_app.models import Note, Organization, Project
from tests.django_app.outbox import app
from tests.harness import Category


def write(request: HttpRequest, organization: int) -> HttpResponse:
    """A note and an ORGANIZATION_UPDATE row, in one transaction."""
    with transaction.atomic():
        Note.objects.create(text=f"organization {organization}")
        row_id = write_row(
            app,
            category=Category.ORGANIZATION_UPDATE,
            shard_identifier=organization,
            object_identifier=organization,
        )
    return JsonResponse({"id": row_id})


flushed_write = flush_outbox(write)


def write_and_report(request: HttpRequest, organization: int) -> HttpResponse:
    """A row, flushed, and the flush report as the response."""
    with outbox_context(flush=True) as outbox:
        write(request, organization)
    return JsonResponse(outbox.report.as_dict())


def write_in_the_request_transaction(request: HttpRequest, organization: int) -> HttpResponse:
    """A row in whatever transaction the request runs in (ATOMIC_REQUESTS)."""
    row_id = write_row(
        app,
        category=Category.ORGANIZATION_UPDATE,
        shard_identifier=organization,
        object_identifier=organization,
    )
    return JsonResponse({"id": row_id})


flushed_write_in_the_request_transaction = flush_outbox(timeout=5)(write_in_the_request_transaction)


@flush_outbox
async def async_write(request: HttpRequest, organization: int) -> HttpResponse:
    row_id = await write_row_async(
        app,
        category=Category.ORGANIZATION_UPDATE,
        shard_identifier=organization,
        object_identifier=organization,
    )
    return JsonResponse({"id": row_id})


def create_project(request: HttpRequest, name: str) -> HttpResponse:
    """An organization and its project, saved by the models (two rows, one shard)."""
    with transaction.atomic():
        organization = Organization.objects.create(name=name)
        project = Project.objects.create(organization=organization, name=name)
    return JsonResponse({"organization": organization.pk, "project": project.pk})
