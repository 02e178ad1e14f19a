"""Helpers shared by the test folders: real sidecar processes, bounded waits."""

from __future__ import annotations

import time
from collections.abc import Callable

from saga_otel.testing import AlertReceiver, SidecarProcess, start_sidecar

__all__ = ["AlertReceiver", "SidecarProcess", "start_sidecar", "wait_until"]


def wait_until(probe: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
    """Poll until ``probe()`` is truthy; a bounded wait, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting{' for ' + what if what else ''}")
        time.sleep(0.02)
