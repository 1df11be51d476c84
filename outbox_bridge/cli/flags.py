"""Command-line flags generated from :class:`OutboxSettings`: every setting is an environment
variable and a flag, documented once; each command offers the flags of the groups it uses."""

from __future__ import annotations

import getpass
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo

from outbox_bridge.config import (
    OutboxSettings,
    SettingGroup,
    env_names,
    setting_group,
    tools_description,
)
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.workflows.inputs import MAX_TEXT

F = TypeVar("F", bound=Callable[..., Any])


def _click_type(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Literal:
        return click.Choice([str(v) for v in typing.get_args(annotation)])
    if typing.get_origin(annotation) is typing.Annotated:
        return _click_type(typing.get_args(annotation)[0])
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) is not list:
        return _click_type(args[0])
    return {int: int, float: float, Path: click.Path(path_type=Path), SecretStr: str}.get(
        annotation, str
    )


def settings_options(*groups: SettingGroup) -> Callable[[F], F]:
    """A decorator that gives a click command one option per setting of ``groups``, described
    as the tools use it; with no group, the worker's: every setting. The values land in
    ``**overrides``."""
    wanted = set(groups) or set(SettingGroup)

    def decorate(fn: F) -> F:
        for name, field in reversed(list(OutboxSettings.model_fields.items())):
            if setting_group(field) in wanted:
                description = tools_description(field) if groups else field.description
                fn = _option(name, field, description or "")(fn)
        return fn

    return decorate


ENVIRONMENT_EPILOG = (
    "The other settings (TLS, API key, Temporal's configuration file, the embedded servers' "
    "ports, ...) come from the environment, as the worker's do: see `outbox-bridge worker "
    "--help`."
)


def tool_command(name: str) -> Callable[[Callable[..., Any]], click.Command]:
    """A command of the command line other than the worker (its help ends with the
    :data:`ENVIRONMENT_EPILOG`)."""
    return click.command(
        name,
        epilog=ENVIRONMENT_EPILOG,
        context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    )


# The options several tools share.
table_option = click.option("--table", help="The outbox table (default: the app's first).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def shard_options(*groups: SettingGroup) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """SHARD, --table, and the settings of ``groups`` (Temporal and the app when none given)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = click.argument("shard")(table_option(fn))
        return settings_options(*(groups or (SettingGroup.TEMPORAL, SettingGroup.APP)))(fn)

    return decorate


def required_reason(reason: str, what: str) -> str:
    """``reason`` stripped; refused when blank (a ``what`` needs a reason) or longer than the
    workflows show (:data:`MAX_TEXT` characters)."""
    if not reason.strip():
        raise click.BadParameter(f"a {what} needs a reason", param_hint="--reason")
    if len(reason.strip()) > MAX_TEXT:
        raise click.BadParameter(
            f"{len(reason.strip()):,} characters; a {what}'s reason has at most {MAX_TEXT:,}",
            param_hint="--reason",
        )
    return reason.strip()


def who(by: str | None = None) -> str:
    """Who does it, for the record: ``by``, else the user running the command."""
    return (by or "").strip() or getpass.getuser()


def _option(name: str, field: FieldInfo, description: str) -> Callable[[F], F]:
    flag = "--" + name.replace("_", "-")
    env = ", else ".join(env_names(name, field))
    default = field.default
    hidden = default is None or default is False or name == "database_url"
    shown = "" if hidden else f" [default: {default}]"
    help_text = f"{description}{shown} [env: {env}]"
    if field.annotation is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)
    return click.option(
        flag,
        name,
        type=_click_type(field.annotation),
        default=None,
        help=help_text,
        metavar=name.upper().split("_")[-1],
    )


def _where(location: tuple[int | str, ...]) -> str:
    """The setting an error is about; a setting read from several variables names them all."""
    for name, field in OutboxSettings.model_fields.items():
        names = env_names(name, field)
        if len(names) > 1 and location[:1] == (names[0],):
            return " or ".join(names)
    return ".".join(str(part) for part in location) or "settings"


def build_settings(overrides: Mapping[str, Any]) -> OutboxSettings:
    """Settings from the environment, with the flags that were given taking precedence."""
    fields = OutboxSettings.model_fields
    given = {k: v for k, v in overrides.items() if v is not None and k in fields}
    try:
        return OutboxSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigurationError(f"invalid settings: {problems}") from None
