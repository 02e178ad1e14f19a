"""Saga metrics the sidecar derives from the spans alone (any agent, any language)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from sidecar_testkit import (
    FakeClock,
    compensated_run,
    compensation_failed_run,
    completed_run,
    export_grpc,
    export_http,
    open_run,
    settings_for,
    stuck_run,
)

from saga_otel import semconv as sc
from sidecar import Sidecar


def value(sidecar: Sidecar, name: str, **labels: str) -> float:
    found = sidecar.metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


AGENT = {"saga": "refund", "service": "refund-agent"}


async def test_runs_steps_and_compensations_are_counted_from_spans(
    tmp_path: Path, clock: FakeClock
) -> None:
    async with Sidecar(settings_for(tmp_path, idle_timeout=5.0), clock=clock) as sidecar:
        done, comp, failed, stuck = (
            completed_run(),
            compensated_run(),
            compensation_failed_run(),
            stuck_run(),
        )
        await export_http(sidecar, [*done.spans(), *comp.spans()])
        await export_grpc(sidecar, [*failed.spans(), *stuck.spans()])
        # A resend (an exporter's retry) counts nothing twice.
        await export_http(sidecar, comp.spans())
        lost = open_run()
        await export_http(sidecar, lost.spans())
        sidecar.metrics.render(sidecar.state)
        assert value(sidecar, sc.M_STREAM_RUNS_IN_PROGRESS, **AGENT) == 1
        clock.now += 10
        sidecar.tick()
        sidecar.metrics.render(sidecar.state)

        started = sc.M_STREAM_RUNS_STARTED
        finished = sc.M_STREAM_RUNS_FINISHED
        assert value(sidecar, started, **AGENT) == 5
        for status in ("completed", "compensated", "compensation_failed", "stuck"):
            assert value(sidecar, finished, **AGENT, status=status) == 1, status
        assert value(sidecar, sc.M_STREAM_RUNS_ORPHANED, **AGENT) == 1
        assert value(sidecar, sc.M_STREAM_RUNS_IN_PROGRESS, **AGENT) == 0  # kept, at 0
        assert value(sidecar, sc.M_STREAM_UNWINDS, **AGENT) == 2
        comps = sc.M_STREAM_COMPENSATIONS
        ticket = {**AGENT, "step": "update_ticket", "tool": "restore_ticket"}
        credit = {**AGENT, "step": "issue_credit", "tool": "reverse_credit"}
        assert value(sidecar, comps, **ticket, outcome="ok") == 2
        assert value(sidecar, comps, **credit, outcome="ok") == 1
        assert value(sidecar, comps, **credit, outcome="failed") == 2
        failures = sc.M_STREAM_COMPENSATION_FAILURES
        assert value(sidecar, failures, **AGENT, step="issue_credit") == 1
        assert value(sidecar, sc.M_STREAM_PIVOTS, **AGENT, step="send_reply") == 2
        steps = sc.M_STREAM_STEPS
        assert (
            value(sidecar, steps, **AGENT, step="notify_billing", phase="do", outcome="error") == 2
        )
        assert value(sidecar, steps, **AGENT, step="lookup_order", phase="do", outcome="ok") == 4
        retries = sc.M_STREAM_STEP_RETRIES
        assert value(sidecar, retries, **AGENT, step="issue_credit", phase="compensate") == 1
        duration = sc.M_STREAM_STEP_DURATION + "_count"
        assert value(sidecar, duration, **AGENT, step="issue_credit", phase="do") == 5
        unwind = sc.M_STREAM_UNWIND_DURATION
        assert value(sidecar, unwind + "_count", **AGENT) == 2
        assert value(sidecar, unwind + "_sum", **AGENT) > 0

        # Labelled by saga and service, never by run id.
        text = sidecar.metrics.render(sidecar.state).decode()
        for family in text_string_to_metric_families(text):
            if family.name.startswith("saga_stream_"):
                for sample in family.samples:
                    assert {"saga", "service"} <= set(sample.labels), sample
                    assert "run_id" not in sample.labels
                    assert done.run_id not in str(sample.labels)


async def test_new_names_per_run_cannot_grow_the_metrics_without_bound(
    tmp_path: Path, clock: FakeClock
) -> None:
    """An agent that puts an id in its saga name makes a new label set per run: each
    stream metric stops at STREAM_MAX_SERIES label sets, the rest is counted (not lost)
    in its ``_overflow`` series and in saga_sidecar_series_overflowed_total."""
    cap, extra = sc.STREAM_MAX_SERIES, 150
    runs = [completed_run(saga=f"refund-{i:05d}") for i in range(cap + extra)]
    waiting = [open_run(saga=f"onboard-{i:05d}") for i in range(cap + extra)]
    async with Sidecar(settings_for(tmp_path, idle_timeout=1e6), clock=clock) as sidecar:
        spans = [s for r in runs + waiting for s in r.spans()]
        for at in range(0, len(spans), 2000):
            await export_http(sidecar, spans[at : at + 2000])
        text = sidecar.metrics.render(sidecar.state).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    over = {"saga": sc.STREAM_OVERFLOW, "service": sc.STREAM_OVERFLOW}
    started = [s for s in families["saga_stream_runs_started"].samples if s.name.endswith("_total")]
    assert len(started) == cap + 1  # cap label sets and the overflow one
    assert sum(s.value for s in started) == 2 * (cap + extra)  # nothing lost
    assert next(s.value for s in started if s.labels == over) == 2 * (cap + extra) - cap
    steps = [s for s in families["saga_stream_steps"].samples if s.name.endswith("_total")]
    assert len(steps) <= cap + 1
    assert sum(s.value for s in steps) == 4 * len(runs) + 2 * len(waiting)
    in_progress = families[sc.M_STREAM_RUNS_IN_PROGRESS].samples
    assert len(in_progress) <= cap + 1
    assert sum(s.value for s in in_progress) == len(waiting)  # every open run still shows
    overflowed = {
        s.labels["metric"]: s.value
        for s in families["saga_sidecar_series_overflowed"].samples
        if s.name.endswith("_total")
    }
    assert overflowed[sc.M_STREAM_RUNS_STARTED] == 2 * (cap + extra) - cap
