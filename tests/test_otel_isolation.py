"""Telemetry installed by one test file does not stay on for the next: the same two files
pass in either order (tests/otel.py installs providers for a module and uninstalls them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TRACED = """
from collections.abc import Iterator

import pytest
from opentelemetry import trace

from outbox_bridge.observability.metrics import active_metrics
from outbox_bridge.observability.telemetry import active_tracer
from tests.otel import metric_reader, span_exporter


@pytest.fixture(scope="module")
def spans() -> Iterator[object]:
    with span_exporter() as exporter:
        yield exporter


@pytest.fixture(scope="module")
def reader() -> Iterator[object]:
    with metric_reader() as installed:
        yield installed


def test_on(spans, reader) -> None:
    assert active_tracer() is not None and active_metrics() is not None
    with trace.get_tracer("t").start_as_current_span("seen"):
        pass
    assert [s.name for s in spans.get_finished_spans()] == ["seen"]
"""

PLAIN = """
from opentelemetry import trace

from outbox_bridge.observability.metrics import active_metrics
from outbox_bridge.observability.telemetry import active_tracer


def test_off() -> None:
    assert active_tracer() is None and active_metrics() is None
    assert not trace.get_current_span().is_recording()
    with trace.get_tracer("t").start_as_current_span("unseen") as span:
        assert not span.is_recording()
"""


@pytest.mark.parametrize("order", [("traced", "plain"), ("plain", "traced")], ids="-".join)
def test_telemetry_of_one_file_does_not_leak_into_the_next(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, order: tuple[str, str]
) -> None:
    pytester.makepyfile(test_traced=TRACED, test_plain=PLAIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:django", *(f"test_{name}.py" for name in order)
    )
    result.assert_outcomes(passed=2)
