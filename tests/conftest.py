"""Shared fixtures. Every server a test starts binds 127.0.0.1 on a free port."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# --import-mode=importlib puts no test folder on sys.path; tests import support.py.
sys.path.insert(0, str(Path(__file__).parent))

from pg_server import PgServer
from support import SidecarProcess, start_sidecar


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


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    """A PostgreSQL server for the session (started on first use; see pg_server.py)."""
    server = PgServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_backend(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """``--db`` for a test that runs on both backends: None (the SQLite file in the
    test's folder) or a fresh database on the session's PostgreSQL (dropped after)."""
    if request.param == "sqlite":
        yield None
        return
    server: PgServer = request.getfixturevalue("postgres")
    name = server.create()
    try:
        yield server.url(name)
    finally:
        server.drop(name)


@pytest.fixture
def sidecar_process(tmp_path: Path) -> Iterator[Callable[..., SidecarProcess]]:
    """A factory: ``sidecar_process("--webhook", url)``; every one started is stopped."""
    started: list[SidecarProcess] = []

    def make(*args: str, db: Path | str | None = None) -> SidecarProcess:
        sp = start_sidecar(tmp_path, *args, db=db)
        started.append(sp)
        return sp

    yield make
    for sp in started:
        sp.stop()
