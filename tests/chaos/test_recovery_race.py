"""Two `saga-otel recover` processes released at one barrier on the same orphaned run,
many times: exactly one runs the undos (each once, by the tools' own log), the other
exits 3 naming the holder. Trials: SAGA_CHAOS_RACE_TRIALS (default 50)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.saga_otel.recovery_kit import race

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

TRIALS = int(os.environ.get("SAGA_CHAOS_RACE_TRIALS", "50"))


def test_racing_recoverers_never_undo_twice(
    sidecar_process: Any, tmp_path: Path, chaos_results: dict[str, Any]
) -> None:
    s = sidecar_process()
    stats = race(s.api, s.otlp, tmp_path, TRIALS)
    print(f"\nrecovery-race trials: {stats}")
    assert stats["loser_named_holder"] == TRIALS
    chaos_results["recovery_race"] = stats
