"""Fixtures of the sidecar tests; the helpers live in sidecar_testkit.py beside this file."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# --import-mode=importlib puts no test directory on sys.path; the helpers need one.
sys.path.insert(0, str(Path(__file__).parent))

import sidecar_testkit
from pg_server import Databases
from sidecar_testkit import FakeClock, settings_for

from sidecar import Sidecar


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(autouse=True)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The store the test's sidecars use: "sqlite" unless a module asks for both with
    ``pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)``.

    On "postgresql", ``settings_for`` and ``db_for`` give each SQLite path the test
    names a database of its own on the session's server; they are dropped after it.
    """
    kind = str(getattr(request, "param", "sqlite"))
    if kind == "sqlite":
        yield kind
        return
    databases = Databases(request.getfixturevalue("postgres"))
    sidecar_testkit.use_postgres(databases)
    try:
        yield kind
    finally:
        sidecar_testkit.use_postgres(None)
        databases.drop_all()


@pytest.fixture
async def sidecar(tmp_path: Path, clock: FakeClock, backend: str) -> AsyncIterator[Sidecar]:
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        yield sc_
