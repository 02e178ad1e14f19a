"""Generate ``dashboards/saga-overview.json`` from code.

    python -m dashboards.generate            # rewrite the committed JSON
    python -m dashboards.generate --check    # exit 1 when the committed JSON is stale

The saga panels read the metrics the sidecar derives from the span stream
(``saga_stream_*``, labelled saga and service), so they work for agents in any
language; the library's own ``saga_*`` metrics tell the same story per agent
process (docs/semantic-conventions.md, "Metrics").

Built with grafana-foundation-sdk (pinned in the dev extra: its output is what the
committed file is compared against). Every panel and query names the data source
through the ``datasource`` template variable, so file provisioning works in any
Grafana whose Prometheus data source has another uid.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

from saga_otel import semconv as sc

OUTPUT = Path(__file__).with_name("saga-overview.json")
UID = "saga-overview"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
SAGA = 'saga=~"$saga"'
RATE = "[$__rate_interval]"
STUCK = sc.STATUS_STUCK


def _count(by: str, series: str) -> str:
    """How many times ``series`` (a counter selector) went up in each interval, by ``by``.

    A counter series is born at its first increment (at 1, not 0), which increase()
    cannot see: a series younger than the interval counts with its whole value, as in
    the alert rules. (The set operators match without the metric name.)
    """
    return (
        f"sum by ({by}) (({series} unless {series} offset $__rate_interval) "
        f"or increase({series}{RATE}))"
    )


def _bucket(histogram: str) -> str:
    return f"{histogram}_bucket"


def _query(expr: str, legend: str, ref_id: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().datasource(DS).expr(expr).legend_format(legend).ref_id(ref_id)


def _timeseries(
    title: str,
    description: str,
    unit: str,
    *queries: prometheus.Dataquery,
    width: int = 8,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .min(0)
        .height(8)
        .span(width)
    )
    for query in queries:
        panel = panel.with_target(query)
    return panel


def _stat(title: str, description: str, unit: str, query: prometheus.Dataquery) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .height(8)
        .span(4)
        .with_target(query)
    )


def _quantile(q: float, histogram: str, by: str, selector: str = "") -> str:
    sel = f"{{{selector}}}" if selector else ""
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({_bucket(histogram)}{sel}{RATE})))"


def build() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict."""
    board = (
        dashboard.Dashboard("Saga overview")
        .uid(UID)
        .description(
            "Saga runs, unwinds and compensations (from the span stream the sidecar receives, "
            "any agent language) and the saga sidecar."
        )
        .tags(["saga", "saga-otel"])
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(
            dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            dashboard.QueryVariable("saga")
            .label("Saga")
            .datasource(DS)
            .query(f"label_values({sc.M_STREAM_RUNS_STARTED}, saga)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
        # --- runs ---------------------------------------------------------
        .with_row(dashboard.Row("Runs"))
        .with_panel(
            _timeseries(
                "Runs finished by status",
                "Runs ending per second, by final status.",
                "ops",
                _query(
                    f"sum by (status) (rate({sc.M_STREAM_RUNS_FINISHED}{{{SAGA}}}{RATE}))",
                    "{{status}}",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Runs started and in progress",
                "Runs starting per second, and runs open right now.",
                "short",
                _query(
                    f"sum by (saga) (rate({sc.M_STREAM_RUNS_STARTED}{{{SAGA}}}{RATE}))",
                    "started/s {{saga}}",
                ),
                _query(
                    f"sum by (saga) ({sc.M_STREAM_RUNS_IN_PROGRESS}{{{SAGA}}})",
                    "in progress {{saga}}",
                    "B",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Unwinds started",
                "Runs that began unwinding their compensation stack, per second.",
                "ops",
                _query(f"sum by (saga) (rate({sc.M_STREAM_UNWINDS}{{{SAGA}}}{RATE}))", "{{saga}}"),
            )
        )
        .with_panel(
            _timeseries(
                "Compensation ratio",
                "Unwinds started / runs started. Alert SagaCompensationRatioHigh watches this.",
                "percentunit",
                _query(
                    f"sum by (saga) (rate({sc.M_STREAM_UNWINDS}{{{SAGA}}}{RATE}))"
                    f" / sum by (saga) (rate({sc.M_STREAM_RUNS_STARTED}{{{SAGA}}}{RATE}))",
                    "{{saga}}",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Compensations by outcome",
                "Compensation attempts per second, by step, undo tool and outcome.",
                "ops",
                _query(
                    f"sum by (step, tool, outcome) "
                    f"(rate({sc.M_STREAM_COMPENSATIONS}{{{SAGA}}}{RATE}))",
                    "{{step}} {{tool}} {{outcome}}",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Pivots crossed",
                "Runs that crossed their point of no return, per second, by step.",
                "ops",
                _query(
                    f"sum by (step) (rate({sc.M_STREAM_PIVOTS}{{{SAGA}}}{RATE}))",
                    "{{step}}",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Unwind duration p90",
                "90th percentile time from an unwind's start to its run's end.",
                "s",
                _query(_quantile(0.9, sc.M_STREAM_UNWIND_DURATION, "saga", SAGA), "{{saga}}"),
                width=12,
            )
        )
        .with_panel(
            _timeseries(
                "Runs orphaned",
                "Runs whose agent went silent mid-run (SagaRunOrphaned), by saga.",
                "short",
                _query(_count("saga", f"{sc.M_STREAM_RUNS_ORPHANED}{{{SAGA}}}"), "{{saga}}"),
                width=12,
            )
        )
        # --- needs a person -----------------------------------------------
        .with_row(dashboard.Row("Needs a person"))
        .with_panel(
            _timeseries(
                "Compensation failures",
                "Compensations that could not be completed, by step. Each needs a person.",
                "short",
                _query(
                    _count("saga, step", f"{sc.M_STREAM_COMPENSATION_FAILURES}{{{SAGA}}}"),
                    "{{saga}} {{step}}",
                ),
                width=12,
            )
        )
        .with_panel(
            _timeseries(
                "Stuck runs",
                "Runs that ended stuck. Each needs a person.",
                "short",
                _query(
                    _count("saga", f'{sc.M_STREAM_RUNS_FINISHED}{{{SAGA}, status="{STUCK}"}}'),
                    "{{saga}}",
                ),
                width=12,
            )
        )
        # --- steps --------------------------------------------------------
        .with_row(dashboard.Row("Steps"))
        .with_panel(
            _timeseries(
                "Step latency p50",
                "Median step duration by step and phase.",
                "s",
                _query(
                    _quantile(0.5, sc.M_STREAM_STEP_DURATION, "step, phase", SAGA),
                    "{{step}} {{phase}}",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Step latency p99",
                "99th percentile step duration by step and phase.",
                "s",
                _query(
                    _quantile(0.99, sc.M_STREAM_STEP_DURATION, "step, phase", SAGA),
                    "{{step}} {{phase}}",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Step retries",
                "Retried attempts per second, by step and phase.",
                "ops",
                _query(
                    f"sum by (step, phase) (rate({sc.M_STREAM_STEP_RETRIES}{{{SAGA}}}{RATE}))",
                    "{{step}} {{phase}}",
                ),
            )
        )
        # --- sidecar ------------------------------------------------------
        .with_row(dashboard.Row("Sidecar"))
        .with_panel(
            _timeseries(
                "Spans received",
                "Spans taken in by the sidecar per second, by transport and outcome.",
                "ops",
                _query(
                    f"sum by (transport, outcome) (rate({sc.M_SIDECAR_SPANS_RECEIVED}{RATE}))",
                    "{{transport}} {{outcome}}",
                ),
            )
        )
        .with_panel(
            _timeseries(
                "Runs by state",
                "Runs the sidecar holds, by derived state.",
                "short",
                _query(f"sum by (state) ({sc.M_SIDECAR_RUNS})", "{{state}}"),
            )
        )
        .with_panel(
            _timeseries(
                "Alerts sent",
                "Sidecar alert deliveries per second, by alert, sink and outcome.",
                "ops",
                _query(
                    f"sum by (alertname, sink, outcome) (rate({sc.M_SIDECAR_ALERTS}{RATE}))",
                    "{{alertname}} {{sink}} {{outcome}}",
                ),
            )
        )
        .with_panel(
            _stat(
                "Orphaned runs",
                "Runs whose agent process went silent. See the SagaRunOrphaned runbook. "
                "Replicas of one job share their runs and each reports them all: counted "
                "once per job.",
                "short",
                _query(f"sum(max by (job) ({sc.M_SIDECAR_ORPHANED_RUNS}))", "orphaned"),
            )
        )
        .with_panel(
            _stat(
                "Outbox depth",
                "Alerts waiting in the sidecar's outbox for delivery. Replicas of one job "
                "share the outbox and each reports it whole: counted once per job.",
                "short",
                _query(f"sum(max by (job) ({sc.M_SIDECAR_OUTBOX_DEPTH}))", "outbox"),
            )
        )
        .with_panel(
            _stat(
                "Intake waiting",
                "How long the oldest agent request has waited for the sidecar's database "
                "commit (0: none waits). See the SagaSidecarIntakeStalled runbook.",
                "s",
                _query(f"max({sc.M_SIDECAR_INTAKE_WAITING})", "waiting"),
            )
        )
        .with_panel(
            _timeseries(
                "Alert delay p99",
                "99th percentile time from the event to a delivered alert, by sink.",
                "s",
                _query(_quantile(0.99, sc.M_SIDECAR_ALERT_DELAY, "sink"), "{{sink}}"),
                width=12,
            )
        )
    )
    encoded: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return encoded


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the JSON is stale")
    parser.add_argument("--stdout", action="store_true", help="print instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python -m dashboards.generate", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
