"""The code stays ruff-clean, ruff-formatted and strictly typed: part of the default suite, so CI enforces it."""

from __future__ import annotations

import subprocess
import sys
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


SCOPES_AS_A_VARIABLE = """
from enum import IntEnum

from outbox_bridge import OutboxApp


class Scope(IntEnum):
    ORGANIZATION = 1


class Category(IntEnum):
    PROJECT_UPDATE = 2


SCOPES = {Scope.ORGANIZATION: {Category.PROJECT_UPDATE}}
app = OutboxApp(scopes=SCOPES, categories=[Category])
"""


def test_mypy_accepts_the_app_s_own_enums_as_scopes(tmp_path: Path) -> None:
    module = tmp_path / "typed_app.py"
    module.write_text(SCOPES_AS_A_VARIABLE)
    result = _mypy("--strict", "--python-version", "3.11", str(module))
    assert result.returncode == 0, result.stdout + result.stderr
