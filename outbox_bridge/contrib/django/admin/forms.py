"""The forms of the outbox admin's actions. Names resolve and pauses end as on the command
line (``member_number``, ``timed_end``): the same errors, shown on the form."""

from __future__ import annotations

from typing import Any

from django import forms

from outbox_bridge.db.pauses import PauseEnd
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.pause_control import member_number, timed_end
from outbox_bridge.workflows.inputs import MAX_TEXT
from outbox_bridge.workflows.models import PauseKind

KINDS = [(kind.value, kind.value) for kind in PauseKind]


def _integer(bits: int, *, hidden: bool = True) -> forms.IntegerField:
    """An integer of the column's size (a value PostgreSQL would refuse is a form error)."""
    high = 2 ** (bits - 1) - 1
    widget = forms.HiddenInput if hidden else forms.NumberInput
    return forms.IntegerField(min_value=-high - 1, max_value=high, widget=widget)


class PauseForm(forms.Form):
    kind = forms.ChoiceField(choices=KINDS)
    name = forms.CharField(max_length=200, help_text="A name in the app, or a number.")
    reason = forms.CharField(max_length=MAX_TEXT, help_text="Why: shown with the pause.")
    duration = forms.DurationField(
        required=False,
        help_text="Ends by itself after this long (blank: when unpaused): 30:00 for 30 "
        "minutes, 2:00:00, '1 00:00:00' for a day, or ISO 8601 (PT30M); at most 366 days.",
    )

    def __init__(self, *args: Any, app: OutboxApp, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = app

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        kind, name, duration = data.get("kind"), data.get("name"), data.get("duration")
        if kind is not None and name is not None:
            try:
                data["number"] = member_number(
                    self.app, PauseKind(kind), name, "the app of OUTBOX_BRIDGE['APP']"
                )
            except ConfigurationError as exc:
                self.add_error("name", str(exc))
        try:
            data["end"] = timed_end(None if duration is None else duration.total_seconds(), None)
        except ConfigurationError as exc:
            self.add_error(
                "duration",
                f"give a duration over 0 and of at most 366 days, such as 30:00 or 2:00:00 "
                f"(got {duration}; {exc})",
            )
        return data

    def target(self) -> tuple[PauseKind, int]:
        return PauseKind(self.cleaned_data["kind"]), self.cleaned_data["number"]

    def end(self) -> PauseEnd | None:
        end: PauseEnd | None = self.cleaned_data["end"]
        return end


class UnpauseForm(forms.Form):
    kind = forms.ChoiceField(choices=KINDS)
    number = _integer(32, hidden=False)

    def target(self) -> tuple[PauseKind, int]:
        return PauseKind(self.cleaned_data["kind"]), self.cleaned_data["number"]


class ShardForm(forms.Form):
    """A shard of the table: its scope's number, identifier and region (regional tables)."""

    scope = _integer(32)
    shard_identifier = _integer(64)
    region = forms.CharField(widget=forms.HiddenInput, required=False, max_length=200)

    def shard(self) -> tuple[int, int, str | None]:
        data = self.cleaned_data
        return data["scope"], data["shard_identifier"], data["region"] or None


class ParkForm(ShardForm):
    reason = forms.CharField(max_length=MAX_TEXT, help_text="Why it is set aside (kept, listed).")


class UnparkForm(ShardForm):
    category = _integer(32)
    object_identifier = _integer(64)

    def group(self) -> tuple[int, int]:
        return self.cleaned_data["category"], self.cleaned_data["object_identifier"]
