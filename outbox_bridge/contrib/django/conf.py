"""outbox-bridge's settings in a Django project: the ``OUTBOX_BRIDGE`` dict (see the Django
page), then the environment, and the outbox's ``DATABASES`` entry for the database URL. Reads
settings only: it connects to nothing and loads nothing of the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.utils.connection import ConnectionDoesNotExist
from pydantic import ValidationError
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from outbox_bridge import registry
from outbox_bridge.config import SECRET_QUERY_PARAMETERS, OutboxSettings, safe_url
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp

SETTING = "OUTBOX_BRIDGE"
# Keys of OUTBOX_BRIDGE that are not OutboxSettings fields.
DATABASE_KEY = "DATABASE"
FLUSH_TIMEOUT_KEY = "FLUSH_TIMEOUT"
DJANGO_KEYS = frozenset({DATABASE_KEY, FLUSH_TIMEOUT_KEY})

# OPTIONS of a DATABASES entry that Django's PostgreSQL backend reads itself; every other
# option is a libpq connection parameter (sslmode, sslrootcert, options, service, ...).
DJANGO_ONLY_OPTIONS = frozenset(
    """assume_role context cursor_factory isolation_level pool prepare_threshold
    server_side_binding""".split()
)


class OutboxConfigurationError(ConfigurationError, ImproperlyConfigured):
    """``OUTBOX_BRIDGE`` or a ``DATABASES`` entry does not fit: both outbox-bridge's
    :class:`~outbox_bridge.ConfigurationError` and Django's ``ImproperlyConfigured``."""


class MaskedURL(str):
    """A URL of ``OUTBOX_BRIDGE`` whose ``repr``, what Django's DEBUG error pages and
    ``SafeExceptionReporterFilter.get_safe_settings()`` show of a value, masks its password
    and secret query parameters; as text (``str()``, formatting, a connection) it is the URL
    itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(safe_url(make_url(str(self))))


def _holds_a_password(value: object) -> bool:
    if not isinstance(value, str) or isinstance(value, MaskedURL) or "://" not in value:
        return False
    try:
        url = make_url(value)
    except (ArgumentError, ValueError):
        return False
    secret_query = any(key.lower() in SECRET_QUERY_PARAMETERS for key in url.query)
    return url.password is not None or secret_query


def mask_urls_in_error_pages() -> int:
    """Wrap every URL of ``OUTBOX_BRIDGE`` that holds a password in :class:`MaskedURL`, in
    place (Django's error pages hide only the keys that look secret, and ``DATABASE_URL``
    does not); returns how many. A mapping that cannot be changed is left as it is."""
    given = getattr(django_settings, SETTING, None)
    if not isinstance(given, dict):
        return 0
    masked = [key for key, value in given.items() if _holds_a_password(value)]
    for key in masked:
        given[key] = MaskedURL(given[key])
    return len(masked)


def bridge_settings() -> dict[str, Any]:
    """The ``OUTBOX_BRIDGE`` dict, its keys in upper case, checked."""
    given = getattr(django_settings, SETTING, {})
    if not isinstance(given, Mapping):
        raise OutboxConfigurationError(f"{SETTING} must be a dict, got {type(given).__name__}")
    known = {name.upper() for name in OutboxSettings.model_fields} | DJANGO_KEYS
    values: dict[str, Any] = {}
    for key, value in given.items():
        name = str(key).upper()
        if name not in known:
            raise OutboxConfigurationError(
                f"{SETTING} has an unknown key {key!r}; the keys are APP, DATABASE, "
                "FLUSH_TIMEOUT and the OutboxSettings fields (TASK_QUEUE, TEMPORAL_ADDRESS, "
                "...; see the settings reference)"
            )
        if name in values:
            raise OutboxConfigurationError(f"{SETTING} gives {name} twice")
        values[name] = str(value) if isinstance(value, MaskedURL) else value
    return values


def outbox_database(using: str | None = None) -> str:
    """The alias of the outbox's database: ``using``, else ``OUTBOX_BRIDGE["DATABASE"]``,
    else ``"default"``."""
    alias = using or bridge_settings().get(DATABASE_KEY) or DEFAULT_DB_ALIAS
    if not isinstance(alias, str):
        raise OutboxConfigurationError(f"{SETTING}['DATABASE'] must be a DATABASES alias")
    return alias


def database_url(using: str | None = None) -> str:
    """The SQLAlchemy URL (``postgresql+psycopg://``) of a ``DATABASES`` entry: ``using``, or
    :func:`outbox_database`. It holds the password: show it only through
    :func:`outbox_bridge.config.safe_url`.

    The entry as the connection sees it: in a test, the test database. ``OPTIONS`` that only
    Django reads (``isolation_level``, ``pool``, ``assume_role``, ...) are left out; the others
    are libpq connection parameters and go into the URL's query.
    """
    alias = outbox_database(using)
    entry = _postgresql_entry(alias)
    query = _libpq_options(entry.get("OPTIONS") or {})
    host, port = _host_and_port(entry, query)
    user, password = _user_and_password(entry, query)
    name = entry.get("NAME")
    if name is None and "service" not in query:
        name = "postgres"  # as Django does: NAME None connects to the 'postgres' database
    try:
        url = URL.create(
            "postgresql+psycopg",
            username=user,
            password=password,
            host=host,
            port=int(port) if port is not None else None,
            database=name or None,
            query=query,
        )
    except ValueError:
        raise OutboxConfigurationError(
            f"DATABASES[{alias!r}]['PORT'] must be a port number, got {port!r}"
        ) from None
    return url.render_as_string(hide_password=False)


def _postgresql_entry(alias: str) -> dict[str, Any]:
    """The ``DATABASES`` entry of ``alias`` as its connection sees it; it must be PostgreSQL."""
    try:
        connection = connections[alias]
    except ConnectionDoesNotExist:
        raise OutboxConfigurationError(f"DATABASES has no alias {alias!r}") from None
    if connection.vendor != "postgresql":
        raise OutboxConfigurationError(
            f"DATABASES[{alias!r}] is a {connection.vendor} database; outbox-bridge needs "
            "PostgreSQL"
        )
    entry: dict[str, Any] = connection.settings_dict
    return entry


def _libpq_options(options: dict[str, Any]) -> dict[str, str]:
    """The ``OPTIONS`` that are libpq connection parameters, as text."""
    return {
        str(key): str(value)
        for key, value in options.items()
        if key not in DJANGO_ONLY_OPTIONS
        and isinstance(value, str | int)
        and not isinstance(value, bool)
    }


def _host_and_port(entry: dict[str, Any], query: dict[str, str]) -> tuple[str | None, str | None]:
    """The URL's host and port; moved into ``query`` when the URL cannot hold them."""
    host = str(entry.get("HOST") or "") or None
    port = str(entry.get("PORT") or "") or None
    if host is not None and (host.startswith("/") or "," in host):
        # A socket directory, or several hosts: libpq's own syntax, in the query.
        query["host"] = host
        if port is not None:
            query["port"] = port
        return None, None
    return host, port


def _user_and_password(entry: dict[str, Any], query: dict[str, str]) -> tuple[Any, Any]:
    """The URL's user and password; a password without a user goes into ``query``."""
    user = entry.get("USER") or None
    password = entry.get("PASSWORD") or None
    if password is not None and user is None:
        # A URL holds a password only after a user name: libpq's parameter, in the query.
        query["password"] = str(password)
        password = None
    return user, password


def flush_timeout(default: float) -> float:
    """``OUTBOX_BRIDGE["FLUSH_TIMEOUT"]`` (seconds), else ``default``."""
    value = bridge_settings().get(FLUSH_TIMEOUT_KEY, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise OutboxConfigurationError(
            f"{SETTING}['FLUSH_TIMEOUT'] must be a number of seconds in (0, 3600], got {value!r}"
        )
    return float(value)


def outbox_settings(*, using: str | None = None) -> OutboxSettings:
    """:class:`~outbox_bridge.OutboxSettings` from ``OUTBOX_BRIDGE``, the environment for
    what it does not give, and the ``DATABASES`` entry of ``using`` (default: the outbox's
    database) for the database URL."""
    config = bridge_settings()
    values = {key.lower(): value for key, value in config.items() if key not in DJANGO_KEYS}
    if "database_url" in values:
        if using is not None or DATABASE_KEY in config:
            raise OutboxConfigurationError(
                f"{SETTING} gives both DATABASE_URL and a DATABASES alias; give one"
            )
    else:
        values["database_url"] = database_url(using)
    try:
        return OutboxSettings(**values)
    except ValidationError as exc:
        # The messages only: a value given (an API key) is never repeated.
        problems = "; ".join(
            f"{SETTING}[{'.'.join(str(part) for part in e['loc']).upper()!r}]: {e['msg']}"
            for e in exc.errors()
        )
        raise OutboxConfigurationError(f"invalid outbox-bridge settings: {problems}") from None


def load_app(spec: str) -> OutboxApp:
    """The :class:`~outbox_bridge.OutboxApp` that ``spec`` names: ``module:attribute`` (as for
    ``OUTBOX_APP``), or a dotted path."""
    return registry.load_app(
        spec, given_as=f"{SETTING}['APP']", error=OutboxConfigurationError, dotted=True
    )


def app_spec() -> str | None:
    """Where the app is: ``OUTBOX_BRIDGE["APP"]``, else ``OUTBOX_APP``, else None."""
    given = bridge_settings().get("APP")
    if given is not None:
        if not isinstance(given, str):
            raise OutboxConfigurationError(f"{SETTING}['APP'] must be a string")
        return given
    nothing_given: dict[str, Any] = {}
    try:
        return OutboxSettings(**nothing_given).app  # from the environment
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise OutboxConfigurationError(
            f"invalid outbox-bridge settings: {problem['loc']}: {problem['msg']}"
        ) from None


def outbox_app() -> OutboxApp:
    """The app that ``OUTBOX_BRIDGE["APP"]`` (else ``OUTBOX_APP``) names."""
    spec = app_spec()
    if spec is None:
        raise OutboxConfigurationError(
            f"no OutboxApp configured: set {SETTING}['APP'] = 'module:attribute' (or OUTBOX_APP)"
        )
    return load_app(spec)
