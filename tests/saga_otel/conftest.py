"""The ``mode`` fixture: every engine and observed() behaviour test runs sync and async."""

from __future__ import annotations

import pytest
from saga_modes import Driver


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> Driver:
    return Driver(request.param)
