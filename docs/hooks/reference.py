"""mkdocs hook: the settings reference, generated from ``OutboxSettings`` at build time.

``docs/reference/settings.md`` holds the prose; the line ``<!-- settings -->`` in it is replaced
by one section per field of :class:`outbox_bridge.config.OutboxSettings`: its flag, its
environment variable, its default, its allowed values and its description. The sections follow
the model, so a setting added, renamed or changed in the code is documented by the next build.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from outbox_bridge import config
from outbox_bridge.config import OutboxSettings

PLACEHOLDER = "<!-- settings -->"


def env_names(name: str, field: FieldInfo) -> list[str]:
    """The environment variables of a setting, the one that wins first."""
    many = getattr(config, "env_names", None)  # a setting may also read a standard variable
    return list(many(name, field)) if many is not None else [config.env_name(name, field)]


def flag(name: str, field: FieldInfo) -> str:
    option = "--" + name.replace("_", "-")
    if field.annotation is bool:
        return f"`{option}` / `--no-{option[2:]}`"
    return f"`{option}`"


def default(field: FieldInfo) -> str:
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{value}`"


def _number(value: Any) -> str:
    return f"{value:,g}" if isinstance(value, float) else f"{value:,}"


def allowed(field: FieldInfo) -> str:
    """The values a setting accepts, when the model restricts them."""
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(annotation))
    bounds: list[str] = []
    for rule in field.metadata:
        if isinstance(rule, annotated_types.Ge):
            bounds.append(f"≥ {_number(rule.ge)}")
        elif isinstance(rule, annotated_types.Gt):
            bounds.append(f"> {_number(rule.gt)}")
        elif isinstance(rule, annotated_types.Le):
            bounds.append(f"≤ {_number(rule.le)}")
        elif isinstance(rule, annotated_types.Lt):
            bounds.append(f"< {_number(rule.lt)}")
    return ", ".join(bounds)


def settings_markdown() -> str:
    """One section per setting, in the order of the model, each with an anchor of its flag's
    name (``settings.md#sweep-interval``)."""
    sections = []
    for name, field in OutboxSettings.model_fields.items():
        facts = [
            ", else ".join(f"`{env}`" for env in env_names(name, field)),
            f"default {default(field)}",
        ]
        if allowed(field):
            facts.append(f"values {allowed(field)}")
        sections.append(
            f"### {flag(name, field)} {{ #{name.replace('_', '-')} }}\n\n"
            f"{' · '.join(facts)}\n\n{' '.join((field.description or '').split())}\n"
        )
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if PLACEHOLDER in markdown:
        return markdown.replace(PLACEHOLDER, settings_markdown())
    return markdown
