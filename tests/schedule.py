"""The order in which pytest-xdist hands out the test files (``--dist loadfile
--no-loadscope-reorder``: each file to one process, in the order of the collection)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.slots import SLOTTED_UNIT_FILES


@pytest.hookimpl(trylast=True)  # after pytest-django's own ordering of its tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = longest_first(items)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The files in the order pytest-xdist hands them out (``--dist loadfile``, each file to one
    process): those that run a tool over the whole tree (mypy alone takes minutes) first, then
    those with tests of a server, then the unit tests, each group's larger files first. A long
    file that started last would run alone at the end while the other processes idle."""
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(Path(item.path), []).append(item)

    def rank(path: Path) -> tuple[int, int]:
        tests = files[path]
        if path.name in SLOTTED_UNIT_FILES:
            group = 0
        elif any(item.get_closest_marker("unit") is None for item in tests):
            group = 1
        else:
            group = 2
        return group, -len(tests)

    return [item for path in sorted(files, key=rank) for item in files[path]]
