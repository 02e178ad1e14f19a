"""Fixtures of the sidecar tests; the helpers live in sidecar_testkit.py beside this file."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# --import-mode=importlib puts no test directory on sys.path; the helpers need one.
sys.path.insert(0, str(Path(__file__).parent))

from sidecar_testkit import FakeClock, settings_for

from sidecar import Sidecar


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def sidecar(tmp_path: Path, clock: FakeClock) -> AsyncIterator[Sidecar]:
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        yield sc_
