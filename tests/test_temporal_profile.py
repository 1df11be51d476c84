"""Temporal's environment configuration: a profile of temporal.toml gives the address,
namespace, API key and TLS that the settings do not; a setting given (flag, variable) wins. The
worker does not start a dev server when a profile has an address, and the command line reaches
the server the profile names."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

from outbox_bridge import ConfigurationError, OutboxSettings
from outbox_bridge.runtime.temporal import (
    client_options,
    connect,
    embedded_temporal,
    temporal_address,
)
from tests.support import clean_env, clear_settings

ROOT = Path(__file__).resolve().parents[1]


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "temporal.toml"
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


async def test_a_profile_names_the_server_and_namespace(servers, tmp_path: Path) -> None:
    path = config_file(
        tmp_path,
        f'[profile.dev]\naddress = "{servers.temporal_address}"\nnamespace = "from-profile"\n'
        '[profile.default]\naddress = "127.0.0.1:1"\n',
    )
    settings = OutboxSettings(temporal_profile="dev", temporal_config_file=path)
    assert not embedded_temporal(settings)
    assert temporal_address(settings) == servers.temporal_address
    client = await connect(settings, temporal_address(settings))
    assert client.namespace == "from-profile"
    await client.workflow_service.get_system_info(GetSystemInfoRequest())  # it answers

    # Settings that were given win, one by one.
    given = OutboxSettings(
        temporal_profile="dev", temporal_config_file=path, temporal_namespace="default"
    )
    assert (await connect(given, temporal_address(given))).namespace == "default"
    elsewhere = OutboxSettings(
        temporal_profile="dev", temporal_config_file=path, temporal_address="127.0.0.1:1"
    )
    assert temporal_address(elsewhere) == "127.0.0.1:1"
    assert client_options(elsewhere)["namespace"] == "from-profile"


def test_the_default_profile_serves_only_when_no_address_is_given(tmp_path: Path) -> None:
    path = config_file(
        tmp_path,
        '[profile.default]\naddress = "temporal.example:7233"\nnamespace = "team"\n'
        'api_key = "profile-key"\n',
    )
    settings = OutboxSettings(temporal_config_file=path)
    assert temporal_address(settings) == "temporal.example:7233"
    assert not embedded_temporal(settings)
    options = client_options(settings)
    assert (options["namespace"], options["api_key"], options["tls"]) == (
        "team",
        "profile-key",
        True,
    )

    # An address given: the default profile says nothing (a local test server stays local).
    local = OutboxSettings(temporal_config_file=path, temporal_address="127.0.0.1:7233")
    assert client_options(local) == {"namespace": "default", "tls": False}
    # Nothing anywhere: the worker starts its dev server, as before.
    assert embedded_temporal(OutboxSettings(temporal_config_file=config_file(tmp_path, "")))


def test_tls_and_keys_that_are_given_win_over_the_profile(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    path = config_file(
        tmp_path,
        '[profile.cloud]\naddress = "ns.acct.tmprl.cloud:7233"\napi_key = "profile-key"\n',
    )
    options = client_options(
        OutboxSettings(
            temporal_profile="cloud",
            temporal_config_file=path,
            temporal_api_key=SecretStr("given-key"),
            temporal_tls_ca=ca,
        )
    )
    assert options["api_key"] == "given-key"
    assert options["tls"].server_root_ca_cert == ca.read_bytes()
    no_tls = OutboxSettings(temporal_profile="cloud", temporal_config_file=path, temporal_tls=False)
    assert client_options(no_tls)["tls"] is True  # the profile's key still needs TLS


def test_a_missing_profile_or_file_is_a_configuration_error(tmp_path: Path) -> None:
    path = config_file(tmp_path, '[profile.default]\naddress = "x:1"\n')
    with pytest.raises(ConfigurationError, match="Profile 'prod' not found"):
        temporal_address(OutboxSettings(temporal_profile="prod", temporal_config_file=path))
    with pytest.raises(ConfigurationError, match="does not exist"):
        temporal_address(OutboxSettings(temporal_config_file=tmp_path / "missing.toml"))


async def test_the_command_line_reaches_the_server_of_the_profile(servers, tmp_path) -> None:
    path = config_file(tmp_path, f'[profile.dev]\naddress = "{servers.temporal_address}"\n')
    env = clean_env(
        TEMPORAL_CONFIG_FILE=str(path),
        TEMPORAL_PROFILE="dev",
        OUTBOX_APP="tests.sample_app:app",
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "outbox_bridge",
        "status",
        "USER:424242",
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    # Temporal answered: the shard has no workflow (without the profile: no server at 7233).
    assert process.returncode == 1, err.decode()
    assert "has no workflow" in err.decode()
