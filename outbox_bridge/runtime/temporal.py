"""Connecting to Temporal (what the settings do not set comes from a ``temporal.toml`` profile:
see the Temporal Cloud how-to), the outbox's data converter (a codec of yours, if set), and the
custom search attributes of shard workflows."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import re
import time
from datetime import timedelta
from typing import Any

from temporalio.api.enums.v1 import IndexedValueType, TaskQueueKind, TaskQueueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.converter import (
    DataConverter,
    DefaultFailureConverterWithEncodedAttributes,
    PayloadCodec,
)
from temporalio.envconfig import ClientConfigProfile
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.workflows.models import (
    BLOCKED_CATEGORY_ATTRIBUTE,
    BLOCKED_SINCE_ATTRIBUTE,
    SCOPE_ATTRIBUTE,
    SHARD_ATTRIBUTE,
    STATE_ATTRIBUTE,
)

log = logging.getLogger("outbox_bridge.runtime.temporal")

SEARCH_ATTRIBUTES: dict[str, str] = {
    SCOPE_ATTRIBUTE.name: "Keyword",
    SHARD_ATTRIBUTE.name: "Keyword",
    STATE_ATTRIBUTE.name: "Keyword",
    BLOCKED_CATEGORY_ATTRIBUTE.name: "Keyword",
    BLOCKED_SINCE_ATTRIBUTE.name: "Datetime",
}


# The TLS settings: any of them given turns the profile's TLS off.
TLS_SETTINGS = ("temporal_tls", "temporal_tls_cert", "temporal_tls_key", "temporal_tls_ca")


def _tls(settings: OutboxSettings) -> TLSConfig | bool:
    if not (settings.temporal_tls or settings.temporal_tls_cert or settings.temporal_tls_ca):
        return False
    files = (settings.temporal_tls_ca, settings.temporal_tls_cert, settings.temporal_tls_key)
    try:
        ca, cert, key = (path.read_bytes() if path else None for path in files)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read a Temporal TLS file: {exc.strerror}: {exc.filename}"
        ) from None
    return TLSConfig(server_root_ca_cert=ca, client_cert=cert, client_private_key=key)


def temporal_profile(settings: OutboxSettings) -> ClientConfigProfile:
    """The profile ``temporal_profile`` (else ``default``) of ``temporal_config_file`` (else
    Temporal's default file); empty without a file, or when an address is given without a
    profile. Only the file is read: its variables are our settings."""
    if settings.temporal_profile is None and settings.temporal_address is not None:
        return ClientConfigProfile()
    source = settings.temporal_config_file
    if source is not None and not source.is_file():
        raise ConfigurationError(f"Temporal's configuration file {source} does not exist")
    try:
        return ClientConfigProfile.load(
            settings.temporal_profile, config_source=source, disable_env=True
        )
    except RuntimeError as exc:  # the SDK's ConfigError: unreadable file, unknown profile
        raise ConfigurationError(f"Temporal's environment configuration: {exc}") from None


def temporal_address(settings: OutboxSettings) -> str:
    """The configured Temporal frontend (the settings', else the profile's), or the embedded
    dev server's port on this host."""
    address = settings.temporal_address or temporal_profile(settings).address
    return address or f"127.0.0.1:{settings.temporal_port}"


def embedded_temporal(settings: OutboxSettings) -> bool:
    """Neither the settings nor Temporal's environment configuration give an address: the
    worker starts a dev server."""
    return settings.temporal_address is None and not temporal_profile(settings).address


def client_options(settings: OutboxSettings) -> dict[str, Any]:
    """``Client.connect``'s namespace, API key, TLS and gRPC metadata: each setting given, else
    the profile's, else the default."""
    options: dict[str, Any] = dict(temporal_profile(settings).to_client_connect_config())
    options.pop("target_host", None)
    given = settings.model_fields_set
    if "temporal_namespace" in given or "namespace" not in options:
        options["namespace"] = settings.temporal_namespace
    if settings.temporal_api_key is not None:
        options["api_key"] = settings.temporal_api_key.get_secret_value()
    if given.intersection(TLS_SETTINGS) or settings.temporal_api_key is not None:
        options["tls"] = _tls(settings) or "api_key" in options
    else:
        options.setdefault("tls", False)
    return options


def load_payload_codec(spec: str) -> PayloadCodec:
    """The codec that ``spec`` (``module:attribute``) names: a :class:`PayloadCodec`, or what
    makes one when called without arguments."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(
            f"payload_codec must look like module:attribute (e.g. myapp.codecs:codec), got {spec!r}"
        )
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"cannot load payload_codec {spec}: {exc}") from None
    codec = found() if not isinstance(found, PayloadCodec) and callable(found) else found
    if not isinstance(codec, PayloadCodec):
        raise ConfigurationError(
            f"payload_codec {spec} is a {type(codec).__name__}, not a "
            "temporalio.converter.PayloadCodec (or a class or function that makes one)"
        )
    return codec


def outbox_data_converter(settings: OutboxSettings) -> DataConverter:
    """The converter of every client that talks to the outbox's workflows: the default one,
    with ``payload_codec`` if set. The codec then also encodes failures' messages and stack
    traces (which the default failure converter leaves in plain text)."""
    if settings.payload_codec is None:
        return DataConverter.default
    return dataclasses.replace(
        DataConverter.default,
        payload_codec=load_payload_codec(settings.payload_codec),
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


async def connect(
    settings: OutboxSettings, address: str, *, runtime: Runtime | None = None
) -> Client:
    """A client of the configured namespace at ``address``, with the outbox's data converter;
    :class:`ConfigurationError` in one line, with what to check, when it cannot connect."""
    options = client_options(settings)
    converter = outbox_data_converter(settings)
    try:
        return await Client.connect(address, runtime=runtime, data_converter=converter, **options)
    except (RuntimeError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot connect to Temporal at {address} (namespace {options['namespace']!r}): "
            f"{connect_failure(str(exc))}; {_connect_advice(settings)}"
        ) from None


# What the SDK's connection errors say, in its Rust debug format (tonic::transport::Error(...)).
_QUOTED_REASONS = (re.compile(r'message: "([^"]+)"'), re.compile(r'error: "([^"]+)"'))
_TLS_FAILURE = re.compile(r"InvalidMessage|InvalidCertificate|AlertReceived|[Tt]ls|[Cc]ertificate")


def connect_failure(text: str) -> str:
    """Why a connection failed, in a few words, from the SDK's error text."""
    for pattern in _QUOTED_REASONS:
        found = pattern.search(text)
        if found:
            reason = found.group(1)
            return reason[:1].lower() + reason[1:]
    if _TLS_FAILURE.search(text):
        return "the TLS handshake failed"
    return (
        text.removeprefix("Failed client connect: ").split("tonic::transport::Error")[0].strip(" :")
        or "the connection failed"
    )


def _connect_advice(settings: OutboxSettings) -> str:
    if embedded_temporal(settings):
        return (
            "no Temporal address is set (TEMPORAL_ADDRESS, or a profile of temporal.toml), so "
            "the embedded dev server's port was tried: start `outbox-bridge worker` (which "
            "starts it) or set TEMPORAL_ADDRESS (--temporal-address) to your Temporal frontend"
        )
    return (
        "check that Temporal runs there and TEMPORAL_ADDRESS (--temporal-address, or the "
        "profile's address) is its frontend host:port; TEMPORAL_TLS, TEMPORAL_TLS_CA or "
        "TEMPORAL_API_KEY if it needs them"
    )


async def ensure_search_attributes(client: Client) -> None:
    """Register the shard workflows' search attributes in the client's namespace if missing."""
    service = client.operator_service
    existing = await service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {
        name: kind
        for name, kind in SEARCH_ATTRIBUTES.items()
        if name not in existing.custom_attributes
    }
    if not missing:
        return
    request = AddSearchAttributesRequest(
        namespace=client.namespace,
        search_attributes={
            name: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")
            for name, kind in missing.items()
        },
    )
    try:
        await service.add_search_attributes(request)
    except RPCError as exc:
        commands = "; ".join(
            f"temporal operator search-attribute create --namespace {client.namespace} "
            f"--name {name} --type {kind}"
            for name, kind in missing.items()
        )
        raise ConfigurationError(
            f"the search attributes {', '.join(missing)} are not registered in namespace "
            f"{client.namespace!r} and this worker may not register them ({exc.message}). "
            f"Ask an operator to run: {commands}"
        ) from None
    log.info("registered search attributes %s", ", ".join(missing))


# Answers of describe_task_queue that say nothing about the task queue: no check then.
UNCHECKABLE_RPC_STATUSES = frozenset({RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNIMPLEMENTED})
# The longest one describe_task_queue may take.
PROBE_TIMEOUT = 2.0
# How long an answer without pollers is asked again (a starting worker polls within moments).
NO_POLLER_PATIENCE = 1.0


async def task_queue_polled(client: Client, task_queue: str, deadline: float) -> bool | None:
    """Whether a worker polls ``task_queue`` for workflow tasks, asked again for
    :data:`NO_POLLER_PATIENCE` seconds (no pollers) or until ``deadline`` (no answer). None when
    the server will not tell; ``RPCError`` or ``TimeoutError`` when it does not answer."""
    request = DescribeTaskQueueRequest(
        namespace=client.namespace,
        task_queue=TaskQueue(name=task_queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
    )
    pause = 0.05
    unpolled_since: float | None = None
    while True:
        # Each call gets some time even past the deadline: a late answer still tells.
        wait = max(min(deadline - time.monotonic(), PROBE_TIMEOUT), 0.5)
        try:
            response = await asyncio.wait_for(
                client.workflow_service.describe_task_queue(
                    request, timeout=timedelta(seconds=wait)
                ),
                wait + 0.5,
            )
        except (RPCError, TimeoutError) as exc:
            status = exc.status if isinstance(exc, RPCError) else RPCStatusCode.DEADLINE_EXCEEDED
            if status in UNCHECKABLE_RPC_STATUSES:
                log.debug("cannot check the pollers of task queue %s: %s", task_queue, exc)
                return None
            if status != RPCStatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline:
                if unpolled_since is not None:
                    return False
                raise
        else:
            if response.pollers:
                return True
            unpolled_since = unpolled_since if unpolled_since is not None else time.monotonic()
        now = time.monotonic()
        if now >= deadline or (
            unpolled_since is not None and now - unpolled_since >= NO_POLLER_PATIENCE
        ):
            return False
        await asyncio.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.5)
