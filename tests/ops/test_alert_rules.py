"""alerts/saga-rules.yml: promtool accepts it, its unit tests pass and cover every rule
both firing and quiet, and every rule follows the monitoring-mixins conventions."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from sidecar._alerting import DEFAULT_RUNBOOK_BASE
from tests.ops.conftest import (
    OPERATIONS,
    RULE_TESTS,
    RULES,
    SIDECAR_ALERTS,
    load_rules,
    metric_names,
    run_tool,
    tool,
)

RULE_NAMES = [rule["alert"] for rule in load_rules()]
SEVERITIES = {"critical", "warning"}


def _by_name(rules: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(rule for rule in rules if rule["alert"] == name)


def test_promtool_check_rules() -> None:
    result = run_tool(tool("promtool"), "check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RULE_NAMES)} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    files = sorted(RULE_TESTS.glob("*.yml"))
    assert files, "no promtool test files in alerts/tests/"
    result = run_tool(tool("promtool"), "test", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


def _cases() -> dict[str, dict[str, int]]:
    """alertname -> {"firing": n, "quiet": n} over every promtool test case."""
    seen: dict[str, dict[str, int]] = {}
    for path in sorted(RULE_TESTS.glob("*.yml")):
        for case in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for check in case.get("alert_rule_test", []):
                kind = "firing" if check.get("exp_alerts") else "quiet"
                counts = seen.setdefault(check["alertname"], {"firing": 0, "quiet": 0})
                counts[kind] += 1
    return seen


@pytest.mark.parametrize("name", RULE_NAMES)
def test_every_rule_has_firing_and_quiet_cases(name: str) -> None:
    counts = _cases().get(name, {"firing": 0, "quiet": 0})
    assert counts["firing"] >= 1, f"{name}: no promtool case expects it to fire"
    assert counts["quiet"] >= 1, f"{name}: no promtool case expects it to stay quiet"


def test_unit_tests_name_only_existing_rules() -> None:
    assert set(_cases()) <= set(RULE_NAMES)


def test_groups_are_named_and_rule_names_unique() -> None:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    assert all(re.fullmatch(r"saga-[a-z-]+", g["name"]) for g in groups)
    assert len(RULE_NAMES) == len(set(RULE_NAMES))


@pytest.mark.parametrize("name", RULE_NAMES)
def test_rule_conventions(rules: list[dict[str, Any]], name: str) -> None:
    rule = _by_name(rules, name)
    assert re.fullmatch(r"Saga(?:[A-Z][a-z0-9]+)+", name), "CamelCase, Saga prefix"
    assert name not in SIDECAR_ALERTS, "must not reuse one of the sidecar's alert names"
    assert re.fullmatch(r"\d+[smh]", rule["for"])
    assert rule["labels"]["severity"] in SEVERITIES
    annotations = rule["annotations"]
    assert set(annotations) >= {"summary", "description", "runbook_url"}
    assert annotations["summary"].endswith(".")
    # The same base as the sidecar's own alerts, so both layers link to one page.
    assert annotations["runbook_url"] == f"{DEFAULT_RUNBOOK_BASE}#{name.lower()}"


@pytest.mark.parametrize("name", RULE_NAMES)
def test_runbook_anchor_exists(name: str) -> None:
    headings = re.findall(r"^#+ (\S+)\s*$", OPERATIONS.read_text(encoding="utf-8"), re.M)
    assert name in headings, f"docs/operations.md has no runbook heading for {name}"


@pytest.mark.parametrize("name", RULE_NAMES)
def test_counters_only_through_rate_or_increase(rules: list[dict[str, Any]], name: str) -> None:
    expr = _by_name(rules, name)["expr"]
    for metric in metric_names(expr):
        if not (metric.endswith("_total") or metric.endswith("_bucket")):
            continue
        for match in re.finditer(rf"\b{metric}\b", expr):
            before = expr[: match.start()]
            after = re.sub(r"^\{[^}]*\}", "", expr[match.end() :])  # past its label matchers
            # The one raw use allowed: a series born within the window (at its first
            # increment, which increase() cannot see), `X unless X offset W`.
            born = re.match(rf"\s*unless\s+{metric}\b", after) or (
                re.search(r"\bunless\s*$", before) and re.match(r"\s+offset\b", after)
            )
            assert born or re.search(r"\b(rate|increase)\(\s*$", before), (
                f"{name}: counter {metric} must be used inside rate() or increase(), or as "
                f"a series born within the window (`{metric} unless {metric} offset W`)"
            )
