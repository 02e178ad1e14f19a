"""The chaos suite writes what it measured to build/chaos-results.json, from which
`python -m bench.reliability` renders docs/reliability.md."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "build" / "chaos-results.json"


@pytest.fixture(scope="session")
def chaos_results() -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    yield found
    if not found:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name, figures in found.items():
        old[name] = {
            **figures,
            "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "ci": bool(os.environ.get("CI")),
        }
    RESULTS.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
