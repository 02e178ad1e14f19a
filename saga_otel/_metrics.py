"""The library's Prometheus metrics, one set per registry.

prometheus-client refuses to register a name twice in one registry, and many
sagas (and the exporter) share one registry, so sets are cached by registry.
No label ever holds a run id: that would grow the series without bound.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from saga_otel import semconv as sc

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class SagaMetrics:
    runs_started: Counter
    runs_finished: Counter
    runs_in_progress: Gauge
    steps: Counter
    step_duration: Histogram
    step_retries: Counter
    pivots: Counter
    unwinds: Counter
    compensations: Counter
    compensation_failures: Counter
    stuck_runs: Counter
    export_failures: Counter
    telemetry_errors: Counter


_lock = threading.Lock()
# Held across a fork: taken by a thread the child does not have (fork copies one), it
# stayed held there and the child's first metric set waited forever; and a set half
# registered in the parent would be registered again.
os.register_at_fork(
    before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_lock.release
)
_sets: dict[int, tuple[CollectorRegistry, SagaMetrics]] = {}


def _build(registry: CollectorRegistry) -> SagaMetrics:
    def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
        return Counter(name, doc, labels, registry=registry)

    kw: dict[str, Any] = {"registry": registry}
    return SagaMetrics(
        runs_started=counter(sc.M_RUNS_STARTED, "Saga runs started.", ("saga",)),
        runs_finished=counter(
            sc.M_RUNS_FINISHED, "Saga runs finished, by final status.", ("saga", "status")
        ),
        runs_in_progress=Gauge(
            sc.M_RUNS_IN_PROGRESS, "Saga runs currently open in this process.", ("saga",), **kw
        ),
        steps=counter(
            sc.M_STEPS,
            "Step attempts (do, compensate, validate), by outcome.",
            ("saga", "step", "phase", "outcome"),
        ),
        step_duration=Histogram(
            sc.M_STEP_DURATION,
            "Duration of one step attempt in seconds.",
            ("saga", "step", "phase"),
            buckets=_BUCKETS,
            **kw,
        ),
        step_retries=counter(
            sc.M_STEP_RETRIES, "Step attempts after the first.", ("saga", "step", "phase")
        ),
        pivots=counter(sc.M_PIVOTS, "Pivots crossed (irreversible steps done).", ("saga", "step")),
        unwinds=counter(sc.M_UNWINDS, "Unwinds started.", ("saga",)),
        compensations=counter(
            sc.M_COMPENSATIONS,
            "Compensations finished, by final outcome.",
            ("saga", "step", "outcome"),
        ),
        compensation_failures=counter(
            sc.M_COMPENSATION_FAILURES,
            "Compensations that failed after their last attempt, or never ran (a write that "
            "returned after its run stopped waiting for it).",
            ("saga", "step"),
        ),
        stuck_runs=counter(sc.M_STUCK_RUNS, "Runs that failed past their pivot.", ("saga",)),
        export_failures=counter(
            sc.M_EXPORT_FAILURES,
            "Saga spans not acknowledged by the sidecar in time, by reason.",
            ("reason",),
        ),
        telemetry_errors=counter(
            sc.M_TELEMETRY_ERRORS,
            "Errors inside saga_otel's own telemetry, swallowed to protect the agent.",
            ("kind",),
        ),
    )


def metrics_for(registry: CollectorRegistry | None = None) -> SagaMetrics:
    """The metric set bound to ``registry`` (default: prometheus-client's global one)."""
    reg = REGISTRY if registry is None else registry
    with _lock:
        hit = _sets.get(id(reg))
        if hit is not None and hit[0] is reg:
            return hit[1]
        made = _build(reg)
        _sets[id(reg)] = (reg, made)
        return made


def start_metrics_server(
    port: int = 0, *, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> int:
    """Serve ``/metrics`` for a process that has no endpoint yet; returns the bound port.

    Binds loopback unless told otherwise.
    """
    from prometheus_client import start_http_server

    reg = REGISTRY if registry is None else registry
    metrics_for(reg)  # make the series exist before the first scrape
    server, _thread = start_http_server(port, addr=addr, registry=reg)
    return int(server.server_port)
