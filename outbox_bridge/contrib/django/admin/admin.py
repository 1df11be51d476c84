"""The outbox in the Django admin: its shards (read only), its pauses and its parked groups, with
the command line's pause, unpause, park and unpark. Who acts is the admin user, recorded as
``django:<username>`` where the command line records its ``--by`` or login name."""

from __future__ import annotations

import logging
from datetime import UTC
from typing import TYPE_CHECKING, Any

from asgiref.sync import async_to_sync
from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from sqlalchemy import Table

from outbox_bridge.config import OutboxSettings
from outbox_bridge.contrib.django.admin import control
from outbox_bridge.contrib.django.admin.forms import (
    ParkForm,
    PauseForm,
    ShardForm,
    UnparkForm,
    UnpauseForm,
)
from outbox_bridge.contrib.django.admin.models import Outbox
from outbox_bridge.contrib.django.conf import outbox_app, outbox_settings
from outbox_bridge.db.parked import ParkedGroup
from outbox_bridge.db.pauses import Pause
from outbox_bridge.errors import OutboxError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.pause_control import member_name
from outbox_bridge.workflows.models import ShardRef

log = logging.getLogger("outbox_bridge.contrib.django.admin")

PAUSE_PERMISSION = "outbox_bridge.pause_outbox"
PARK_PERMISSION = "outbox_bridge.park_outbox"
PER_PAGE = 50


def admin_user(request: HttpRequest) -> str:
    """Who acts, as Django authenticated them (never a name typed into a form)."""
    return f"django:{request.user.get_username()}"


class _Outbox:
    """The app, settings and table one request works on (``?table=``, default the first)."""

    def __init__(self, request: HttpRequest) -> None:
        self.app: OutboxApp = outbox_app()
        self.settings: OutboxSettings = outbox_settings()
        name = request.POST.get("table") or request.GET.get("table") or next(iter(self.app.tables))
        if name not in self.app.tables:
            raise Http404(f"no outbox table {name!r}; the app's tables: {list(self.app.tables)}")
        self.table: Table = self.app.table(name)


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Outbox]
else:
    _ModelAdmin = admin.ModelAdmin


@admin.register(Outbox)
class OutboxAdmin(_ModelAdmin):
    """Custom views in place of the changelist: the outbox tables are not models."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("", view(self.shards_view), name="outbox_bridge_outbox_changelist"),
            path("pauses/", view(self.pauses_view), name="outbox_bridge_outbox_pauses"),
            path("parked/", view(self.parked_view), name="outbox_bridge_outbox_parked"),
            path("park/", view(self.park_view), name="outbox_bridge_outbox_park"),
        ]

    # -- views ----------------------------------------------------------------------------------

    def shards_view(self, request: HttpRequest) -> HttpResponse:
        outbox = self._viewing(request)
        query = request.GET.get("q", "").strip()
        page = _positive(request.GET.get("p"), 1)
        lines: list[control.ShardLine] = []
        if query and not query.lstrip("-").isdigit():
            messages.error(request, f"{query!r} is not a shard identifier: search by its number")
        else:
            lines = (
                self._run(
                    request,
                    control.read_shards,
                    outbox.settings,
                    outbox.app,
                    outbox.table,
                    shard_identifier=int(query) if query else None,
                    offset=(page - 1) * PER_PAGE,
                    limit=PER_PAGE + 1,
                )
                or []
            )
        context = {
            "shards": lines[:PER_PAGE],
            "page": page,
            "has_next": len(lines) > PER_PAGE,
            "query": query,
            "may_park": request.user.has_perm(PARK_PERMISSION),
        }
        return self._render(request, outbox, "shards", "Shards with pending rows", context)

    def pauses_view(self, request: HttpRequest) -> HttpResponse:
        outbox = self._viewing(request)
        form = PauseForm(app=outbox.app)
        if request.method == "POST":
            self._require(request, PAUSE_PERMISSION)
            if "unpause" in request.POST:
                return self._unpause(request, outbox)
            form = PauseForm(request.POST, app=outbox.app)
            if form.is_valid():
                done = self._run(
                    request,
                    control.pause,
                    outbox.settings,
                    outbox.table,
                    form.target(),
                    reason=form.cleaned_data["reason"],
                    by=admin_user(request),
                    end=form.end(),
                )
                if done is not None:
                    name = _member(outbox.app, done)
                    self._done(request, f"{done.kind} {name} paused: {done.reason}")
                    return _back(request)
        pauses = self._run(request, control.read_table_pauses, outbox.settings, outbox.table)
        context = {
            "pauses": [(p, _member(outbox.app, p)) for p in pauses or []],
            "form": form,
            "may_pause": request.user.has_perm(PAUSE_PERMISSION),
        }
        return self._render(request, outbox, "pauses", "Paused categories and scopes", context)

    def _unpause(self, request: HttpRequest, outbox: _Outbox) -> HttpResponse:
        form = UnpauseForm(request.POST)
        if not form.is_valid():
            messages.error(request, f"nothing was unpaused: {_errors(form)}")
            return _back(request)
        done = self._run(request, control.unpause, outbox.settings, outbox.table, form.target())
        kind, number = form.target()
        if done is None:
            messages.warning(request, f"{kind} {number} was not paused")
        else:
            name = _member(outbox.app, done)
            since = done.since.astimezone(UTC)
            self._done(request, f"{kind} {name} resumed (paused since {since:%Y-%m-%d %H:%M} UTC)")
        return _back(request)

    def parked_view(self, request: HttpRequest) -> HttpResponse:
        outbox = self._viewing(request)
        if request.method == "POST":
            self._require(request, PARK_PERMISSION)
            form = UnparkForm(request.POST)
            if not form.is_valid():
                messages.error(request, f"nothing was unparked: {_errors(form)}")
                return _back(request)
            shard = control.shard_ref(outbox.app, outbox.table, *form.shard())
            groups = self._run(
                request,
                control.put_back,
                outbox.settings,
                outbox.app,
                outbox.table,
                shard,
                group=form.group(),
                by=admin_user(request),
            )
            for group in groups or []:
                name = control.group_text(outbox.app, group)
                self._done(request, f"shard {shard.key}: unparked {name}")
            return _back(request)
        groups = self._run(request, control.read_table_parked, outbox.settings, outbox.table)
        context = {
            "groups": [
                (group, _shard_of(outbox, group), control.group_text(outbox.app, group))
                for group in groups or []
            ],
            "may_park": request.user.has_perm(PARK_PERMISSION),
        }
        return self._render(request, outbox, "parked", "Parked groups", context)

    def park_view(self, request: HttpRequest) -> HttpResponse:
        """GET: the reason form for the shard chosen in the list; POST: park its head group."""
        outbox = self._viewing(request)
        self._require(request, PARK_PERMISSION)
        if request.method != "POST":
            chosen = ShardForm(request.GET)
            if not chosen.is_valid():
                raise Http404(f"no such shard: {_errors(chosen)}")
            form = ParkForm(initial=chosen.cleaned_data)
        else:
            form = ParkForm(request.POST)
            if form.is_valid():
                shard = control.shard_ref(outbox.app, outbox.table, *form.shard())
                parked = self._run(
                    request,
                    control.park,
                    outbox.settings,
                    outbox.app,
                    outbox.table,
                    shard,
                    reason=form.cleaned_data["reason"],
                    by=admin_user(request),
                )
                if parked is not None:
                    group = control.group_text(outbox.app, parked)
                    self._done(request, f"shard {shard.key}: parked {group} ({parked.rows} rows)")
                    url = reverse("admin:outbox_bridge_outbox_parked")
                    return HttpResponseRedirect(f"{url}?table={outbox.table.name}")
        return self._render(request, outbox, "park", "Park a shard's head group", {"form": form})

    # -- plumbing -------------------------------------------------------------------------------

    def _viewing(self, request: HttpRequest) -> _Outbox:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return _Outbox(request)

    @staticmethod
    def _require(request: HttpRequest, permission: str) -> None:
        if not request.user.has_perm(permission):
            raise PermissionDenied

    @staticmethod
    def _run(request: HttpRequest, work: Any, *args: Any, **kwargs: Any) -> Any:
        """``work`` (an async function of :mod:`control`); its error as a message, and None."""
        try:
            return async_to_sync(work)(*args, **kwargs)
        except OutboxError as exc:
            messages.error(request, str(exc))
            return None

    def _done(self, request: HttpRequest, what: str) -> None:
        """A change made: in the admin's own history (its user, for the unpause and the unpark
        too, which leave no row), the log and the page."""
        self.log_change(request, Outbox(), what)
        log.info("outbox admin: %s by %s", what, admin_user(request))
        messages.success(request, what)

    def _render(
        self, request: HttpRequest, outbox: _Outbox, page: str, title: str, context: dict[str, Any]
    ) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "title": title,
            "tab": page,
            "table": outbox.table.name,
            "tables": list(outbox.app.tables),
            **context,
        }
        return TemplateResponse(request, f"outbox_bridge/admin/{page}.html", context)


def _member(app: OutboxApp, pause: Pause) -> str:
    return member_name(app, pause.kind, pause.number)


def _shard_of(outbox: _Outbox, group: ParkedGroup) -> ShardRef:
    region, scope, identifier = group.shard
    return control.shard_ref(outbox.app, outbox.table, scope, identifier, region)


def _positive(text: str | None, default: int) -> int:
    return int(text) if text and text.isdigit() and int(text) > 0 else default


def _errors(form: forms.Form) -> str:
    return "; ".join(
        f"{field}: {' '.join(map(str, errors))}" for field, errors in form.errors.items()
    )


def _back(request: HttpRequest) -> HttpResponse:
    """After a change, the page it was made on again (a reload does not repeat it)."""
    return HttpResponseRedirect(request.get_full_path())
