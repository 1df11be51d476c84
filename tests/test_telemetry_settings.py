"""OpenTelemetry's standard variables beside outbox-bridge's own telemetry settings.

A setting given explicitly (a flag, then an ``OUTBOX_*`` variable) wins over OpenTelemetry's
``OTEL_*`` variable for it, which wins over the default; ``OTEL_SDK_DISABLED`` turns traces and
metrics off whatever the rest says.
"""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from outbox_bridge.cli import main as cli_main
from outbox_bridge.cli.flags import build_settings
from outbox_bridge.dev.embedded import free_port
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.observability.sdk import Telemetry, setup_telemetry
from tests.support import clear_settings

# setting -> (outbox-bridge's variable, OpenTelemetry's, a value, another value)
PAIRS = {
    "otel_exporter": ("OUTBOX_OTEL_EXPORTER", "OTEL_TRACES_EXPORTER", "console", "otlp"),
    "metrics_exporter": ("OUTBOX_METRICS_EXPORTER", "OTEL_METRICS_EXPORTER", "prometheus", "otlp"),
    "metrics_port": ("OUTBOX_METRICS_PORT", "OTEL_EXPORTER_PROMETHEUS_PORT", "9100", "9200"),
    "metrics_host": ("OUTBOX_METRICS_HOST", "OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1", "::1"),
}


@pytest.fixture(autouse=True)
def no_telemetry_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


def _value(setting: str, overrides: dict[str, object] | None = None) -> str:
    return str(getattr(build_settings(overrides or {}), setting))


@pytest.mark.parametrize("setting", list(PAIRS))
def test_an_otel_variable_sets_what_nothing_else_does(monkeypatch, setting: str) -> None:
    _ours, otel, value, _other = PAIRS[setting]
    monkeypatch.setenv(otel, value)
    assert _value(setting) == value


@pytest.mark.parametrize("setting", list(PAIRS))
def test_outbox_variable_wins_over_otel_variable_and_a_flag_over_both(
    monkeypatch, setting: str
) -> None:
    ours, otel, value, other = PAIRS[setting]
    monkeypatch.setenv(otel, other)
    monkeypatch.setenv(ours, value)
    assert _value(setting) == value
    flag = "none" if setting.endswith("exporter") else ("9300" if "port" in setting else "::")
    assert _value(setting, {setting: flag}) == flag


def test_defaults_export_nothing() -> None:
    settings = build_settings({})
    assert (settings.otel_exporter, settings.metrics_exporter) == ("none", "none")
    assert not settings.otel_sdk_disabled


def test_an_unsupported_otel_value_names_both_variables(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigurationError) as raised:
        build_settings({})
    assert "OUTBOX_OTEL_EXPORTER or OTEL_TRACES_EXPORTER" in str(raised.value)
    assert "'otlp'" in str(raised.value)


def test_sdk_disabled_wins_over_every_exporter(monkeypatch) -> None:
    port = free_port()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("OUTBOX_OTEL_EXPORTER", "console")
    settings = build_settings(
        {"metrics_exporter": "prometheus", "metrics_host": "127.0.0.1", "metrics_port": port}
    )
    assert settings.otel_sdk_disabled
    telemetry = setup_telemetry(settings)
    assert telemetry == Telemetry(None, None)
    with socket.socket() as sock:  # no scrape endpoint was opened
        sock.bind(("127.0.0.1", port))


def test_help_names_both_variables() -> None:
    result = CliRunner().invoke(cli_main, ["worker", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for ours, otel, *_ in PAIRS.values():
        assert f"[env: {ours}, else {otel}]" in text
    assert "[env: OTEL_SDK_DISABLED]" in text
