"""The suite's CPU summary (tests/cpu.py): how long fewer tests ran at once than there are cores."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest

from tests.cpu import file_costs, longest_files_first, underused

ROOT = Path(__file__).resolve().parents[1]


def test_the_time_each_number_of_tests_ran_at_once_below_the_cores_is_summed() -> None:
    # 0-5 one test, 5-10 two, 10-20 one, 20-30 none, 30-40 one.
    spans = [(0.0, 10.0), (5.0, 20.0), (30.0, 40.0)]
    assert underused(spans, 2) == [10.0, 25.0]
    assert underused(spans, 3) == [10.0, 25.0, 5.0]
    assert underused([], 2) == [0.0, 0.0]


@dataclass
class FakeItem:
    nodeid: str


def test_the_longest_files_come_first_each_with_its_tests_in_their_order() -> None:
    names = ["a.py::one", "a.py::two", "b.py::one", "c.py::one", "b.py::two", "d.py::one"]
    items = [FakeItem(name) for name in names]
    longest_files_first(cast(list[pytest.Item], items), {"b.py": 9.0, "c.py": 20.0, "a.py": 1})
    assert [item.nodeid for item in items] == [
        "c.py::one",
        "b.py::one",
        "b.py::two",
        "a.py::one",
        "a.py::two",
        "d.py::one",  # no known cost: last
    ]


def test_the_costs_file_is_read_back_as_written(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu.txt"
    cpu.write_text(
        "2.5\tt/x.py::a\t1.0\t2.0\n-1.0\tt/y.py::b\t1.0\t3.0\n1.5\tt/x.py::c\t2.0\t4.0\n"
    )
    costs = tmp_path / "costs.txt"
    result = subprocess.run(
        [sys.executable, "-m", "tests.cpu", str(cpu)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "3.0 t/x.py\n2.0 t/y.py\n"  # the seconds the tests took
    costs.write_text(result.stdout)
    assert file_costs(costs) == {"t/x.py": 3.0, "t/y.py": 2.0}
    assert file_costs(tmp_path / "absent.txt") == {}


def test_the_committed_costs_name_files_of_the_suite() -> None:
    costs = file_costs()
    assert len(costs) > 50
    missing = [name for name in costs if not (ROOT / name).is_file()]
    assert not missing, f"tests/file_costs.txt names files that are gone: {missing}"
