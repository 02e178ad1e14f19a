"""The readiness rule (sidecar/_ready.py): ready unless intake has waited past the threshold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from sidecar._ready import is_ready, readiness
from sidecar._settings import DEFAULT_READY_STALL

RULES = Path(__file__).resolve().parents[2] / "alerts" / "saga-rules.yml"


@pytest.mark.parametrize("waiting", [0.0, 0.2, 4.999, 5.0])
def test_a_wait_up_to_the_threshold_is_ready(waiting: float) -> None:
    view = readiness(waiting, 5.0)
    assert view == {
        "status": "ready",
        "reason": None,
        "intake_waiting_s": waiting,
        "ready_stall_s": 5.0,
        "fix": None,
    }
    assert is_ready(view)


@pytest.mark.parametrize("waiting", [5.0001, 42.0, 86_400.0])
def test_a_wait_past_the_threshold_is_stalled_with_the_fix(waiting: float) -> None:
    view = readiness(waiting, 5.0)
    assert not is_ready(view)
    assert view["status"] == "stalled" and view["reason"] == "intake_stalled"
    assert view["intake_waiting_s"] == round(waiting, 3) and view["ready_stall_s"] == 5.0
    fix = view["fix"]
    assert fix is not None
    assert f"{waiting:.1f} s" in fix and "--ready-stall 5 s" in fix
    assert "another replica" in fix and "SagaSidecarIntakeStalled" in fix


def test_the_threshold_is_the_callers() -> None:
    assert is_ready(readiness(9.0, 10.0))
    assert not is_ready(readiness(9.0, 1.0))
    assert readiness(1.23456, 1.0)["intake_waiting_s"] == 1.235


def test_the_default_threshold_is_the_intake_stalled_rules() -> None:
    """A replica leaves rotation at the wait SagaSidecarIntakeStalled starts counting."""
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    rule = next(
        r for g in groups for r in g["rules"] if r.get("alert") == "SagaSidecarIntakeStalled"
    )
    found = re.fullmatch(r".*saga_sidecar_intake_waiting_seconds\)\s*>\s*([0-9.]+)", rule["expr"])
    assert found is not None, rule["expr"]
    assert float(found.group(1)) == DEFAULT_READY_STALL
