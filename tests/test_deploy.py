"""The deployment files in ``deploy/`` agree with the code: every environment variable is a
setting of ``OutboxSettings`` with a valid value, probes and scrapes hit the paths and ports that
the worker serves, grace periods outlast ``shutdown_grace``, images, users and commands match,
Temporal's setup jobs register every search attribute of the shard workflows.

No container engine or cluster is needed: the files are parsed and cross-checked, and the
Temporal setup scripts are run with stand-ins for the tools of the admin-tools image.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from graphlib import TopologicalSorter
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import SecretStr
from sqlalchemy.engine import make_url
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.common import SearchAttributeKey

import outbox_bridge.workflows.models
from outbox_bridge.cli import main as cli
from outbox_bridge.cli.connections import command_app
from outbox_bridge.config import OutboxSettings, env_name, env_names
from outbox_bridge.dev.embedded import temporal_cli
from outbox_bridge.observability.health import CHECK_TIMEOUT, LIVENESS_PATH, READINESS_PATH
from outbox_bridge.runtime.temporal import SEARCH_ATTRIBUTES
from tests.support import clear_settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
FIELDS = OutboxSettings.model_fields
ENV_NAMES = {env: name for name, field in FIELDS.items() for env in env_names(name, field)}
SECRET_ENV = {env_name(n, f) for n, f in FIELDS.items() if SecretStr in get_args(f.annotation)}
HEALTH_PORT = FIELDS["health_port"].default
METRICS_PORT = FIELDS["metrics_port"].default
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
CLI_NAME = "outbox-bridge"
# The `worker` subcommand is being added to the CLI; until it is there, the check that the
# image's command exists skips that one command (and only it).
PENDING_SUBCOMMANDS = {"worker"}
# The search attribute types `temporal operator search-attribute create --type` takes.
CLI_ATTRIBUTE_TYPES = {"Text", "Keyword", "Int", "Double", "Bool", "Datetime", "KeywordList"}


# -- reading the files -------------------------------------------------------------------------


@dataclass
class Stage:
    name: str | None
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def get(self, name: str) -> list[str]:
        return [args for word, args in self.instructions if word == name]

    def text(self) -> str:
        return "\n".join(f"{word} {args}" for word, args in self.instructions)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    instructions = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), " ".join(rest.split())))
    return instructions


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults."""
    args = {}
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            break
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def stages() -> list[Stage]:
    found: list[Stage] = []
    args = global_args()
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            parts = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            found.append(Stage(name, base))
        elif found:
            found[-1].instructions.append((word, rest))
    return found


def runtime_stage() -> Stage:
    return stages()[-1]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"write {args} in exec form (a JSON list)"
    return value


def image_command() -> list[str]:
    """What the image runs with no arguments: ENTRYPOINT + CMD of the final stage."""
    runtime = runtime_stage()
    entrypoint = [exec_form(a) for a in runtime.get("ENTRYPOINT")]
    cmd = [exec_form(a) for a in runtime.get("CMD")]
    return (entrypoint[-1] if entrypoint else []) + (cmd[-1] if cmd else [])


def image_uid() -> tuple[int, int]:
    [user] = runtime_stage().get("USER")
    uid, _, gid = user.partition(":")
    return int(uid), int(gid or uid)


def image_env() -> dict[str, str]:
    env = {}
    for args in runtime_stage().get("ENV"):
        env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def dockerignore() -> list[str]:
    lines = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str) -> bool:
    """Whether the build context leaves ``path`` (relative to the root) out."""
    parts = path.split("/")
    for pattern in dockerignore():
        pattern = pattern.strip("/")
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:n]), pattern) for n in range(1, len(parts) + 1)):
            return True
    return False


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return loaded


def services() -> dict[str, Any]:
    found: dict[str, Any] = compose()["services"]
    return found


def interpolate(value: Any) -> str:
    """Compose's ``${NAME:-default}`` / ``${NAME}`` with nothing set: the defaults."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", str(value))


def compose_env(service: str) -> dict[str, str]:
    env = services()[service].get("environment", {})
    assert isinstance(env, dict), f"{service}: write environment as a mapping"
    return {key: interpolate(value) for key, value in env.items()}


def mounts(service: str) -> dict[str, Path]:
    """Bind mounts of a compose service: container path -> file in the repository."""
    found = {}
    for volume in services()[service].get("volumes", []):
        source, target, *options = str(volume).split(":")
        if source.startswith("."):
            assert options == ["ro"], f"{service}: mount {source} read-only"
            found[target] = (DEPLOY / source).resolve()
    return found


def job_script(service: str) -> Path:
    """The script a one-shot compose job runs, as a file of the repository."""
    entrypoint = services()[service]["entrypoint"]
    assert entrypoint[:1] == ["/bin/sh"] and len(entrypoint) == 2, entrypoint
    script = mounts(service)[entrypoint[1]]
    assert script.is_file() and script.is_relative_to(DEPLOY), script
    return script


def k8s_documents() -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
        for path in sorted(K8S.glob("*.yaml"))
    }


def k8s(kind: str) -> dict[str, Any]:
    found = [doc for docs in k8s_documents().values() for doc in docs if doc.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def kustomization() -> dict[str, Any]:
    [doc] = k8s_documents()["kustomization.yaml"]
    return doc


def pod_spec(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = k8s(kind)["spec"]["template"]["spec"]
    return spec


def container(kind: str) -> dict[str, Any]:
    containers = pod_spec(kind)["containers"]
    assert len(containers) == 1, kind
    result: dict[str, Any] = containers[0]
    return result


def secret_command() -> list[str]:
    """The ``kubectl create secret generic`` command that deploy/k8s/README.md documents."""
    text = (K8S / "README.md").read_text()
    commands = re.findall(r"^kubectl create secret generic .*?(?<!\\)$", text, re.M | re.S)
    assert commands, "deploy/k8s/README.md shows how to create the Secret"
    words = shlex.split(max(commands, key=len).replace("\\\n", " "))
    return words


def secret_literals() -> dict[str, str]:
    words = secret_command()
    literals = [w.removeprefix("--from-literal=") for w in words if w.startswith("--from-literal=")]
    return dict(literal.split("=", 1) for literal in literals)


def k8s_env() -> dict[str, str]:
    """The environment the worker gets from its ConfigMap, the documented Secret, and env."""
    env = dict(k8s("ConfigMap")["data"])
    env.update(secret_literals())
    env.update({item["name"]: item["value"] for item in container("Deployment").get("env", [])})
    return env


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> OutboxSettings:
    """Settings as the worker would read them from exactly ``env``."""
    clear_settings(monkeypatch)
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


def model_search_attributes() -> dict[str, str]:
    """Every SearchAttributeKey that workflows/models.py defines: name -> CLI type name."""
    found = {}
    for value in vars(outbox_bridge.workflows.models).values():
        if isinstance(value, SearchAttributeKey):
            enum = IndexedValueType.Name(IndexedValueType.ValueType(value.indexed_value_type))
            words = enum.removeprefix("INDEXED_VALUE_TYPE_").split("_")
            found[value.name] = "".join(word.title() for word in words)
    return found


def image_tag(image: str) -> tuple[int, ...]:
    repository, _, tag = image.rpartition(":")
    assert re.fullmatch(r"\d+\.\d+\.\d+", tag), f"{repository}: pin a release tag, not {tag}"
    return tuple(map(int, tag.split(".")))


# -- Dockerfile ----------------------------------------------------------------------------------


def test_dockerfile_builds_in_stages_on_slim_python() -> None:
    found = stages()
    assert len(found) >= 2, "a builder stage and a runtime stage"
    names = [stage.name for stage in found]
    assert "builder" in names and found[-1].name not in (None, "builder"), names
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    for stage in found:
        assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", stage.base), stage.base
        version = tuple(map(int, stage.base[7:].split("-")[0].split(".")))
        assert version >= tuple(map(int, minimum.split("."))), stage.base
    # Both stages on one Python: the wheels built for one install on the other.
    assert len({stage.base for stage in found}) == 1
    builder = found[names.index("builder")]
    assert any(re.search(r"\bpip wheel\b.* \.$", run) for run in builder.get("RUN")), (
        "the builder builds the wheel of the package in its build context"
    )


def test_dockerfile_runtime_installs_plain_outbox_bridge_from_the_wheel() -> None:
    runtime = runtime_stage()
    installs = [run for run in runtime.get("RUN") if "pip install" in run]
    assert len(installs) == 1, installs
    [install] = installs
    assert "--mount=type=bind,from=builder" in install, "the wheels come from the builder"
    assert "--no-index" in install, "nothing is fetched in the runtime stage"
    [target] = re.findall(r"pip install .*?(\S+)$", install)
    assert re.fullmatch(r"/\S+/outbox_bridge-\*\.whl", target), target  # the wheel, no [extra]
    text = runtime.text()
    for extra in [*PYPROJECT["project"].get("optional-dependencies", {}), "embedded"]:
        assert f"[{extra}]" not in text, f"the runtime image installs the {extra} extra"
    assert "embedded" not in text.lower()
    # No build tools, no sources: the package arrives as the wheel only.
    for tool in ("apt-get", "apk ", "gcc", "build-essential", "pip wheel", "setup.py"):
        assert tool not in text, f"{tool} in the runtime stage"
    for copy in runtime.get("COPY"):
        assert "--from=builder" in copy, f"COPY {copy}: the runtime stage copies no sources"
    assert "worker.py" not in text


def test_dockerfile_runs_the_outbox_bridge_worker_as_non_root() -> None:
    assert image_command() == [CLI_NAME, "worker"]
    [entrypoint] = runtime_stage().get("ENTRYPOINT")
    assert exec_form(entrypoint) == [CLI_NAME], "`docker run IMAGE init-db` runs that command"
    assert CLI_NAME in PYPROJECT["project"]["scripts"]
    uid, gid = image_uid()
    assert uid > 0 and gid > 0  # numeric, so that runAsNonRoot can check it
    assert runtime_stage().get("STOPSIGNAL") == ["SIGTERM"]
    exposed = {int(port) for args in runtime_stage().get("EXPOSE") for port in args.split()}
    assert exposed == {HEALTH_PORT, METRICS_PORT}


def test_dockerfile_healthcheck_hits_the_liveness_endpoint() -> None:
    [check] = runtime_stage().get("HEALTHCHECK")
    options, _, command = check.partition(" CMD ")
    python, flag, code = exec_form(command)
    assert (python, flag) == ("python", "-c")
    assert f"127.0.0.1:%s{LIVENESS_PATH}" in code
    assert f"os.environ.get('OUTBOX_HEALTH_PORT', '{HEALTH_PORT}')" in code
    [docker_timeout] = re.findall(r"--timeout=(\S+)", options)
    [request_timeout] = re.findall(r"timeout=(\d+)\)", code)
    assert seconds(docker_timeout) > float(request_timeout)


def test_docker_build_context_holds_the_package_and_nothing_else() -> None:
    copies = [shlex.split(args) for stage in stages() for args in stage.get("COPY")]
    for *sources, _ in (c for c in copies if not c[0].startswith("--from")):
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
    # The package, and the folders pyproject.toml maps into it (workflows/, activities/).
    folders = list(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert folders, "pyproject.toml maps workflows/ and activities/ into outbox_bridge"
    needed = ["outbox_bridge", *folders]
    for path in [*needed, "pyproject.toml", PYPROJECT["project"]["readme"]]:
        assert (ROOT / path).exists(), path
        assert not ignored(path), f"the build context leaves out {path}, which the wheel needs"
    for path in (".git", ".venv", "tests", "bench", "deploy", "deploy/k8s/secret.env", ".env"):
        assert ignored(path), f"the build context should leave out {path}"
    assert ignored("outbox_bridge/__pycache__/cli.cpython-311.pyc")


def test_dockerfile_env_is_valid_settings(monkeypatch) -> None:
    for stage in stages():
        for args in stage.get("ENV"):
            for name in re.findall(r"(\w+)=", args):
                if name.startswith(("OUTBOX_", "TEMPORAL_")):
                    assert name in ENV_NAMES, f"ENV {name} is no setting"
    settings = settings_from(image_env(), monkeypatch)
    assert settings.metrics_exporter == "prometheus"
    assert settings.metrics_port == METRICS_PORT


def test_endpoints_listen_on_this_host_unless_the_image_or_configmap_says_otherwise(
    monkeypatch,
) -> None:
    """Outside a container, nothing of the worker listens beyond the host: the image and the
    ConfigMap open both endpoints to the container's network themselves."""
    assert FIELDS["health_host"].default == FIELDS["metrics_host"].default == "127.0.0.1"
    for env in (image_env(), k8s_env()):
        settings = settings_from(env, monkeypatch)
        assert (settings.health_host, settings.metrics_host) == ("0.0.0.0", "0.0.0.0")
    # The Compose worker runs the image: its published ports reach the endpoints.
    worker_env = services()["worker"].get("environment", {})
    assert not {"OUTBOX_HEALTH_HOST", "OUTBOX_METRICS_HOST"} & set(worker_env)


def test_deploy_files_run_commands_of_the_cli() -> None:
    """The subcommands the image, the Compose worker and the Kubernetes Job run exist."""
    used = {image_command()[1]}
    worker = services()["worker"]
    assert "entrypoint" not in worker, "the worker runs the image's entrypoint"
    used.update(worker.get("command", []))
    for kind in ("Deployment", "Job"):
        spec = container(kind)
        command = spec.get("command", image_command()[:1]) + spec.get("args", [])
        if command:
            assert command[0] == CLI_NAME, f"{kind}: {command}"
            used.update(command[1:2])
    assert "init-db" in used
    missing = used - set(cli.commands)
    if missing and missing <= PENDING_SUBCOMMANDS:
        pytest.skip(f"not yet a command of {CLI_NAME}: {', '.join(sorted(missing))}")
    assert not missing, f"not commands of {CLI_NAME}: {missing}"


# -- docker compose: the Temporal server and its setup jobs ----------------------------------


def test_compose_runs_the_temporal_release_the_suite_tests_against() -> None:
    """The server and UI tags are at least those of the dev server the tests run on (the
    ``temporal`` CLI of the dev extra): a newer CLI in the extra asks for a newer stack."""
    version = subprocess.run(
        [temporal_cli(), "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    [(server, ui)] = re.findall(r"Server (\d+\.\d+\.\d+), UI (\d+\.\d+\.\d+)", version)
    found = services()
    assert image_tag(found["temporal"]["image"]) >= image_tag(f"cli:{server}"), version
    assert image_tag(found["temporal-ui"]["image"]) >= image_tag(f"cli:{ui}"), version


def test_compose_services_and_images() -> None:
    found = services()
    assert set(found) == {
        "postgres",
        "temporal-setup-schema",
        "temporal",
        "temporal-create-namespace",
        "temporal-ui",
        "outbox-init-db",
        "worker",
    }
    for name, service in found.items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag"
        assert "auto-setup" not in image, f"{name}: temporalio/auto-setup is deprecated"
    server = found["temporal"]["image"]
    assert server.startswith("temporalio/server:")
    assert (1, 20) <= image_tag(server)[:2] < (2, 0), server
    for job in ("temporal-setup-schema", "temporal-create-namespace"):
        tools = found[job]["image"]
        assert tools.startswith("temporalio/admin-tools:"), job
        # The schema the tools write is the one that server version expects.
        assert image_tag(tools) == image_tag(server), f"{job}: use the server's tag"
    assert found["temporal-ui"]["image"].startswith("temporalio/ui:")
    image_tag(found["temporal-ui"]["image"])
    assert found["postgres"]["image"].startswith("postgres:")
    # The outbox trigger needs PostgreSQL 14 or newer.
    [major] = re.findall(r"^postgres:(\d+)", found["postgres"]["image"])
    assert int(major) >= 14
    worker = found["worker"]
    assert (DEPLOY / worker["build"]["context"] / worker["build"]["dockerfile"]).resolve() == (
        DEPLOY / "Dockerfile"
    )
    assert worker["image"] == f"{CLI_NAME}:{VERSION}"
    init_db = found["outbox-init-db"]
    assert (init_db["image"], init_db["build"]) == (worker["image"], worker["build"])
    assert init_db["command"] == ["init-db"]
    same = ("OUTBOX_DATABASE_URL", "OUTBOX_DEMO")
    assert [compose_env("outbox-init-db")[k] for k in same] == [
        compose_env("worker")[k] for k in same
    ]


def test_compose_start_order() -> None:
    found = services()
    graph = {name: set(service.get("depends_on", {})) for name, service in found.items()}
    for name, service in found.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in found, f"{name} depends on unknown {dependency}"
            condition = condition["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in found[dependency], dependency
            else:
                assert condition == "service_completed_successfully", (name, dependency)
                one_shot = found[dependency]
                assert one_shot.get("restart", "no") == "no", f"{dependency} runs once"
                assert "healthcheck" not in one_shot and "ports" not in one_shot, dependency
    order = list(TopologicalSorter(graph).static_order())  # raises on a cycle

    def waits_for(name: str, dependency: str, condition: str) -> None:
        assert found[name]["depends_on"][dependency] == {"condition": condition}, name
        assert order.index(dependency) < order.index(name)

    waits_for("temporal-setup-schema", "postgres", "service_healthy")
    waits_for("temporal", "temporal-setup-schema", "service_completed_successfully")
    waits_for("temporal-create-namespace", "temporal", "service_healthy")
    waits_for("temporal-ui", "temporal", "service_healthy")
    waits_for("worker", "postgres", "service_healthy")
    waits_for("worker", "temporal", "service_healthy")
    waits_for("worker", "temporal-create-namespace", "service_completed_successfully")
    waits_for("outbox-init-db", "postgres", "service_healthy")
    waits_for("worker", "outbox-init-db", "service_completed_successfully")


def test_compose_temporal_server_on_postgres_with_dynamic_config() -> None:
    postgres = compose_env("postgres")
    server = compose_env("temporal")
    assert server["DB"] == "postgres12"
    assert server["POSTGRES_SEEDS"] == "postgres" and server["DB_PORT"] == "5432"
    assert (server["POSTGRES_USER"], server["POSTGRES_PWD"]) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
    )
    assert server["BIND_ON_IP"] == "0.0.0.0"
    assert any(str(p).endswith(":7233") for p in services()["temporal"]["ports"])
    dynamic = mounts("temporal")[server["DYNAMIC_CONFIG_FILE_PATH"]]
    assert dynamic.is_relative_to(DEPLOY) and dynamic.is_file()
    config = yaml.safe_load(dynamic.read_text())
    assert config, "the dynamic config sets something"
    for key, values in config.items():
        assert re.fullmatch(r"[a-z]+\.\w+", key), key
        for value in values:
            assert set(value) <= {"value", "constraints"} and "value" in value, key
    assert config["limit.maxIDLength"] == [{"value": 255, "constraints": {}}]


def fake_tool(bin_dir: Path, name: str, log: Path, fail_on: str = "") -> None:
    """A stand-in for a tool of the admin-tools image: records its arguments, one line a call."""
    script = bin_dir / name
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "{name} $*" >> "{log}"\n'
        f'case "$*" in {fail_on or "__never__"}) exit 1;; esac\n'
    )
    script.chmod(0o755)


def run_job(service: str, tmp_path: Path, env: dict[str, str]) -> list[str]:
    """Run a compose job's script with the tools faked; the tool calls it made, in order."""
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX shell")
    log = tmp_path / "calls"
    log.touch()
    for tool in ("temporal-sql-tool", "temporal"):
        fake_tool(tmp_path, tool, log, fail_on="*'namespace describe'*")
    result = subprocess.run(
        [sh, str(job_script(service))],
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return log.read_text().splitlines()


def test_compose_schema_job_sets_up_both_temporal_databases(tmp_path: Path) -> None:
    postgres = compose_env("postgres")
    server = compose_env("temporal")
    job = compose_env("temporal-setup-schema")
    assert job["SQL_HOST"] == server["POSTGRES_SEEDS"]
    assert job["SQL_PORT"] == server["DB_PORT"]
    assert (job["SQL_USER"], job["SQL_PASSWORD"]) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
    )
    calls = run_job("temporal-setup-schema", tmp_path, job)
    databases = {
        server.get("DBNAME", "temporal"): "temporal",
        server.get("VISIBILITY_DBNAME", "temporal_visibility"): "visibility",
    }
    assert set(databases) == {"temporal", "temporal_visibility"}
    for database, schema in databases.items():
        tool = f"temporal-sql-tool --plugin {server['DB']} --db {database}"
        assert [c.removeprefix(tool + " ") for c in calls if c.startswith(tool + " ")] == [
            "create",
            "setup-schema -v 0.0",
            f"update-schema -d /etc/temporal/schema/postgresql/v12/{schema}/versioned",
        ], calls
    # The server must not create its own schema: the job has, before it starts.
    assert "SKIP_SCHEMA_SETUP" not in server and "AUTO_SETUP" not in json.dumps(server)


def test_compose_namespace_job_registers_every_search_attribute(tmp_path: Path) -> None:
    expected = model_search_attributes()
    assert expected, "workflows/models.py defines the search attributes"
    assert expected == SEARCH_ATTRIBUTES, "the worker registers what workflows/models.py defines"
    assert set(expected.values()) <= CLI_ATTRIBUTE_TYPES
    job = compose_env("temporal-create-namespace")
    worker = compose_env("worker")
    assert job["TEMPORAL_ADDRESS"] == worker["TEMPORAL_ADDRESS"]
    assert job["TEMPORAL_NAMESPACE"] == worker["TEMPORAL_NAMESPACE"]
    calls = run_job("temporal-create-namespace", tmp_path, job)
    namespace = job["TEMPORAL_NAMESPACE"]
    assert f"temporal operator namespace create --namespace {namespace} --retention 72h" in calls
    [create] = [c for c in calls if c.startswith("temporal operator search-attribute create")]
    words = create.split()
    assert words[words.index("--namespace") + 1] == namespace
    pairs = re.findall(r"--name (\S+) --type (\S+)", create)
    assert dict(pairs) == expected and len(pairs) == len(expected), create
    # The server must be up before the namespace is created, and that before the attributes.
    health = calls.index("temporal operator cluster health")
    assert health < calls.index(create)


# -- docker compose: the worker ------------------------------------------------------------------


def test_compose_worker_env_is_valid_settings(monkeypatch) -> None:
    env = compose_env("worker")
    unknown = set(env) - set(ENV_NAMES)
    assert not unknown, f"not settings of OutboxSettings: {unknown}"
    settings = settings_from(env, monkeypatch)
    assert settings.database_url is not None and settings.temporal_address is not None
    command_app(settings)  # runs out of the box (the demo app)


def test_compose_worker_reaches_postgres_and_temporal() -> None:
    env = compose_env("worker")
    postgres = compose_env("postgres")
    url = make_url(env["OUTBOX_DATABASE_URL"])
    assert url.host == "postgres" and (url.port or 5432) == 5432
    assert (url.username, url.password, url.database) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        postgres["POSTGRES_DB"],
    )
    assert env["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert compose_env("temporal-ui")["TEMPORAL_ADDRESS"] == env["TEMPORAL_ADDRESS"]


def test_compose_worker_health_metrics_and_grace(monkeypatch) -> None:
    worker = services()["worker"]
    settings = settings_from(compose_env("worker"), monkeypatch)
    assert settings.health_port == HEALTH_PORT
    assert (settings.metrics_exporter, settings.metrics_port) == ("prometheus", METRICS_PORT)
    published = {int(str(p).rsplit(":", 1)[1]) for p in worker["ports"]}
    assert published == {settings.health_port, settings.metrics_port}
    check = " ".join(worker["healthcheck"]["test"])
    assert f"127.0.0.1:{settings.health_port}{LIVENESS_PATH}" in check
    # Docker kills a container when stop_grace_period runs out (10 s unless set).
    assert seconds(worker["stop_grace_period"]) > settings.shutdown_grace
    assert worker.get("init") is True  # signals reach the worker; children are reaped


# -- Kubernetes ------------------------------------------------------------------------------------


def test_k8s_manifests_parse_and_are_all_applied() -> None:
    documents = k8s_documents()
    documents.pop("kustomization.yaml")
    config = kustomization()
    assert config["kind"] == "Kustomization"
    assert set(config["resources"]) == set(documents)
    for name, docs in documents.items():
        assert docs, name
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc), name
            assert doc["metadata"]["name"], name
    kinds = [doc["kind"] for name in config["resources"] for doc in documents[name]]
    assert kinds.count("Job") == 1 and kinds.count("Deployment") == 1
    # The Job is applied before the workers, in the order listed.
    assert config["sortOptions"] == {"order": "fifo"}
    assert kinds.index("Job") < kinds.index("Deployment")


def test_k8s_has_no_secret_in_the_repository() -> None:
    config = kustomization()
    kinds = {doc["kind"] for docs in k8s_documents().values() for doc in docs}
    assert "Secret" not in kinds, "no Secret manifest, not even with placeholders"
    assert "secretGenerator" not in config
    assert not (K8S / "secret.yaml").exists()
    # Every pod reads the Secret that the README tells how to create.
    words = secret_command()
    name = words[words.index("generic") + 1]
    for kind in ("Deployment", "Job"):
        assert {"secretRef": {"name": name}} in container(kind)["envFrom"], kind
    literals = secret_literals()
    assert "OUTBOX_DATABASE_URL" in literals
    assert set(literals) <= SECRET_ENV, "the Secret holds the secret settings only"


def test_k8s_env_is_valid_settings(monkeypatch) -> None:
    config_map = k8s("ConfigMap")
    for key, value in config_map["data"].items():
        assert key in ENV_NAMES, f"{key} is no setting of OutboxSettings"
        assert isinstance(value, str), f"{key}: Kubernetes wants a string; quote it"
    assert not SECRET_ENV & set(config_map["data"]), "secrets belong in the Secret"
    for kind in ("Deployment", "Job"):
        env_from = container(kind)["envFrom"]
        assert {"configMapRef": {"name": config_map["metadata"]["name"]}} in env_from, kind
    settings = settings_from(k8s_env(), monkeypatch)
    assert settings.database_url is not None and settings.temporal_address is not None
    assert settings.app


def test_k8s_init_db_job_runs_before_the_workers_with_their_image() -> None:
    job = k8s("Job")
    spec = job["spec"]
    init = container("Job")
    assert init["command"] == [CLI_NAME, "init-db"]
    assert "init-db" in cli.commands
    assert init["image"] == container("Deployment")["image"]
    assert init["envFrom"] == container("Deployment")["envFrom"]
    assert pod_spec("Job")["restartPolicy"] in ("Never", "OnFailure")
    assert 0 < spec["backoffLimit"] <= 10
    assert spec["activeDeadlineSeconds"] > 0
    # A finished Job goes away, so that the next apply can create it again with a new image.
    assert 0 < spec["ttlSecondsAfterFinished"]
    # Not one of the workers: the budget and the spread count workers only.
    selector = k8s("Deployment")["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()


def test_k8s_probes_hit_the_health_endpoints(monkeypatch) -> None:
    settings = settings_from(k8s_env(), monkeypatch)
    assert settings.health_port == HEALTH_PORT
    assert settings.health_host == "0.0.0.0"  # the kubelet probes the pod's address
    worker = container("Deployment")
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    for probe, path in (("livenessProbe", LIVENESS_PATH), ("readinessProbe", READINESS_PATH)):
        get = worker[probe]["httpGet"]
        assert get["path"] == path, probe
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert port == settings.health_port, probe
    assert worker["readinessProbe"]["timeoutSeconds"] > CHECK_TIMEOUT


def test_k8s_exposes_the_metrics_port(monkeypatch) -> None:
    settings = settings_from(k8s_env(), monkeypatch)
    assert (settings.metrics_exporter, settings.metrics_port) == ("prometheus", METRICS_PORT)
    assert settings.metrics_host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container("Deployment")["ports"]}
    assert ports["metrics"] == settings.metrics_port
    assert ports["health"] != ports["metrics"]
    annotations = k8s("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(settings.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_k8s_pods_run_unprivileged_on_a_read_only_root(kind: str) -> None:
    pod = pod_spec(kind)
    assert pod["securityContext"]["runAsNonRoot"] is True
    uid, gid = image_uid()
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (
        uid,
        gid,
    )
    assert pod["automountServiceAccountToken"] is False
    spec = container(kind)
    security = spec["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    for resources in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(spec["resources"][resources]), resources
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    writable = {m["mountPath"]: volumes[m["name"]] for m in spec["volumeMounts"]}
    assert "emptyDir" in writable["/tmp"], "the one writable place is an emptyDir"
    assert spec["image"] == services()["worker"]["image"]


def test_k8s_worker_stops_gracefully(monkeypatch) -> None:
    settings = settings_from(k8s_env(), monkeypatch)
    pod = pod_spec("Deployment")
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace


def test_k8s_workers_spread_over_nodes_and_zones() -> None:
    deployment = k8s("Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    constraints = {c["topologyKey"]: c for c in pod_spec("Deployment")["topologySpreadConstraints"]}
    assert set(constraints) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for constraint in constraints.values():
        assert constraint["labelSelector"]["matchLabels"] == selector
        assert constraint["maxSkew"] == 1
    # Nodes without a zone label, or one zone only, must not keep workers from starting.
    assert constraints["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"


def test_k8s_selectors_and_disruption_budget() -> None:
    deployment, budget = k8s("Deployment"), k8s("PodDisruptionBudget")
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"] == selector
    replicas = deployment["spec"]["replicas"]
    assert replicas >= 2
    # A drain can always make progress: one ready worker at a time, unready ones at any time.
    assert "minAvailable" not in budget["spec"]
    assert 1 <= budget["spec"]["maxUnavailable"] < replicas
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_k8s_readme_describes_every_manifest() -> None:
    text = (K8S / "README.md").read_text()
    for name in [*kustomization()["resources"], "kustomization.yaml"]:
        assert f"| `{name}` |" in text, f"deploy/k8s/README.md: a row for {name}"
    assert "secret.yaml" not in text


# -- the documentation -----------------------------------------------------------------------------


def docs_page(path: str) -> str:
    return (ROOT / "docs" / path).read_text()


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(lambda: docs_page("how-to/deploy.md"), id="docs/how-to/deploy"),
        pytest.param(lambda: (K8S / "README.md").read_text(), id="deploy/k8s/README"),
    ],
)
def test_docs_register_every_search_attribute(text) -> None:
    pairs = re.findall(r"--name (\w+) --type (\w+)", text())
    assert dict(pairs) == model_search_attributes()
    assert len(pairs) == len(model_search_attributes())


def test_docs_document_the_deployment_settings() -> None:
    deploying = docs_page("how-to/deploy.md")
    for name in ("health_port", "health_host", "shutdown_grace"):
        field = FIELDS[name]
        default = field.default if not isinstance(field.default, float) else f"{field.default:g}"
        row = f"| `--{name.replace('_', '-')}` | `{env_name(name, field)}` | `{default}` |"
        assert row in deploying, row
    assert LIVENESS_PATH in deploying and READINESS_PATH in deploying
    assert "(temporal-cloud.md)" in deploying
    cloud = docs_page("how-to/temporal-cloud.md")
    assert cloud.startswith("# Temporal Cloud\n")
    for variable in ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY"):
        assert f"`{variable}`" in cloud, variable
    assert "`TEMPORAL_TLS_CERT`, `TEMPORAL_TLS_KEY`" in cloud
    assert "auto-setup" not in deploying
