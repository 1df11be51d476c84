"""The folders pyproject.toml maps onto packages (``[tool.setuptools.package-dir]``): the tools
that read the source rather than import it (mypy, the docs' API reference, the layer test)
name their modules from it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def folder_packages() -> dict[str, str]:
    """Each mapped folder and the package it is: ``{"workflows": "outbox_bridge.workflows"}``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return {folder: package for package, folder in mapping.items()}
