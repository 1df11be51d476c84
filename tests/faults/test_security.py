"""Connections to Temporal over TLS, with an mTLS client certificate or an API key, from the
settings; secrets (the database password, the API key) in no output of the worker or the
command line. (Payloads and redacted error messages in no history: every fault scenario
scans every history it produced.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from pydantic import SecretStr
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

from outbox_bridge.config import OutboxSettings
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.runtime.temporal import connect
from tests.faults.harness import (
    WorkerProcess,
    clean_env,
    command,
    new_task_queue,
    wait_drained,
    worker_env,
)
from tests.faults.history import Workload, prepare_fault_table
from tests.faults.tls import Certificates, TlsProxy, make_certificates, openssl_available

needs_openssl = pytest.mark.skipif(not openssl_available(), reason="needs the openssl command")

API_KEY = "api-key-canary-3c9a"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


def tls_settings(kind: str, certificates: Certificates) -> OutboxSettings:
    if kind == "tls":
        return OutboxSettings(temporal_tls=True, temporal_tls_ca=certificates.ca)
    if kind == "mtls":
        return OutboxSettings(
            temporal_tls_ca=certificates.ca,
            temporal_tls_cert=certificates.client_cert,
            temporal_tls_key=certificates.client_key,
        )
    return OutboxSettings(temporal_api_key=SecretStr(API_KEY), temporal_tls_ca=certificates.ca)


@needs_openssl
@pytest.mark.parametrize(
    ("kind", "client_name", "authorization"),
    [
        ("tls", None, None),
        ("mtls", "outbox-client", None),
        ("api-key", None, f"Bearer {API_KEY}"),
    ],
)
async def test_connect_uses_tls_client_certificates_and_api_keys_from_the_settings(
    certificates: Certificates,
    fault_temporal,
    kind: str,
    client_name: str | None,
    authorization: str | None,
) -> None:
    settings = tls_settings(kind, certificates)
    with TlsProxy(fault_temporal.address, certificates, kind == "mtls") as proxy:
        client = await connect(settings, proxy.address)
        await client.workflow_service.get_system_info(GetSystemInfoRequest())
        assert [w async for w in client.list_workflows()] == []
    assert {"GetSystemInfo", "ListWorkflowExecutions"} <= proxy.methods()
    assert {s.client_common_name for s in proxy.seen} == {client_name}
    assert {s.authorization for s in proxy.seen} == {authorization}


@needs_openssl
async def test_a_server_that_wants_a_client_certificate_refuses_a_worker_without_one(
    certificates: Certificates, fault_temporal
) -> None:
    settings = OutboxSettings(temporal_tls=True, temporal_tls_ca=certificates.ca)
    with TlsProxy(fault_temporal.address, certificates, require_client_certificate=True) as proxy:
        with pytest.raises(ConfigurationError, match="cannot connect to Temporal"):
            await connect(settings, proxy.address)


async def test_an_unreadable_certificate_is_a_configuration_error(tmp_path: Path) -> None:
    settings = OutboxSettings(
        temporal_tls_cert=tmp_path / "missing.pem", temporal_tls_key=tmp_path / "missing.key"
    )
    with pytest.raises(ConfigurationError, match="cannot read a Temporal TLS file"):
        await connect(settings, "127.0.0.1:1")


@needs_openssl
async def test_the_worker_runs_over_tls_with_an_api_key_and_never_prints_its_secrets(
    certificates: Certificates, engine, fault_database, fault_temporal, logs
) -> None:
    url, password = fault_database
    table = f"f_tls_{new_task_queue()[-8:]}"
    await prepare_fault_table(engine, table)
    with TlsProxy(fault_temporal.address, certificates) as proxy:
        secrets = {"TEMPORAL_API_KEY": API_KEY, "TEMPORAL_TLS_CA": str(certificates.ca)}
        env = worker_env(url, proxy.address, table, new_task_queue(), **secrets)
        worker = WorkerProcess(env, logs)
        worker.start()
        try:
            await worker.ready()
            workload = Workload(engine, table, [(1, 5), (2, 6)], rollback_share=0)
            await workload.write(20)
            await wait_drained(engine, table, timeout=60)
            help_text = await command(env, "--help")
            status = await command(env, "status", "ORGANIZATION:5", ok=(0, 1))
        finally:
            code = await worker.stop()
        help_worker = await command(clean_env(**env), "--help", module=None)
    output = worker.output()
    assert code == 0, output[-3000:]
    assert {"PollWorkflowTaskQueue", "SignalWithStartWorkflowExecution"} & proxy.methods()
    assert {s.authorization for s in proxy.seen} == {f"Bearer {API_KEY}"}
    for text in (output, help_text, status, help_worker):
        assert password not in text and API_KEY not in text


# Expressions an f-string may put into SQL: table names (checked plain identifiers, see
# OutboxTable), names derived from them, the fixed shard key columns, and constants.
SQL_NAMES = {
    "name",
    # The testing toolkit's test databases, quoted as identifiers (testing/servers.py).
    "_quoted(name)",
    "_quoted(template)",
    "table.name",
    "notify_channel(name)",
    "notify_channel(table.name)",
    "shard",
    "TRACE_CONTEXT_COLUMN",
    "NOTIFY_PAYLOAD_LIMIT",
    "SWEEP_NOTIFICATION",
    # The set-based drain statements of db/reads.py: the owner table's name, and fragments
    # built there from column names, table aliases and bind-parameter names only
    # (_shard_source, _joins).
    "owners.name",
    "source",
    "held",
    "paused",
    "group",
    "key",
    "key.replace('s.', '')",
    "_joins('o', regional)",
    "_joins('t', regional)",
    # The pause and parked-group clauses (db/pauses.py, db/parked.py): their tables' names,
    # row aliases, column equalities, and the clauses they build from those alone.
    "pauses",
    "pauses.name",
    "parked",
    "row",
    "scope",
    "same",
    "where",
    "not_due_sql(table, 't')",
    "not_parked(table, 't')",
    "wait_seconds_sql(table, 't')",
    "wait_seconds_sql(table, 'w', 's.scope')",
    "due_at_sql(table, 'w', 's.scope')",
    # A timed pause's end: the column's name, and the clause that a pause still holds.
    "PAUSE_ENDS_AT",
    "_holds()",
    # The rate limits' take (db/limits.py): their table's name, and the burst, a constant.
    "limits",
    "BURST_SECONDS",
    "MAX_PER_SECOND",
    "_holds('p')",
    # What init-db adds to an existing table (db/install.py): the table's name, a column and a
    # check constraint compiled from the metadata, and the NOTIFY function's name and body
    # (db/schema.py), built from the table's name and the shard key columns.
    "table",
    "column_sql",
    "check.name",
    "sqltext",
    "notify_function(table)",
    "notify_function_body(table)",
}
SQL_WORDS = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|DROP|LISTEN|NOTIFY|WHERE)\b")


def test_sql_takes_values_only_as_parameters() -> None:
    """SQL built from strings interpolates names only; every value is a bound parameter."""
    root = Path(__file__).resolve().parents[2]
    sources = [
        *(root / "outbox_bridge").rglob("*.py"),
        *(root / "activities").glob("*.py"),
        *(root / "workflows").glob("*.py"),
    ]
    checked = 0
    for path in [*sources, root / "worker.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                literal = "".join(
                    v.value
                    for v in node.values
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)
                )
                if SQL_WORDS.search(literal):
                    checked += 1
                    for value in node.values:
                        if isinstance(value, ast.FormattedValue):
                            expression = ast.unparse(value.value)
                            assert expression in SQL_NAMES, (
                                f"{path.name}:{node.lineno}: {expression}"
                            )
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
                left = node.left
                if isinstance(left, ast.Constant) and isinstance(left.value, str):
                    assert not SQL_WORDS.search(left.value), f"{path.name}:{node.lineno}: % on SQL"
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "format":
                target = getattr(node.func, "value", None)
                if isinstance(target, ast.Constant) and isinstance(target.value, str):
                    assert not SQL_WORDS.search(target.value), f"{path.name}:{node.lineno}: format"
    assert checked >= 5  # the scan found the DDL it is meant to check
