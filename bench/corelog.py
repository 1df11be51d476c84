"""Warnings of the Temporal SDK core (Rust), counted instead of printed over the progress lines.

Under load the core warns, for example, that a workflow task took longer than 5 s: worth
knowing, so every bridge measurement records how many warnings it caused and the first one.
Only ``python -m bench`` installs this (it must configure the runtime before any client).
"""

from __future__ import annotations

import logging

from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)


class WarningCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.installed = False
        self.count = 0
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if self.first is None:
            self.first = record.getMessage()[:300]

    def since(self, mark: int) -> dict[str, object]:
        """What to record for a measurement that began when ``count`` was ``mark``."""
        if not self.installed:
            return {}
        return {"sdk_core_warnings": self.count - mark, "sdk_core_first_warning": self.first}


COUNTER = WarningCounter()


def install() -> None:
    logger = logging.getLogger("bench.sdk_core")
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(COUNTER)
    forwarding = LogForwardingConfig(logger=logger, append_target_to_name=False)
    logging_config = LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"), forwarding=forwarding
    )
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=logging_config)))
    COUNTER.installed = True
