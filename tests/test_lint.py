"""The code stays ruff-clean, ruff-formatted and strictly typed: part of the default suite, so CI enforces it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests import mypy_early

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _mypy(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    """mypy with workflows/ and activities/ named as the wheel installs them."""
    return _run("scripts.typecheck", *args, timeout=timeout)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_changes_nothing() -> None:
    result = _run("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


# A cold mypy run of the whole tree takes about 50 s of CPU, and minutes beside the suite's
# servers on a loaded machine: it gets a budget of its own. It started when the tests were
# collected (tests/mypy_early.py).
@pytest.mark.timeout(480)
def test_mypy_strict_finds_nothing(pytestconfig: pytest.Config) -> None:
    code, output = mypy_early.result(pytestconfig, timeout=460)
    assert code == 0, output


def test_the_typed_tree_holds_an_app_whose_scopes_are_a_variable_of_its_own_enums() -> None:
    # The strict run above checks tests/typed_app.py; a cold mypy of that file alone would
    # analyse the package and its dependencies a second time (about 20 s of CPU).
    tree = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert tree["strict"] is True and "tests" in tree["files"], tree
    module = (ROOT / "tests" / "typed_app.py").read_text()
    assert "SCOPES = {Scope.ORGANIZATION: {Category.PROJECT_UPDATE}}" in module
    assert "OutboxApp(scopes=SCOPES, categories=[Category])" in module
