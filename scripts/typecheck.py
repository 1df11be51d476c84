"""mypy --strict over the repository, with the package's folders under the names the wheel
gives them: pyproject.toml maps ``workflows/`` and ``activities/`` onto
``outbox_bridge.workflows`` and ``outbox_bridge.activities`` (``[tool.setuptools.package-dir]``),
a mapping mypy's own command line cannot express.

    python -m scripts.typecheck [mypy's options and files]    (from the repository root)

Exits as mypy does: 0 when it finds nothing, 1 on errors, 2 when it cannot run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.find_sources import create_source_list
from mypy.main import process_options
from mypy.modulefinder import BuildSource

from scripts.packages import ROOT, folder_packages


def renamed(source: BuildSource, packages: dict[str, str]) -> BuildSource:
    """``source`` under its package's name, if it lies in a mapped folder."""
    top, _, rest = (source.module or "").partition(".")
    if top not in packages:
        return source
    module = f"{packages[top]}.{rest}" if rest else packages[top]
    return BuildSource(source.path, module, source.text, source.base_dir, source.followed)


def main(args: list[str]) -> int:
    sources, options = process_options(args)
    packages = folder_packages()
    # Files given on the command line import the package: its mapped folders come along.
    given = {Path(s.path or "").resolve() for s in sources}
    for folder in packages:
        listed = create_source_list([str(ROOT / folder)], options)
        sources += [s for s in listed if Path(s.path or "").resolve() not in given]
    try:
        result = build.build([renamed(s, packages) for s in sources], options)
    except CompileError as error:
        print("\n".join(error.messages), file=sys.stderr)
        return 2
    if result.errors:
        print("\n".join(result.errors))
        files = len({line.split(":", 1)[0] for line in result.errors})
        print(f"Found {len(result.errors)} errors in {files} files")
        return 1
    print(f"Success: no issues found in {len(sources)} source files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
