"""Every metric the rules and the dashboard query is one semconv names, with the
labels it carries. (The e2e test checks the same names against live /metrics.)"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.ops.conftest import (
    LABELS,
    TARGET_LABELS,
    base_metric,
    dashboard_exprs,
    load_dashboard,
    load_rules,
    metric_names,
    semconv_metric_names,
)

EXPRS = [(f"rule {r['alert']}", r["expr"]) for r in load_rules()] + [
    (f"panel {title}", expr) for title, expr in dashboard_exprs(load_dashboard())
]


@pytest.mark.parametrize(("where", "expr"), EXPRS)
def test_metric_names_exist_in_semconv(where: str, expr: str) -> None:
    names = metric_names(expr)
    assert names, f"{where}: no metric found in {expr!r}"
    unknown = names - semconv_metric_names() - {"up"}
    assert not unknown, f"{where}: {sorted(unknown)} not in saga_otel.semconv"


@pytest.mark.parametrize(("where", "expr"), EXPRS)
def test_labels_exist_on_the_metrics(where: str, expr: str) -> None:
    names = metric_names(expr) - {"up"}
    allowed = set(TARGET_LABELS)
    for name in names:
        allowed |= LABELS[base_metric(name)]
        if name.endswith("_bucket"):
            allowed.add("le")
    grouped = {
        label.strip()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in group.split(",")
        if label.strip()
    }
    matched = set(re.findall(r"[{,]\s*([a-z_]+)\s*(?:=~|!~|!=|=)", expr))
    if "up" in metric_names(expr):
        allowed |= {"job"}
    assert grouped | matched <= allowed, f"{where}: labels {sorted((grouped | matched) - allowed)}"


def test_dashboard_saga_variable_reads_a_semconv_metric() -> None:
    board: dict[str, Any] = load_dashboard()
    (saga,) = [v for v in board["templating"]["list"] if v["name"] == "saga"]
    assert metric_names(saga["query"]) <= semconv_metric_names()


def test_semconv_metric_list_matches_label_table() -> None:
    """The label table above names only metrics semconv has."""
    table = set(LABELS)
    names = {base_metric(n) for n in semconv_metric_names()}
    assert table <= names
