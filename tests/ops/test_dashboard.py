"""dashboards/saga-overview.json: equals the generator's output, provisions anywhere
(data source variable), has the agreed panels, and every query is valid PromQL."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from tests.ops.conftest import (
    DASHBOARD,
    REPO,
    dashboard_exprs,
    dashboard_panels,
    run_tool,
    substitute,
    tool,
)

PANELS = {
    "Runs finished by status",
    "Runs started and in progress",
    "Unwinds started",
    "Compensation ratio",
    "Compensations by outcome",
    "Pivots crossed",
    "Unwind duration p90",
    "Runs orphaned",
    "Compensation failures",
    "Stuck runs",
    "Step latency p50",
    "Step latency p99",
    "Step retries",
    "Spans received",
    "Runs by state",
    "Alerts sent",
    "Orphaned runs",
    "Outbox depth",
    "Intake waiting",
    "Alert delay p99",
}


def test_committed_json_equals_generator_output() -> None:
    result = run_tool(sys.executable, "-m", "dashboards.generate", "--stdout", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout == DASHBOARD.read_text(encoding="utf-8"), (
        "dashboards/saga-overview.json is stale: run python -m dashboards.generate"
    )


def test_generator_check_mode_passes() -> None:
    result = run_tool(sys.executable, "-m", "dashboards.generate", "--check", cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_schema_and_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] == "saga-overview"
    assert dashboard["title"] == "Saga overview"


def test_template_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    saga = variables["saga"]
    assert saga["type"] == "query"
    assert saga["query"].startswith("label_values(") and saga["query"].endswith(", saga)")
    assert saga["datasource"]["uid"] == "${datasource}"
    assert saga["includeAll"] and saga["allValue"] == ".*"


def test_every_panel_and_target_uses_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in dashboard_panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["refId"], panel["title"]


def test_panels(dashboard: dict[str, Any]) -> None:
    titles = [p["title"] for p in dashboard_panels(dashboard)]
    assert len(titles) == len(set(titles))
    assert set(titles) == PANELS
    for panel in dashboard_panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]


def test_latency_panels_use_histogram_quantile(dashboard: dict[str, Any]) -> None:
    exprs = dict(dashboard_exprs(dashboard))
    assert exprs["Step latency p50"].startswith("histogram_quantile(0.5,")
    assert exprs["Step latency p99"].startswith("histogram_quantile(0.99,")
    for title in ("Step latency p50", "Step latency p99"):
        assert "saga_stream_step_duration_seconds_bucket" in exprs[title]
        assert "by (le, step, phase)" in exprs[title]
    assert exprs["Alert delay p99"].startswith("histogram_quantile(0.99,")


def test_every_query_is_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool parses each query (variables substituted) as a recording rule."""
    rules = [
        {"record": f"saga_dashboard:query_{i}", "expr": substitute(expr)}
        for i, (_, expr) in enumerate(dashboard_exprs(dashboard))
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_tool(tool("promtool"), "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


# The count panels and a series of each (born at 1 at 60 s, as a counter is, and never
# incremented after), with the labels each panel sums by.
COUNT_PANELS = {
    "Runs orphaned": (
        'saga_stream_runs_orphaned_total{saga="refund",service="agent"}',
        '{saga="refund"}',
    ),
    "Compensation failures": (
        'saga_stream_compensation_failures_total{saga="refund",service="agent",step="credit"}',
        '{saga="refund",step="credit"}',
    ),
    "Stuck runs": (
        'saga_stream_runs_finished_total{saga="refund",service="agent",status="stuck"}',
        '{saga="refund"}',
    ),
}


def test_count_panels_show_a_series_born_at_its_first_increment(
    dashboard: dict[str, Any], tmp_path: Path
) -> None:
    """A counter series appears at 1 (its first failure, stuck run, orphan): increase()
    alone reads 0 over its first interval, so a panel would never show the first one.
    The panels count it in the interval it was born in, and 0 once it stays flat."""
    exprs = {title: expr for title, expr in dashboard_exprs(dashboard) if title in COUNT_PANELS}
    assert exprs.keys() == COUNT_PANELS.keys()
    empty = tmp_path / "none.yml"
    empty.write_text(yaml.safe_dump({"groups": []}))
    cases = []
    for title, (series, labels) in COUNT_PANELS.items():
        expr = substitute(exprs[title], "1m")
        cases.append(
            {
                "name": title,
                "interval": "15s",
                "input_series": [{"series": series, "values": "_ _ _ _ 1+0x12"}],
                "promql_expr_test": [
                    {"expr": expr, "eval_time": "75s",
                     "exp_samples": [{"labels": labels, "value": 1}]},
                    {"expr": expr, "eval_time": "150s",
                     "exp_samples": [{"labels": labels, "value": 0}]},
                ],
            }
        )  # fmt: skip
    path = tmp_path / "panels.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(empty)], "tests": cases}))
    result = run_tool(tool("promtool"), "test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_provisioning_examples() -> None:
    provisioning = REPO / "dashboards" / "provisioning"
    dashboards = yaml.safe_load((provisioning / "dashboards.yaml").read_text(encoding="utf-8"))
    assert dashboards["apiVersion"] == 1
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    sources = yaml.safe_load((provisioning / "datasources.yaml").read_text(encoding="utf-8"))
    assert sources["apiVersion"] == 1
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
