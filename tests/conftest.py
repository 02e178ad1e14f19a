"""Shared fixtures. Every server a test starts binds 127.0.0.1 on a free port."""

from __future__ import annotations

import socket

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port() -> int:
    return free_port()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """In CI a skipped test is a failed test: nothing may quietly not run."""
    import os

    skipped = terminalreporter.stats.get("skipped", [])
    if os.environ.get("CI") and skipped:
        terminalreporter.write_line(
            f"CI: {len(skipped)} test(s) skipped; every test must run in CI", red=True
        )
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED  # type: ignore[attr-defined]
