"""The documentation site builds with ``mkdocs build --strict`` (no broken link, page or
docstring reference), its generated references cover the code, and the README stays a short
front page that keeps the commands CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import outbox_bridge
from outbox_bridge import testing
from outbox_bridge.cli import main as cli
from outbox_bridge.config import OutboxSettings, env_name

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text()


def test_every_setting_is_in_the_settings_reference(site: Path) -> None:
    text = page(site, "reference/settings")
    for name, field in OutboxSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert f'id="{flag[2:]}"' in text, flag
        assert f"<code>{flag}</code>" in text, flag
        assert f"<code>{env_name(name, field)}</code>" in text, name


def test_every_command_is_in_the_cli_reference(site: Path) -> None:
    text = page(site, "reference/cli")
    for name in cli.commands:
        assert f"outbox-bridge {name}" in text, name
    assert "outbox-bridge history export" in text
    assert "--reason" in text  # options are listed, not only commands


def test_every_public_name_is_in_the_api_reference(site: Path) -> None:
    text = page(site, "reference/api")
    for name in outbox_bridge.__all__:
        assert f'id="outbox_bridge.{name}"' in text, name


def test_every_name_of_the_testing_toolkit_is_in_the_api_reference(site: Path) -> None:
    text = page(site, "reference/api")
    for name in testing.__all__:
        assert f'id="outbox_bridge.testing.{name}"' in text, name
    assert "outbox_bridge.testing" in page(site, "how-to/testing")


def test_benchmark_charts_are_served_from_bench_results(site: Path) -> None:
    for chart in (ROOT / "bench" / "results").glob("*.png"):
        assert (site / "images" / "bench" / chart.name).read_bytes() == chart.read_bytes()


def test_the_contract_page_states_the_eight_invariants() -> None:
    text = (DOCS / "explanation" / "contract.md").read_text()
    for number in range(1, 9):
        assert f'<a id="invariant-{number}"></a>' in text, number


def test_the_code_cites_the_design_contract_page() -> None:
    old = "DESIGN" + " §"  # the former citation of a design document outside the repository
    sources = [
        path
        for folder in ("outbox_bridge", "workflows", "activities", "tests", "bench", "examples")
        for path in (ROOT / folder).rglob("*.py")
    ]
    citing = [str(path.relative_to(ROOT)) for path in sources if old in path.read_text()]
    assert not citing, citing


def test_readme_is_a_short_front_page() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 200
    # .ci/run installs and tests exactly as the README says.
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[dev]' && pytest" in ci
    assert "pip install -e '.[dev]' && pytest\n" in text


def test_readme_links_resolve() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [target for target in targets if "://" not in target]
    assert "docs/index.md" in local, "the README links into the documentation"
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, missing
