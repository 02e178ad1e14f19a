"""alerts/alertmanager.example.yml: amtool accepts it and routes by severity."""

from __future__ import annotations

import pytest
import yaml

from tests.ops.conftest import ALERTMANAGER, SIDECAR_ALERTS, load_rules, run_tool, tool


def test_amtool_check_config() -> None:
    result = run_tool(tool("amtool"), "check-config", ALERTMANAGER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _receiver(*labels: str) -> str:
    result = run_tool(
        tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize(
    ("severity", "receiver"), [("critical", "saga-pagerduty"), ("warning", "saga-webhook")]
)
@pytest.mark.parametrize("alertname", [*SIDECAR_ALERTS, *(r["alert"] for r in load_rules())])
def test_routes_by_severity(alertname: str, severity: str, receiver: str) -> None:
    labels = (f"alertname={alertname}", f"severity={severity}", "saga=refund", "run_id=r1")
    assert _receiver(*labels) == receiver


def test_unlabelled_alerts_still_reach_someone() -> None:
    assert _receiver("alertname=Other") == "saga-webhook"


def test_grouping_and_receivers() -> None:
    config = yaml.safe_load(ALERTMANAGER.read_text(encoding="utf-8"))
    route = config["route"]
    assert route["group_by"] == ["alertname", "saga", "run_id"]
    assert route["group_wait"] == "5s"
    receivers = {r["name"]: r for r in config["receivers"]}
    assert receivers["saga-pagerduty"]["pagerduty_configs"][0]["routing_key"]
    assert receivers["saga-webhook"]["webhook_configs"][0]["url"].startswith("http")
