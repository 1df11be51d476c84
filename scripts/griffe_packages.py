"""A griffe extension for the docs' API reference: it reads the folders pyproject.toml maps
onto subpackages of outbox_bridge (workflows/, activities/) as those subpackages, which griffe,
reading the source tree, would not find under outbox_bridge/."""

from __future__ import annotations

from typing import Any

import griffe

from scripts.packages import ROOT, folder_packages


class MappedPackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for folder, package in folder_packages().items():
            top, _, name = package.partition(".")
            if top != pkg.name:
                continue
            root = ROOT / folder
            for path in sorted(root.rglob("*.py"), key=lambda p: (p.parent, p.stem != "__init__")):
                parts = (name, *path.relative_to(root).with_suffix("").parts)
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                loader._load_submodule(pkg, parts, path)
