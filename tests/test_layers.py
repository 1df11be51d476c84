"""The package's imports run one way (see CONTRIBUTING.md, "Layers"): read from the source with
``ast``, and checked in a fresh interpreter for what writing a row loads."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from scripts.packages import folder_packages

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "outbox_bridge"

# The Django integration's modules that a Django project loads to write rows (its settings, its
# models' modules, its migrations, its views): the producer's side, like the modules below.
DJANGO_PRODUCER_SIDE = (
    "admin",  # the package only, which Django's admin imports; its app is the worker's side
    "apps",
    "checks",
    "conf",
    "handlers",
    "models",
    "operations",
    "tables",
    "writes",
    "management.commands.flush",
    "management.commands.sqlflush",
)

# What an application that writes rows may load, and nothing more: the registry and what it
# stands on. Never the worker's side (runtime, cli, flush, the SDK setup, logs, health).
PRODUCER_SIDE = frozenset(
    {
        "outbox_bridge.config",
        "outbox_bridge.db.catalog",  # what the migrations' upgrades read and plan
        "outbox_bridge.db.install",
        "outbox_bridge.db.limits",  # the registry parses a handler's rate_limit with it
        "outbox_bridge.db.migrations",
        "outbox_bridge.db.schema",
        "outbox_bridge.declarations",
        "outbox_bridge.errors",
        "outbox_bridge.identifiers",
        "outbox_bridge.observability.metrics",
        "outbox_bridge.observability.telemetry",
        "outbox_bridge.observability.producer_spans",
        "outbox_bridge.orm",
        "outbox_bridge.producer",
        "outbox_bridge.registry",
        "outbox_bridge.sessions",
        "outbox_bridge.workflows.models",
    }
    | {f"outbox_bridge.contrib.django.{name}" for name in DJANGO_PRODUCER_SIDE}
)
# Third-party modules the worker needs and a producer must not load.
WORKER_ONLY_DEPENDENCIES = (
    "opentelemetry.sdk",
    "temporalio.client",
    "temporalio.worker",
    "prometheus_client",
    "rich",
    "structlog",
    "click",
)


@dataclass
class Module:
    name: str
    imports: set[str] = field(default_factory=set)  # outbox_bridge modules, run at import
    lazy: set[str] = field(default_factory=set)  # outbox_bridge modules imported in functions


def _source_files() -> Iterator[tuple[str, Path]]:
    """Every module of the package and its file, named as the wheel installs it: the folders
    pyproject.toml maps (workflows/, activities/) are subpackages of outbox_bridge."""
    roots = {ROOT / folder: package for folder, package in folder_packages().items()}
    for root, package in {PACKAGE: "outbox_bridge", **roots}.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def _targets(node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level or node.module is None:
        raise AssertionError(f"relative import at line {node.lineno}: use absolute imports")
    found = set()
    for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        if submodule in known:
            found.add(submodule)
        elif node.module in known:
            found.add(node.module)
    return found


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _collect(tree: ast.AST, module: Module, known: set[str], in_function: bool) -> None:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for other in node.orelse:
                _collect(other, module, known, in_function)
            continue  # annotations only: never run
        if isinstance(node, ast.Import | ast.ImportFrom):
            (module.lazy if in_function else module.imports).update(_targets(node, known))
        nested = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        _collect(node, module, known, nested)


def import_graph() -> dict[str, Module]:
    paths = dict(_source_files())
    known = set(paths)
    graph = {}
    for name, path in paths.items():
        module = Module(name)
        _collect(ast.parse(path.read_text(), str(path)), module, known, in_function=False)
        module.imports.discard(name)
        graph[name] = module
    return graph


GRAPH = import_graph()


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += GRAPH[name].imports | GRAPH[name].lazy
    return seen


def in_package(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_the_graph_covers_the_package() -> None:
    assert {"outbox_bridge.registry", "outbox_bridge.runtime.shard_drain"} <= set(GRAPH)
    assert "outbox_bridge.workflows.shard" in GRAPH  # through the link
    assert "outbox_bridge.db.schema" in GRAPH["outbox_bridge.registry"].imports


def test_no_import_cycle() -> None:
    sorter = TopologicalSorter({m.name: m.imports | m.lazy for m in GRAPH.values()})
    try:
        sorter.prepare()
    except CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_no_import_inside_functions() -> None:
    """Lazy imports of the package's own modules hide cycles (test_no_import_cycle counts them
    all the same); a heavy or optional third-party dependency may still be imported where it is
    used (say why in a comment). The exceptions load where starting light matters: the pytest
    plugin, which pytest loads in every run (its fixtures import the worker's side when a test
    uses them), and the command line, whose tools start without the worker's runtime, the demo
    and the replayer (each loads in the command that runs it)."""
    lazy = {m.name: sorted(m.lazy) for m in GRAPH.values() if m.lazy}
    assert lazy == {
        "outbox_bridge.testing.plugin": [
            "outbox_bridge.testing.inprocess_worker",
            "outbox_bridge.testing.servers",
        ],
        "outbox_bridge.cli.commands": [
            "outbox_bridge.demo",
            "outbox_bridge.dev.replayer",
            "outbox_bridge.runtime.worker",
        ],
        "outbox_bridge.cli.connections": ["outbox_bridge.demo"],
    }


def test_nothing_in_the_package_imports_the_testing_toolkit() -> None:
    """But the integrations' own testing modules (contrib/*/testing.py), which run it on a
    framework's databases."""
    for module in GRAPH.values():
        if not in_package(module.name, "outbox_bridge.testing") and not (
            in_package(module.name, "outbox_bridge.contrib") and module.name.endswith(".testing")
        ):
            reached = {
                i for i in module.imports | module.lazy if in_package(i, "outbox_bridge.testing")
            }
            assert not reached, f"{module.name} imports {sorted(reached)}"


def test_db_stands_below_everything_but_config_and_errors() -> None:
    allowed = ("outbox_bridge.db", "outbox_bridge.config", "outbox_bridge.errors")
    for module in GRAPH.values():
        if in_package(module.name, "outbox_bridge.db"):
            outside = {
                i
                for i in module.imports
                if not in_package(i, *allowed, "outbox_bridge.workflows.models")
            }
            assert not outside, f"{module.name} imports {sorted(outside)}"


@pytest.mark.parametrize(
    "module",
    [
        "outbox_bridge.registry",
        "outbox_bridge.producer",
        "outbox_bridge.orm",
        "outbox_bridge.declarations",
        "outbox_bridge.identifiers",
        "outbox_bridge.db.migrations",
        *(f"outbox_bridge.contrib.django.{name}" for name in DJANGO_PRODUCER_SIDE),
    ],
)
def test_the_producer_side_never_reaches_the_worker(module: str) -> None:
    outside = reachable(module) - PRODUCER_SIDE - {module}
    assert not outside, f"{module} reaches {sorted(outside)}"


def test_only_the_command_line_imports_the_command_line() -> None:
    for module in GRAPH.values():
        if not in_package(module.name, "outbox_bridge.cli", "outbox_bridge.__main__"):
            reached = {i for i in module.imports if in_package(i, "outbox_bridge.cli")}
            assert not reached, f"{module.name} imports {sorted(reached)}"


def test_only_the_integrations_import_the_integrations() -> None:
    """contrib/ stands above everything but the command line, which it never imports."""
    for module in GRAPH.values():
        if in_package(module.name, "outbox_bridge.contrib"):
            reached = {i for i in module.imports if in_package(i, "outbox_bridge.cli")}
            assert not reached, f"{module.name} imports {sorted(reached)}"
        else:
            reached = {i for i in module.imports if in_package(i, "outbox_bridge.contrib")}
            assert not reached, f"{module.name} imports {sorted(reached)}"


def test_workflow_definitions_import_only_workflow_definitions() -> None:
    """The sandbox re-imports a workflow's modules for every run: nothing else comes along."""
    for module in GRAPH.values():
        if in_package(module.name, "outbox_bridge.workflows"):
            outside = {i for i in module.imports if not in_package(i, "outbox_bridge.workflows")}
            assert not outside, f"{module.name} imports {sorted(outside)}"


def test_writing_a_row_loads_nothing_of_the_worker() -> None:
    """In a fresh interpreter: import the registry, build an app and write a row (with a
    SQLAlchemy session on a mock engine, which compiles the statement without a database)."""
    script = f"""
import json, sys
from enum import IntEnum
from sqlalchemy import create_mock_engine
from sqlalchemy.orm import Session
from outbox_bridge.registry import OutboxApp

class Scope(IntEnum):
    ORGANIZATION = 1

class Category(IntEnum):
    ORGANIZATION_UPDATE = 1

app = OutboxApp({{Scope.ORGANIZATION: [Category.ORGANIZATION_UPDATE]}})

class Result:
    def scalar_one(self):
        return 1

class FakeSession:
    info = {{}}
    def execute(self, statement):
        statement.compile(dialect=engine.dialect)
        return Result()

engine = create_mock_engine("postgresql+psycopg://", lambda *a, **k: None)
assert app.write(FakeSession(), category=Category.ORGANIZATION_UPDATE, shard_identifier=1,
                 object_identifier=2, payload={{"a": 1}}) == 1
loaded = [m for m in {list(WORKER_ONLY_DEPENDENCIES)!r}
          if any(n == m or n.startswith(m + ".") for n in sys.modules)]
print(json.dumps(loaded))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_a_django_project_that_writes_rows_loads_nothing_of_the_worker() -> None:
    """In a fresh interpreter: set Django up with the integration installed, declare a model,
    import the migration operations, and build a row's statement as write_row runs it."""
    script = f"""
import json, sys
from enum import IntEnum

import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=[
        "django.contrib.admin",  # which imports each app's admin module
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.messages",
        "outbox_bridge.contrib.django",
    ],
    DATABASES={{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": "x"}}}},
    OUTBOX_BRIDGE={{}},
)
django.setup()

from django.db import models

from outbox_bridge.contrib.django.checks import check_outbox_settings
from outbox_bridge.contrib.django.models import OutboxModel
from outbox_bridge.contrib.django.operations import CreateOutbox
from outbox_bridge.contrib.django.writes import compiled
from outbox_bridge.producer import RowSpec
from outbox_bridge.registry import OutboxApp

class Scope(IntEnum):
    ORGANIZATION = 1

class Category(IntEnum):
    ORGANIZATION_UPDATE = 1

app = OutboxApp({{Scope.ORGANIZATION: [Category.ORGANIZATION_UPDATE]}})

class Organization(OutboxModel):
    __outbox_app__ = app
    __outbox_category__ = Category.ORGANIZATION_UPDATE

    class Meta:
        app_label = "outbox_bridge"

sql, parameters = compiled(app.prepare(RowSpec(Category.ORGANIZATION_UPDATE, 1, 2, {{"a": 1}})).statement)
assert sql.startswith("INSERT INTO outbox"), sql
assert check_outbox_settings()  # a warning: no APP
CreateOutbox("m:app")
loaded = [m for m in {list(WORKER_ONLY_DEPENDENCIES)!r}
          if any(n == m or n.startswith(m + ".") for n in sys.modules)]
print(json.dumps(loaded))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
