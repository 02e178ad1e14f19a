"""The sidecar's Prometheus metrics, in a registry of its own (names from semconv)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from saga_otel import semconv as sc

from ._leases import SPAN_REFUSAL_REASONS
from ._state import ALL_STATES, RunState
from ._stream_metrics import StreamMetrics


class SidecarMetrics:
    """``registry`` is shared with the alerting side, which adds its own metrics to it."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.spans_received = Counter(
            sc.M_SIDECAR_SPANS_RECEIVED,
            "Spans received, by transport (http, grpc) and outcome (accepted, ignored, rejected, "
            "unavailable: not stored, answered 503 for the exporter to resend).",
            ["transport", "outcome"],
            registry=self.registry,
        )
        self.runs = Gauge(
            sc.M_SIDECAR_RUNS,
            "Runs the sidecar holds in memory (finished ones are put away in the store), by state.",
            ["state"],
            registry=self.registry,
        )
        self.orphaned_runs = Gauge(
            sc.M_SIDECAR_ORPHANED_RUNS,
            "Orphaned runs nobody has resolved yet.",
            registry=self.registry,
        )
        self.request_duration = Histogram(
            sc.M_SIDECAR_REQUEST_DURATION,
            "Time to answer a request, by transport (http, grpc, api) and route.",
            ["transport", "route"],
            registry=self.registry,
        )
        self.intake_waiting = Gauge(
            sc.M_SIDECAR_INTAKE_WAITING,
            "Seconds the oldest OTLP request still waiting for its commit has waited (0: none "
            "waits); grows while the database is stalled, as agents' acknowledgements wait.",
            registry=self.registry,
        )
        self.forward_dropped = Counter(
            sc.M_SIDECAR_FORWARD_DROPPED,
            "Spans not re-exported to the --forward upstream (queue full or upstream failed).",
            registry=self.registry,
        )
        self.spans_refused = Counter(
            sc.M_SIDECAR_SPANS_REFUSED,
            "Saga spans refused by the ownership, fencing and run id rules, by transport and "
            "reason (bad_run_id, foreign_trace, not_owner, stale_token, conflicting_duplicate).",
            ["transport", "reason"],
            registry=self.registry,
        )
        self.lease_requests = Counter(
            sc.M_SIDECAR_LEASE_REQUESTS,
            "Recovery lease requests, by action (grant, renew, release) and outcome (granted, "
            "forced, renewed, released, agent_alive, held, not_holder, unknown_run, bad_request).",
            ["action", "outcome"],
            registry=self.registry,
        )
        self.connections_refused = Counter(
            sc.M_SIDECAR_CONNECTIONS_REFUSED,
            "Connections closed on arrival because their port already held --max-connections, "
            "by port (otlp_http, api): agents' exports or the API were turned away.",
            ["port"],
            registry=self.registry,
        )
        self.tasks_failed = Gauge(
            sc.M_SIDECAR_TASKS_FAILED,
            "Background tasks (alert delivery, orphan detection, pruning, ...) that ended by "
            "an error since start: what they do has stopped until a restart (/healthz names "
            "them and answers 503).",
            registry=self.registry,
        )
        # Saga metrics derived from the received spans (any agent, any language).
        self.stream = StreamMetrics(self.registry)
        for state in ALL_STATES:
            self.runs.labels(state=state)
        for transport in ("http", "grpc"):
            for outcome in ("accepted", "ignored", "rejected", "unavailable"):
                self.spans_received.labels(transport=transport, outcome=outcome)
            for reason in SPAN_REFUSAL_REASONS:
                self.spans_refused.labels(transport=transport, reason=reason)
        for port in ("otlp_http", "api"):
            self.connections_refused.labels(port=port)

    def render(self, state: RunState, intake_waiting: float = 0.0) -> bytes:
        # Run gauges are computed at scrape time: cheaper than tracking every change.
        self.intake_waiting.set(intake_waiting)
        for name, count in state.counts().items():
            self.runs.labels(state=name).set(count)
        self.orphaned_runs.set(state.orphaned_unresolved())
        self.stream.render(state)
        return generate_latest(self.registry)
