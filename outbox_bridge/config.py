"""All configuration in one settings model, read from environment variables (``OUTBOX_*``,
``TEMPORAL_*``) and flags; nothing else reads the environment."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import URL, make_url

from outbox_bridge.errors import ConfigurationError
from outbox_bridge.workflows.models import PartitionOptions, ShardOptions

# The payload limit (the UTF-8 bytes of a payload's JSON text) an OutboxApp has unless told
# otherwise, and the range a limit may take: at least room for a small object, at most what
# one jsonb value can hold.
DEFAULT_MAX_PAYLOAD_BYTES = 2**20
MIN_PAYLOAD_LIMIT = 2**10
MAX_PAYLOAD_LIMIT = 2**28


class SettingGroup(StrEnum):
    """Which commands offer a setting as a flag (every setting is an environment variable, which
    every command reads)."""

    DATABASE = "database"  # where the outbox tables are: init-db, flush, shards, the worker
    TEMPORAL = "temporal"  # which Temporal: every command that talks to shard workflows
    APP = "app"  # which OutboxApp: every command that names shards or tables
    SHARDS = "shards"  # where shard workflows run: the worker, skip and flush (which start one)
    WORKER = "worker"  # the rest, TLS and API key included: the worker alone (untagged fields)


def _in(group: SettingGroup, *, tools: str | None = None) -> dict[str, Any]:
    """A field's group, and what it means to the tools when that differs from its description."""
    return {"group": group.value} | ({"tools": tools} if tools else {})


def _tag(field: FieldInfo, key: str) -> str | None:
    extra = field.json_schema_extra
    value = extra.get(key) if isinstance(extra, dict) else None
    return value if isinstance(value, str) else None


def setting_group(field: FieldInfo) -> SettingGroup:
    """The group of a settings field (:attr:`SettingGroup.WORKER` when untagged)."""
    return SettingGroup(_tag(field, "group") or SettingGroup.WORKER)


def tools_description(field: FieldInfo) -> str:
    """What a setting means to the commands other than the worker."""
    return _tag(field, "tools") or field.description or ""


def _temporal(name: str, default: Any, description: str, **options: Any) -> Any:
    """The setting ``temporal_<name>``, read from ``TEMPORAL_<NAME>`` (Temporal's own name)."""
    alias = AliasChoices(f"TEMPORAL_{name.upper()}", f"temporal_{name}")
    return Field(default, validation_alias=alias, description=description, **options)


def _or_otel(name: str, otel: str) -> AliasChoices:
    """``OUTBOX_<NAME>``, else OpenTelemetry's own variable ``otel``."""
    return AliasChoices(f"OUTBOX_{name.upper()}", otel)


class LocationSettings(BaseSettings):
    """Where things are: the database, Temporal, the app, the embedded servers' data, and which
    regions and shards of the tables this worker takes. The first group of
    :class:`OutboxSettings`, which adds how shards are processed, telemetry and the rest."""

    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_", populate_by_name=True, extra="ignore", case_sensitive=False
    )

    database_url: SecretStr | None = Field(
        None,
        description="PostgreSQL URL (postgresql://user:password@host/db). Unset: start an "
        "embedded PostgreSQL with its data under --data-dir.",
        json_schema_extra=_in(
            SettingGroup.DATABASE,
            tools="PostgreSQL URL of the outbox tables (postgresql://user:password@host/db). "
            "Unset: the worker's embedded PostgreSQL under --data-dir.",
        ),
    )
    temporal_address: str | None = _temporal(
        "address",
        None,
        "Temporal frontend host:port. Unset: start a Temporal dev server with its database "
        "file under --data-dir.",
        json_schema_extra=_in(
            SettingGroup.TEMPORAL,
            tools="Temporal frontend host:port. Unset: the Temporal profile's address, else the "
            "worker's embedded dev server, on 127.0.0.1 and OUTBOX_TEMPORAL_PORT (7233).",
        ),
    )
    temporal_namespace: str = _temporal(
        "namespace", "default", "Temporal namespace.", json_schema_extra=_in(SettingGroup.TEMPORAL)
    )
    temporal_api_key: SecretStr | None = _temporal("api_key", None, "API key (Temporal Cloud).")
    temporal_tls: bool = _temporal("tls", False, "Connect to Temporal with TLS.")
    temporal_tls_cert: Path | None = _temporal("tls_cert", None, "mTLS client certificate (PEM).")
    temporal_tls_key: Path | None = _temporal("tls_key", None, "mTLS client key (PEM).")
    temporal_tls_ca: Path | None = _temporal("tls_ca", None, "CA bundle for the server (PEM).")
    temporal_profile: str | None = _temporal(
        "profile",
        None,
        "Profile of Temporal's environment configuration (temporal.toml) that gives the "
        "Temporal address, namespace, API key and TLS not set otherwise. Unset: the file's "
        "'default' profile, if it has one.",
        json_schema_extra=_in(SettingGroup.TEMPORAL),
    )
    temporal_config_file: Path | None = _temporal(
        "config_file",
        None,
        "Temporal's environment configuration file. Unset: ~/.config/temporalio/temporal.toml "
        "(the platform's configuration folder), if it exists.",
    )
    task_queue: str = Field(
        "outbox",
        description="Temporal task queue of the shard workflows.",
        json_schema_extra=_in(SettingGroup.SHARDS),
    )
    app: str | None = Field(
        None,
        description="The OutboxApp to run, as module:attribute (e.g. myapp.outbox:app).",
        json_schema_extra=_in(
            SettingGroup.APP,
            tools="The worker's OutboxApp, as module:attribute (e.g. myapp.outbox:app), for its "
            "scope names and tables. Unset: scope names are learned from the shard workflows.",
        ),
    )
    demo: bool = Field(
        False,
        description="Run the demo app (outbox_bridge.demo) and write demo traffic: a first look "
        "at shards that drain, block, get skipped and resumed (see the quick start).",
        json_schema_extra=_in(
            SettingGroup.APP,
            tools="Use the demo app's scope names and table (what `outbox-bridge worker "
            "--demo` runs), instead of --app.",
        ),
    )
    demo_outage: float = Field(
        300.0,
        ge=0,
        description="Seconds the demo's project replica of organization 7 is down after the "
        "start: shard ORGANIZATION:7 blocks meanwhile, to be skipped and resumed. 0: no outage.",
    )
    data_dir: Path = Field(
        Path(".outbox-bridge"),
        description="Where embedded PostgreSQL and Temporal keep their data (reused on restart).",
        json_schema_extra=_in(
            SettingGroup.DATABASE,
            tools="The worker's --data-dir: its embedded PostgreSQL is used when "
            "OUTBOX_DATABASE_URL is unset.",
        ),
    )
    temporal_port: int = Field(7233, description="Port of the embedded Temporal dev server.")
    temporal_ui_port: int = Field(8233, description="Port of the embedded Temporal UI.")
    regions: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="Regions this worker drains in regional tables, comma-separated "
        "(unset: every region).",
    )
    skip_shards: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="Shards that start skipped, comma-separated SCOPE:ID (REGION:SCOPE:ID for "
        "a regional table), e.g. ORGANIZATION:42,USER:7: a kill switch for poison shards.",
    )

    @field_validator("regions", "skip_shards", mode="before")
    @classmethod
    def _split_regions(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [r.strip() for r in value.split(",") if r.strip()] or None
        return value

    @model_validator(mode="after")
    def _check_tls(self) -> LocationSettings:
        if (self.temporal_tls_cert is None) != (self.temporal_tls_key is None):
            raise ValueError("temporal_tls_cert and temporal_tls_key go together (mTLS)")
        return self


class OutboxSettings(LocationSettings):
    """Settings of the worker, the bridge and the command line."""

    # -- how shards are processed ----------------------------------------------------------------
    shard_workflows: str = Field(
        "on-demand",
        description="When a shard gets its own OutboxShard workflow: on-demand, only when it "
        "needs attention (a handler failed, it is skipped, its head is deferred, or a flush "
        "waits on it), while a few partition workflows per table drain the healthy shards at "
        "no history cost per row. The mode `always` of 0.x (a workflow for every shard with "
        "rows) was retired in 1.0: see the upgrade guide.",
    )
    partitions: int = Field(
        4,
        ge=1,
        le=1000,
        description="Partition workflows per table: each drains the healthy "
        "shards that hash to it in one lingering activity, many shards at a time; more "
        "partitions spread the work over more workers.",
    )
    handler_timeout: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="Seconds one handler call may take before it is retried.",
    )
    heartbeat_timeout: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds without heartbeat before a category activity is retried.",
    )
    initial_retry_interval: float = Field(
        1.0, gt=0, le=86_400, description="First retry delay of a failing handler (seconds)."
    )
    max_retry_interval: float = Field(
        3600.0, gt=0, le=604_800, description="Cap of the exponential retry delay (seconds)."
    )
    handover_after: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="Seconds a shard whose handler failed is retried by its partition, at once "
        "and then on the same backoff, before it goes to a workflow of its own: a transient "
        "failure costs no workflow start. 0: at its first failure.",
    )
    drain_max_groups: int = Field(
        1000, ge=1, le=10_000, description="Coalescing groups handled per drain call at most."
    )
    drain_time_budget: float = Field(
        2.0, gt=0, le=3600, description="Seconds after which a drain call stops taking new groups."
    )
    max_history_events: int = Field(
        10_000, ge=100, le=40_000, description="History length at which a shard continues as new."
    )
    poll_interval: float = Field(
        1.0,
        gt=0,
        le=86_400,
        description="Seconds between a partition's scans for new rows (while LISTEN works, "
        "doubled after each scan that finds nothing, up to the sweep interval).",
    )
    sweep_interval: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="Seconds between full sweeps (late commits, lost notifications, lost "
        "workflows).",
    )
    listen: bool = Field(True, description="Wake the bridge with LISTEN/NOTIFY (else poll only).")
    redact_errors: bool = Field(
        False,
        description="Keep only exception class names in Temporal failures (else their "
        "messages go there, at most 2,000 characters, with credentials masked).",
    )
    max_unhandled_shards: int = Field(
        100,
        ge=1,
        description="Shard workflows at most, per table, for shards whose head row no handler "
        "of this app can take (a category it does not register, or registers in another "
        "scope): the other such shards wait, their rows kept, until one of those is fixed, "
        "skipped or deleted (the outbox.shards.held_back metric counts them).",
    )
    payload_codec: str | None = Field(
        None,
        description="A Temporal PayloadCodec of yours (e.g. your encryption codec), as "
        "module:attribute (an instance, or a class or function that makes one without "
        "arguments): the outbox's workflow inputs, signals, results and failures (messages and "
        "stack traces) go to Temporal encoded with it. Every outbox-bridge process of the app "
        "needs the same one (the commands read it from the environment, like the TLS "
        "settings). Unset: plain JSON.",
    )
    handler_threads: int = Field(
        64,
        ge=1,
        description="Threads for plain-def handlers: how many of their calls run at once. Each "
        "waiting thread costs little memory, but may hold a database connection of the "
        "handler's own (size its pool to match).",
    )
    max_concurrent_calls: int = Field(
        1000,
        ge=1,
        description="Handler calls one worker runs at once, async and plain-def together (a "
        "handler's own max_concurrency may lower it for its categories); further shards wait "
        "for a slot.",
    )
    max_undeleted_groups: int | None = Field(
        None,
        ge=1,
        description=(
            "Groups the worker may have handled and not yet deleted before it starts no further "
            "handler call: what a kill -9 of the worker runs again, besides the calls under way. "
            "By default as many as the worker can run calls at once (max_concurrent_calls, or "
            "handler_threads if every handler is plain def); lower repeats less after a crash "
            "and drains more slowly where deletes take a while."
        ),
    )
    max_payload_bytes: int | None = Field(
        None,
        ge=MIN_PAYLOAD_LIMIT,
        le=MAX_PAYLOAD_LIMIT,
        description=(
            "Largest payload, in bytes of its JSON text, this worker reads; a row over it is "
            "never read whole, and its shard blocks on it (PayloadTooLargeError) until its group "
            "is parked, the row shrunk, or this limit raised. By default the app's limit, "
            "OutboxApp(max_payload_bytes=...), which producers enforce at write (1 MiB unless "
            "the app sets it: with the worker's payload budget it keeps the decoded payloads "
            "of a worker well under the 1 GiB of the Kubernetes manifest). Set it to raise the "
            "limit for one worker (to handle a row written past it with plain SQL) or to lower "
            "it, between 1 KiB and 256 MiB."
        ),
    )
    max_concurrent_activities: int = Field(
        20, ge=1, description="Activities (and drains) one worker runs at once."
    )
    max_concurrent_flushes: int = Field(
        200,
        ge=1,
        description="Flushes one worker waits for at once (each watches the table for its "
        "rows; they run on the task queue's .flush queue, so they never take the drains' "
        "slots).",
    )
    database_pool_size: int = Field(
        25, ge=2, description="Database connections of the worker (activities + bridge)."
    )

    # -- telemetry and logs -------------------------------------------------------------------
    # OpenTelemetry's precedence: a setting given explicitly (a flag, then OUTBOX_*) wins over
    # the OTEL_* variable, as an exporter's argument does, which wins over the default.
    # OTEL_SDK_DISABLED turns everything off, as in the SDK.
    otel_exporter: Literal["none", "console", "otlp"] = Field(
        "none",
        validation_alias=_or_otel("otel_exporter", "OTEL_TRACES_EXPORTER"),
        description="Where spans go: none, console, or otlp (OTEL_EXPORTER_OTLP_*).",
    )
    log_level: str = Field("INFO", description="Log level.")
    log_failures: bool = Field(
        False,
        description="Log each handler failure in a line of its own also while the console "
        "summary runs (a terminal, or --demo), which otherwise counts them in a line of its "
        "own. Without the summary every failure is logged.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Log lines as text, or as JSON objects (one per line) with the shard, "
        "category, trace_id and span_id of the activity or handler that logged them.",
    )
    metrics_exporter: Literal["none", "prometheus", "otlp", "console"] = Field(
        "none",
        validation_alias=_or_otel("metrics_exporter", "OTEL_METRICS_EXPORTER"),
        description="Where metrics (outbox-bridge's and the Temporal SDK's) go: none, "
        "prometheus (a scrape endpoint on --metrics-port), otlp (OTEL_EXPORTER_OTLP_*) or "
        "console.",
    )
    metrics_port: int = Field(
        9464,
        ge=0,
        le=65535,
        validation_alias=_or_otel("metrics_port", "OTEL_EXPORTER_PROMETHEUS_PORT"),
        description="Port of the Prometheus scrape endpoint /metrics.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        validation_alias=_or_otel("metrics_host", "OTEL_EXPORTER_PROMETHEUS_HOST"),
        description="Address the Prometheus scrape endpoint listens on. This host only by "
        "default; 0.0.0.0 (all interfaces) lets a scraper on another host or outside a "
        "container reach it (the container image sets it), :: an IPv6-only cluster.",
    )
    otel_sdk_disabled: bool = Field(
        False,
        validation_alias=AliasChoices("OTEL_SDK_DISABLED"),
        description="Export no spans and no metrics, whatever the exporters say.",
    )

    # -- running in a container -----------------------------------------------------------------
    health_port: int = Field(
        8080,
        ge=0,
        le=65535,
        description="Port of the HTTP health endpoints /healthz (liveness) and /readyz "
        "(readiness); 0 disables them.",
    )
    health_host: str = Field(
        "127.0.0.1",
        description="Address the health endpoints listen on. This host only by default; "
        "0.0.0.0 (all interfaces) lets probes reach a container from outside (the container "
        "image sets it), :: serves an IPv6-only cluster.",
    )
    shutdown_grace: float = Field(
        10.0,
        ge=0,
        description="Seconds a stopping worker (SIGTERM, SIGINT) gives in-flight handler calls "
        "to finish before it cancels them; their rows are kept and retried.",
    )

    @field_validator("shard_workflows", mode="before")
    @classmethod
    def _retired_mode(cls, value: Any) -> Any:
        if value == "always":
            raise ValueError(
                "--shard-workflows always was retired in outbox-bridge 1.0: every shard is "
                "drained by its table's partitions and gets a workflow of its own when it needs "
                "attention. Remove the setting (OUTBOX_SHARD_WORKFLOWS); before upgrading, run "
                "`outbox-bridge upgrade-check` (docs: how-to/upgrade)"
            )
        if value != "on-demand":
            raise ValueError(f"the only mode is on-demand, not {value!r}")
        return value

    # -- derived -------------------------------------------------------------------------------

    def shard_options(self) -> ShardOptions:
        return ShardOptions(
            handler_timeout_seconds=self.handler_timeout,
            heartbeat_timeout_seconds=self.heartbeat_timeout,
            initial_retry_seconds=self.initial_retry_interval,
            max_retry_interval_seconds=self.max_retry_interval,
            drain_max_groups=self.drain_max_groups,
            drain_time_budget_seconds=self.drain_time_budget,
            max_history_events=self.max_history_events,
        )

    def partition_options(self, skip_shards: Iterable[str] = ()) -> PartitionOptions:
        return PartitionOptions(
            time_budget_seconds=self.drain_time_budget,
            poll_interval_seconds=self.poll_interval,
            rescan_interval_seconds=self.sweep_interval,
            heartbeat_timeout_seconds=self.heartbeat_timeout,
            skip_shards=tuple(sorted(skip_shards)),
        )


# Settings of 0.x that 1.0 retired with the mode `always`: set, they are ignored, and said so.
RETIRED_VARIABLES = (
    "OUTBOX_LINGER",
    "OUTBOX_LINGER_MAX",
    "OUTBOX_LINGER_MAX_SHARDS",
    "OUTBOX_IDLE_TIMEOUT",
)


def retired_variables(environ: Mapping[str, str]) -> list[str]:
    return [name for name in RETIRED_VARIABLES if name in environ]


def env_names(name: str, field: FieldInfo) -> list[str]:
    """The environment variables of a setting, the one that wins first."""
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        names = [c for c in alias.choices if isinstance(c, str) and c.isupper()]
        assert names, name
        return names
    return [f"OUTBOX_{name.upper()}"]


def env_name(name: str, field: FieldInfo) -> str:
    """The environment variable of a setting (the first, when OpenTelemetry has one too)."""
    return env_names(name, field)[0]


def sqlalchemy_url(url: str) -> URL:
    """The URL for SQLAlchemy with the psycopg 3 driver, whatever scheme was given."""
    try:
        parsed = make_url(url)
    except Exception:  # the message of a parse error can echo the password: drop it
        raise ConfigurationError(
            "the database URL cannot be parsed; expected postgresql://user:password@host:port/db"
        ) from None
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise ConfigurationError(
            f"only PostgreSQL is supported, got a {parsed.get_backend_name()!r} URL"
        )
    return parsed.set(drivername="postgresql+psycopg")


def libpq_url(url: URL) -> str:
    """The same URL as a libpq connection string, for psycopg's own connections (LISTEN)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


# libpq connection parameters whose value is a secret (libpq's "Parameter Key Words"); paths
# to files holding secrets (passfile, sslkey) are not.
SECRET_QUERY_PARAMETERS = frozenset({"password", "sslpassword", "oauth_client_secret"})


def safe_url(url: URL) -> str:
    """The URL with the password and the secret query parameters (any letter case) masked."""
    hidden = {k: "***" for k in url.query if k.lower() in SECRET_QUERY_PARAMETERS}
    if hidden:
        url = url.update_query_dict(hidden)
    rendered = url.render_as_string(hide_password=True)
    return rendered.replace("=%2A%2A%2A", "=***") if hidden else rendered
