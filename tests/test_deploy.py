"""The deployment files in ``deploy/`` agree with the code: every environment variable is a
setting of ``OutboxSettings`` with a valid value, probes hit the paths and port that
``outbox_bridge.observability.health`` serves, grace periods outlast ``shutdown_grace``, images and users match.

No container engine or cluster is needed: the files are parsed and cross-checked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from outbox_bridge.config import OutboxSettings, env_name
from outbox_bridge.observability.health import CHECK_TIMEOUT, LIVENESS_PATH, READINESS_PATH
from outbox_bridge.registry import app_from_settings
from outbox_bridge.runtime.temporal import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
FIELDS = OutboxSettings.model_fields
ENV_NAMES = {env_name(name, field): name for name, field in FIELDS.items()}
SECRET_ENV = {env_name(n, f) for n, f in FIELDS.items() if SecretStr in get_args(f.annotation)}
HEALTH_PORT = FIELDS["health_port"].default
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


# -- reading the files -------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    instructions = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), " ".join(rest.split())))
    return instructions


def instruction(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def interpolate(value: Any) -> str:
    """Compose's ``${NAME:-default}`` / ``${NAME}`` with nothing set: the defaults."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", str(value))


def compose_env(service: str) -> dict[str, str]:
    env = compose()["services"][service].get("environment", {})
    assert isinstance(env, dict), f"{service}: write environment as a mapping"
    return {key: interpolate(value) for key, value in env.items()}


def k8s_documents() -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted(K8S.glob("*.yaml"))
    }


def k8s(kind: str) -> dict[str, Any]:
    found = [doc for docs in k8s_documents().values() for doc in docs if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def worker_container() -> dict[str, Any]:
    containers = k8s("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def k8s_env() -> dict[str, str]:
    """The environment the worker container gets from its ConfigMap, Secret and env."""
    env = dict(k8s("ConfigMap")["data"])
    env.update(k8s("Secret").get("stringData", {}))
    env.update({item["name"]: item["value"] for item in worker_container().get("env", [])})
    return env


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> OutboxSettings:
    """Settings as the worker would read them from exactly ``env``."""
    for key in list(os.environ):
        if key.upper().startswith(("OUTBOX_", "TEMPORAL_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return OutboxSettings()


def seconds(duration: str | int) -> float:
    """A compose duration (``40s``, ``1m30s``) in seconds."""
    if isinstance(duration, int):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(a + u for a, u in parts) == duration, duration
    return sum(float(amount) * units[unit] for amount, unit in parts)


def image_uid() -> tuple[int, int]:
    [user] = instruction("USER")
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


# -- Dockerfile ----------------------------------------------------------------------------------


def test_dockerfile_builds_a_slim_non_root_image_running_worker_py() -> None:
    args = {
        name: default
        for name, _, default in (a.partition("=") for word, a in dockerfile() if word == "ARG")
    }
    [base] = instruction("FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), base
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, base[7:].split("-")[0].split("."))) >= tuple(map(int, minimum.split(".")))
    uid, gid = image_uid()
    assert uid > 0 and gid > 0  # numeric, so that runAsNonRoot can check it
    assert json.loads(instruction("CMD")[-1]) == ["python", "worker.py"]
    assert instruction("STOPSIGNAL") == ["SIGTERM"]
    assert [int(p) for p in instruction("EXPOSE")] == [HEALTH_PORT]


def test_dockerfile_healthcheck_hits_the_liveness_endpoint() -> None:
    [check] = instruction("HEALTHCHECK")
    assert "CMD python -c" in check
    assert f"127.0.0.1:%s{LIVENESS_PATH}" in check
    assert f"os.environ.get('OUTBOX_HEALTH_PORT', '{HEALTH_PORT}')" in check
    [docker_timeout] = re.findall(r"--timeout=(\S+)", check)
    [request_timeout] = re.findall(r"timeout=(\d+)\)", check)
    assert seconds(docker_timeout) > float(request_timeout)


def test_dockerfile_copies_the_whole_package() -> None:
    copied = set()
    for args in instruction("COPY"):
        *sources, _ = shlex.split(args)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
            copied.add(source.rstrip("/"))
    setuptools = PYPROJECT["tool"]["setuptools"]
    wanted = {*setuptools["packages"], *(f"{m}.py" for m in setuptools["py-modules"])}
    assert wanted | {"pyproject.toml", "README.md"} <= copied
    ignored = {
        line.strip()
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not ignored & copied, "the build context leaves out what the image copies"


def test_dockerfile_env_names_are_settings() -> None:
    for args in instruction("ENV"):
        for name in re.findall(r"(\w+)=", args):
            if name.startswith(("OUTBOX_", "TEMPORAL_")):
                assert name in ENV_NAMES, f"ENV {name} is no setting"


# -- docker compose ----------------------------------------------------------------------------


def test_compose_services_and_images() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "temporal", "temporal-ui", "worker"}
    for name, service in services.items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag"
    assert services["temporal"]["image"].startswith("temporalio/auto-setup:")
    assert services["temporal-ui"]["image"].startswith("temporalio/ui:")
    assert services["postgres"]["image"].startswith("postgres:")
    # The outbox trigger needs PostgreSQL 14 or newer.
    [major] = re.findall(r"^postgres:(\d+)", services["postgres"]["image"])
    assert int(major) >= 14
    worker = services["worker"]
    assert (DEPLOY / worker["build"]["context"] / worker["build"]["dockerfile"]).resolve() == (
        DEPLOY / "Dockerfile"
    )
    assert worker["image"] == f"outbox-bridge:{VERSION}"


def test_compose_worker_env_is_valid_settings(monkeypatch) -> None:
    env = compose_env("worker")
    unknown = set(env) - set(ENV_NAMES)
    assert not unknown, f"not settings of OutboxSettings: {unknown}"
    settings = settings_from(env, monkeypatch)
    assert settings.database_url is not None and settings.temporal_address is not None
    app_from_settings(settings.demo, settings.app)  # runs out of the box (the demo app)


def test_compose_worker_reaches_postgres_and_temporal() -> None:
    services = compose()["services"]
    env = compose_env("worker")
    postgres = compose_env("postgres")
    url = make_url(env["OUTBOX_DATABASE_URL"])
    assert url.host == "postgres" and (url.port or 5432) == 5432
    assert (url.username, url.password, url.database) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        postgres["POSTGRES_DB"],
    )
    temporal = compose_env("temporal")
    assert temporal["DB"] == "postgres12"
    assert temporal["POSTGRES_SEEDS"] == "postgres"
    assert (temporal["POSTGRES_USER"], temporal["POSTGRES_PWD"]) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
    )
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert compose_env("temporal-ui")["TEMPORAL_ADDRESS"] == env["TEMPORAL_ADDRESS"]
    assert any(str(p).endswith(":7233") for p in services["temporal"]["ports"])
    for name in ("worker", "temporal", "temporal-ui"):
        for dependency, condition in services[name]["depends_on"].items():
            assert condition == {"condition": "service_healthy"}, name
            assert "healthcheck" in services[dependency], dependency
    assert set(services["worker"]["depends_on"]) == {"postgres", "temporal"}


def test_compose_worker_health_and_grace(monkeypatch) -> None:
    worker = compose()["services"]["worker"]
    settings = settings_from(compose_env("worker"), monkeypatch)
    assert settings.health_port == HEALTH_PORT
    published = {int(str(p).rsplit(":", 1)[1]) for p in worker["ports"]}
    assert published == {settings.health_port}
    check = " ".join(worker["healthcheck"]["test"])
    assert f"127.0.0.1:{settings.health_port}{LIVENESS_PATH}" in check
    # Docker kills a container when stop_grace_period runs out (10 s unless set).
    assert seconds(worker["stop_grace_period"]) > settings.shutdown_grace
    assert worker.get("init") is True  # signals reach the worker; children are reaped


# -- Kubernetes ------------------------------------------------------------------------------------


def test_k8s_manifests_parse_and_are_all_applied() -> None:
    documents = k8s_documents()
    kustomization = documents.pop("kustomization.yaml")
    assert [d["kind"] for d in kustomization] == ["Kustomization"]
    assert set(kustomization[0]["resources"]) == set(documents)
    for name, docs in documents.items():
        assert docs, name
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc), name
            assert doc["metadata"]["name"], name


def test_k8s_env_is_valid_settings(monkeypatch) -> None:
    config_map, secret = k8s("ConfigMap"), k8s("Secret")
    for source in (config_map["data"], secret["stringData"]):
        for key, value in source.items():
            assert key in ENV_NAMES, f"{key} is no setting of OutboxSettings"
            assert isinstance(value, str), f"{key}: Kubernetes wants a string; quote it"
    assert not SECRET_ENV & set(config_map["data"]), "secrets belong in the Secret"
    assert "OUTBOX_DATABASE_URL" in secret["stringData"]
    env_from = worker_container()["envFrom"]
    assert {"configMapRef": {"name": config_map["metadata"]["name"]}} in env_from
    assert {"secretRef": {"name": secret["metadata"]["name"]}} in env_from
    settings = settings_from(k8s_env(), monkeypatch)
    assert settings.database_url is not None and settings.temporal_address is not None
    assert settings.app


def test_k8s_probes_hit_the_health_endpoints(monkeypatch) -> None:
    settings = settings_from(k8s_env(), monkeypatch)
    assert settings.health_port == HEALTH_PORT
    assert settings.health_host == "0.0.0.0"  # the kubelet probes the pod's address
    container = worker_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("livenessProbe", LIVENESS_PATH), ("readinessProbe", READINESS_PATH)):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert port == settings.health_port, probe
    assert container["readinessProbe"]["timeoutSeconds"] > CHECK_TIMEOUT


def test_k8s_worker_stops_gracefully_and_runs_unprivileged(monkeypatch) -> None:
    settings = settings_from(k8s_env(), monkeypatch)
    deployment = k8s("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace
    assert pod["securityContext"]["runAsNonRoot"] is True
    uid, gid = image_uid()
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        uid,
        gid,
    )
    container = worker_container()
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), kind
    assert container["image"] == compose()["services"]["worker"]["image"]


def test_k8s_selectors_and_disruption_budget() -> None:
    deployment, budget = k8s("Deployment"), k8s("PodDisruptionBudget")
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"] == selector
    assert deployment["spec"]["replicas"] >= 2
    assert budget["spec"].get("maxUnavailable", 0) < deployment["spec"]["replicas"]


# -- README ----------------------------------------------------------------------------------------


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_readme_registers_every_search_attribute() -> None:
    pairs = re.findall(r"--name (\w+) --type (\w+)", readme_section("Deploying"))
    assert dict(pairs) == SEARCH_ATTRIBUTES
    assert len(pairs) == len(SEARCH_ATTRIBUTES)


def test_readme_documents_the_deployment_settings() -> None:
    table = readme_section("Running against real servers")
    for name in ("health_port", "health_host", "shutdown_grace"):
        field = FIELDS[name]
        default = field.default if not isinstance(field.default, float) else f"{field.default:g}"
        row = f"| `--{name.replace('_', '-')}` | `{env_name(name, field)}` | `{default}` |"
        assert row in table, row
    deploying = readme_section("Deploying")
    assert LIVENESS_PATH in deploying and READINESS_PATH in deploying
    assert "### Temporal Cloud" in deploying
    for variable in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY"):
        assert f"`{variable}`" in deploying, variable
    assert "`TEMPORAL_TLS_CERT`, `TEMPORAL_TLS_KEY`" in deploying
