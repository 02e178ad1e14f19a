"""Shared data for the ops tests: the rules, the dashboard, and metric names from semconv."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from saga_otel import semconv as sc

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "saga-rules.yml"
RULE_TESTS = REPO / "alerts" / "tests"
ALERTMANAGER = REPO / "alerts" / "alertmanager.example.yml"
DASHBOARD = REPO / "dashboards" / "saga-overview.json"
OPERATIONS = REPO / "docs" / "operations.md"

HISTOGRAMS = (
    sc.M_STEP_DURATION,
    sc.M_SIDECAR_REQUEST_DURATION,
    sc.M_SIDECAR_ALERT_DELAY,
    sc.M_STREAM_STEP_DURATION,
    sc.M_STREAM_UNWIND_DURATION,
)
SIDECAR_ALERTS = (
    sc.ALERT_COMPENSATION_STARTED,
    sc.ALERT_COMPENSATION_FAILED,
    sc.ALERT_RUN_STUCK,
    sc.ALERT_RUN_ORPHANED,
)
# Labels each metric carries (the metric set agreed for agents and the sidecar).
LABELS: dict[str, frozenset[str]] = {
    sc.M_RUNS_STARTED: frozenset({"saga"}),
    sc.M_RUNS_FINISHED: frozenset({"saga", "status"}),
    sc.M_RUNS_IN_PROGRESS: frozenset({"saga"}),
    sc.M_STEPS: frozenset({"saga", "step", "phase", "outcome"}),
    sc.M_STEP_DURATION: frozenset({"saga", "step", "phase"}),
    sc.M_STEP_RETRIES: frozenset({"saga", "step", "phase"}),
    sc.M_PIVOTS: frozenset({"saga", "step"}),
    sc.M_UNWINDS: frozenset({"saga"}),
    sc.M_COMPENSATIONS: frozenset({"saga", "step", "outcome"}),
    sc.M_COMPENSATION_FAILURES: frozenset({"saga", "step"}),
    sc.M_STUCK_RUNS: frozenset({"saga"}),
    sc.M_EXPORT_FAILURES: frozenset({"reason"}),
    sc.M_SIDECAR_SPANS_RECEIVED: frozenset({"transport", "outcome"}),
    sc.M_SIDECAR_RUNS: frozenset({"state"}),
    sc.M_SIDECAR_ORPHANED_RUNS: frozenset(),
    sc.M_SIDECAR_REQUEST_DURATION: frozenset({"transport", "route"}),
    sc.M_SIDECAR_FORWARD_DROPPED: frozenset(),
    sc.M_SIDECAR_ALERTS: frozenset({"alertname", "sink", "outcome"}),
    sc.M_SIDECAR_ALERT_DELAY: frozenset({"sink"}),
    sc.M_SIDECAR_OUTBOX_DEPTH: frozenset(),
    sc.M_SIDECAR_ALERTS_UNWRITTEN: frozenset(),
    sc.M_SIDECAR_ALERTS_DROPPED: frozenset(),
    sc.M_SIDECAR_INTAKE_WAITING: frozenset(),
    sc.M_SIDECAR_SERIES_OVERFLOWED: frozenset({"metric"}),
    sc.M_SIDECAR_TASKS_FAILED: frozenset(),
    sc.M_SIDECAR_ALERT_EVALUATION_FAILURES: frozenset(),
    # Derived by the sidecar from the span stream: saga and service on every one.
    sc.M_STREAM_RUNS_STARTED: frozenset({"saga", "service"}),
    sc.M_STREAM_RUNS_FINISHED: frozenset({"saga", "service", "status"}),
    sc.M_STREAM_RUNS_IN_PROGRESS: frozenset({"saga", "service"}),
    sc.M_STREAM_RUNS_ORPHANED: frozenset({"saga", "service"}),
    sc.M_STREAM_UNWINDS: frozenset({"saga", "service"}),
    sc.M_STREAM_UNWIND_DURATION: frozenset({"saga", "service"}),
    sc.M_STREAM_COMPENSATIONS: frozenset({"saga", "service", "step", "tool", "outcome"}),
    sc.M_STREAM_COMPENSATION_FAILURES: frozenset({"saga", "service", "step"}),
    sc.M_STREAM_PIVOTS: frozenset({"saga", "service", "step"}),
    sc.M_STREAM_STEPS: frozenset({"saga", "service", "step", "phase", "outcome"}),
    sc.M_STREAM_STEP_DURATION: frozenset({"saga", "service", "step", "phase"}),
    sc.M_STREAM_STEP_RETRIES: frozenset({"saga", "service", "step", "phase"}),
}
TARGET_LABELS = frozenset({"job", "instance"})
METRIC_RE = re.compile(r"\b(saga_[a-z0-9_]+|up)\b")


def semconv_metric_names() -> frozenset[str]:
    """Every series name semconv allows: M_* constants plus histogram series."""
    names = {v for k, v in vars(sc).items() if k.startswith("M_") and isinstance(v, str)}
    for h in HISTOGRAMS:
        names |= {f"{h}_bucket", f"{h}_sum", f"{h}_count"}
    return frozenset(names)


def base_metric(series: str) -> str:
    for h in HISTOGRAMS:
        if series in (f"{h}_bucket", f"{h}_sum", f"{h}_count"):
            return h
    return series


def metric_names(expr: str) -> set[str]:
    """Series names an expression selects (``saga_*`` and ``up``; not label names)."""
    return set(METRIC_RE.findall(expr))


def load_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


def load_dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return board


def dashboard_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def dashboard_exprs(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard_panels(board) for t in p["targets"]]


def substitute(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard expression as Grafana sends it with `saga` = All."""
    return expr.replace("$__rate_interval", rate_interval).replace("$saga", ".*")


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: apt-get install prometheus prometheus-alertmanager"
    return path


def run_tool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=60, check=False
    )


@pytest.fixture(scope="session")
def rules() -> list[dict[str, Any]]:
    return load_rules()


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    return load_dashboard()
