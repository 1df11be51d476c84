"""mkdocs hook: files of the repository that the site shows without copying them into docs/.

- The benchmark charts, ``bench/results/*.png``, are served as ``images/bench/<name>.png``:
  ``python -m bench`` redraws them and the next build shows the new ones.
- ``CHANGELOG.md`` at the root, when there is one, becomes the page ``changelog.md`` at the end
  of the navigation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
CHARTS = ROOT / "bench" / "results"
CHANGELOG = ROOT / "CHANGELOG.md"


def on_config(config: MkDocsConfig, **_: Any) -> MkDocsConfig:
    if CHANGELOG.is_file() and config.nav is not None:
        if not any(isinstance(item, dict) and "Changelog" in item for item in config.nav):
            config.nav.append({"Changelog": "changelog.md"})
    return config


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    for chart in sorted(CHARTS.glob("*.png")):
        files.append(File.generated(config, f"images/bench/{chart.name}", abs_src_path=str(chart)))
    if CHANGELOG.is_file():
        files.append(File.generated(config, "changelog.md", content=CHANGELOG.read_text()))
    return files
