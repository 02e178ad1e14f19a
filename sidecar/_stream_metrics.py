"""Saga metrics derived from the spans the sidecar receives, for agents in any language.

The agent-side library exports its own Prometheus metrics; an agent written with
another OpenTelemetry SDK exports none. These tell the same story from the span
stream alone (names in ``saga_otel.semconv``, ``M_STREAM_*``), labelled by saga and
service, never by run id. Counted once per span: a resent span (same id, same bytes)
is not counted again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from saga_otel import semconv as sc
from saga_otel.records import is_pivot

from ._log import get_logger
from ._otlp import SpanRecord
from ._state import RunState, Transition

log = get_logger("sidecar.metrics")

# Statuses a run ends in (runs_finished{status}); orphaned is a counter of its own.
FINISHED = frozenset(
    {
        sc.STATUS_COMPLETED,
        sc.STATUS_COMPENSATED,
        sc.STATUS_COMPENSATION_FAILED,
        sc.STATUS_STUCK,
        sc.STATUS_REJECTED,
        sc.STATE_RECOVERED,
    }
)
_COUNTED = frozenset({sc.PHASE_DO, sc.PHASE_COMPENSATE, sc.PHASE_UNWIND})
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_UNWIND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)


class _GroupChildren(NamedTuple):
    """What one group of spans counts into: attempts, durations, retries, and the
    compensations (compensate) or pivots (a pivot do) counter."""

    counted: Any
    histogram: Any
    retried: Any
    extra_counted: Any


class StreamMetrics:
    """The ``saga_stream_*`` metrics. Their labels come from the spans (saga, service,
    step and tool names), so each metric holds at most ``max_series`` label sets; past
    that, increments go to its series labelled ``_overflow`` throughout and are counted
    in ``saga_sidecar_series_overflowed_total{metric}`` (logged once per metric)."""

    def __init__(self, registry: CollectorRegistry, max_series: int = sc.STREAM_MAX_SERIES) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._children: dict[tuple[Any, ...], Any] = {}
        # A group key of spans() -> its children; as many as the children allow.
        self._groups: dict[tuple[Any, ...], _GroupChildren] = {}
        self._max_series = max_series
        self._seen_overflow = False  # the gauge's _overflow series, once needed, stays
        self._series: dict[int, int] = {}  # id(metric) -> label sets made
        self._overflow: dict[int, tuple[Any, Any]] = {}  # id(metric) -> (child, counter)
        self.overflowed = Counter(
            sc.M_SIDECAR_SERIES_OVERFLOWED,
            f"Increments of a saga_stream_* metric past its {max_series} label sets, counted "
            f"into its series labelled {sc.STREAM_OVERFLOW}.",
            ["metric"],
            registry=registry,
        )

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["saga", "service", *labels], registry=registry)

        self.runs_started = counter(sc.M_STREAM_RUNS_STARTED, "Runs seen for the first time.")
        self.runs_finished = counter(
            sc.M_STREAM_RUNS_FINISHED,
            "Runs reaching an end status (completed, compensated, compensation_failed, stuck, "
            "rejected, recovered).",
            "status",
        )
        self.runs_in_progress = Gauge(
            sc.M_STREAM_RUNS_IN_PROGRESS,
            "Runs running or unwinding now.",
            ["saga", "service"],
            registry=registry,
        )
        self.runs_orphaned = counter(sc.M_STREAM_RUNS_ORPHANED, "Runs marked orphaned.")
        self.unwinds = counter(sc.M_STREAM_UNWINDS, "Unwinds begun (unwind spans received).")
        self.unwind_duration = Histogram(
            sc.M_STREAM_UNWIND_DURATION,
            "From an unwind's start to its run's end, by the spans' times.",
            ["saga", "service"],
            buckets=_UNWIND_BUCKETS,
            registry=registry,
        )
        self.compensations = counter(
            sc.M_STREAM_COMPENSATIONS,
            "Compensation attempts (compensate spans), by step, tool and outcome.",
            "step",
            "tool",
            "outcome",
        )
        self.compensation_failures = counter(
            sc.M_STREAM_COMPENSATION_FAILURES,
            "Steps whose effect stands when their run ends compensation_failed.",
            "step",
        )
        self.pivots = counter(sc.M_STREAM_PIVOTS, "Pivot steps crossed (OK).", "step")
        self.steps = counter(
            sc.M_STREAM_STEPS,
            "Step attempts (do and compensate spans).",
            "step",
            "phase",
            "outcome",
        )
        self.step_duration = Histogram(
            sc.M_STREAM_STEP_DURATION,
            "Step attempt duration, by the spans' times.",
            ["saga", "service", "step", "phase"],
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.step_retries = counter(
            sc.M_STREAM_STEP_RETRIES, "Step attempts after the first.", "step", "phase"
        )

        self._names = {
            id(m): name
            for name, m in (
                (sc.M_STREAM_RUNS_STARTED, self.runs_started),
                (sc.M_STREAM_RUNS_FINISHED, self.runs_finished),
                (sc.M_STREAM_RUNS_IN_PROGRESS, self.runs_in_progress),
                (sc.M_STREAM_RUNS_ORPHANED, self.runs_orphaned),
                (sc.M_STREAM_UNWINDS, self.unwinds),
                (sc.M_STREAM_UNWIND_DURATION, self.unwind_duration),
                (sc.M_STREAM_COMPENSATIONS, self.compensations),
                (sc.M_STREAM_COMPENSATION_FAILURES, self.compensation_failures),
                (sc.M_STREAM_PIVOTS, self.pivots),
                (sc.M_STREAM_STEPS, self.steps),
                (sc.M_STREAM_STEP_DURATION, self.step_duration),
                (sc.M_STREAM_STEP_RETRIES, self.step_retries),
            )
        }

    def spans(self, spans: Iterable[SpanRecord], state: RunState) -> None:
        """Count newly stored saga spans (folded into ``state`` already).

        Spans are grouped first by what their counts read (labels, phase, outcome,
        retry, tool, pivot): one increment per metric and group, not per span (a
        Prometheus increment takes a lock), and the durations observed per group.
        """
        groups: dict[tuple[Any, ...], list[float]] = {}
        labelled: dict[tuple[object, str], tuple[str, str]] = {}  # a batch is a few runs
        for span in spans:
            attrs = span.attributes
            phase = attrs.get(sc.SAGA_PHASE)
            if phase not in _COUNTED:
                continue
            saga = attrs.get(sc.SAGA_NAME)
            service = span.service
            if not (service and isinstance(saga, str) and saga):  # ask the state (_labels)
                where = (attrs.get(sc.SAGA_RUN_ID), service)
                found = labelled.get(where)
                if found is None:
                    found = labelled[where] = self._labels(span, state)
                saga, service = found
            if phase == sc.PHASE_UNWIND:
                key: tuple[Any, ...] = (saga, service, phase)
            else:
                ok = span.ok
                retry = int(attrs.get(sc.SAGA_STEP_ATTEMPT, 1)) > 1
                extra: str | bool
                if phase == sc.PHASE_COMPENSATE:
                    extra = str(attrs.get(sc.SAGA_COMPENSATION_TOOL) or "")
                else:  # a do: whether it crossed a pivot
                    extra = ok and is_pivot(
                        attrs.get(sc.SAGA_STEP_CLASS), attrs.get(sc.SAGA_STEP_PIVOT) is True
                    )
                step = str(attrs.get(sc.SAGA_STEP_NAME) or "")
                key = (saga, service, phase, step, ok, retry, extra)
            found_group = groups.get(key)
            if found_group is None:
                found_group = groups[key] = []
            found_group.append(span.end - span.start)
        known = self._groups
        for key, durations in groups.items():
            n = len(durations)
            children = known.get(key)
            if children is None:
                children = self._group_children(key)
                if len(known) < 4 * self._max_series:  # past it: looked up each time
                    known[key] = children
            counted, histogram, retried, extra_counted = children
            counted.inc(n)
            if histogram is not None:
                for duration in durations:
                    histogram.observe(max(0.0, duration))
            if retried is not None:
                retried.inc(n)
            if extra_counted is not None:
                extra_counted.inc(n)

    def _group_children(self, key: tuple[Any, ...]) -> _GroupChildren:
        """The children a group of :meth:`spans` counts into, in the order it counts."""
        child = self._child
        saga, service, phase = key[:3]
        if phase == sc.PHASE_UNWIND:
            return _GroupChildren(child(self.unwinds, saga, service), None, None, None)
        step, ok, retry, extra = key[3:]
        extra_counted = None
        if phase == sc.PHASE_COMPENSATE:
            outcome = "ok" if ok else "failed"
            extra_counted = child(self.compensations, saga, service, step, str(extra), outcome)
        elif extra:
            extra_counted = child(self.pivots, saga, service, step)
        return _GroupChildren(
            child(self.steps, saga, service, step, phase, "ok" if ok else "error"),
            child(self.step_duration, saga, service, step, phase),
            child(self.step_retries, saga, service, step, phase) if retry else None,
            extra_counted,
        )

    def _child(self, metric: Any, *labels: str) -> Any:
        # labels() costs more than the increment, per span on the intake path: keep the
        # children, at most max_series a metric (see the class).
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            made = self._series.get(id(metric), 0)
            if made >= self._max_series:
                return self._overflowed(metric, len(labels))
            self._series[id(metric)] = made + 1
            found = self._children[key] = metric.labels(*labels)
        return found

    def _overflowed(self, metric: Any, arity: int) -> Any:
        """The series an increment past the cap goes to; counts it (not on the hot path:
        only label sets never seen before get here)."""
        entry = self._overflow.get(id(metric))
        if entry is None:
            name = self._names[id(metric)]
            log.warning(
                "sidecar.metrics.series_overflow",
                metric=name,
                max_series=self._max_series,
                fix="a span attribute used as a label (saga, service, step or tool name) "
                "takes a new value per run: keep names fixed (put ids in other attributes)",
            )
            entry = self._overflow[id(metric)] = (
                metric.labels(*([sc.STREAM_OVERFLOW] * arity)),
                self.overflowed.labels(metric=name),
            )
        entry[1].inc()
        return entry[0]

    def transitions(self, transitions: Iterable[Transition], state: RunState) -> None:
        """Count status changes: runs started, finished by status, orphaned.

        Summed per label set first, through the cached children (a batch opens
        hundreds of runs of a few sagas: one increment each, not one ``labels()``).
        """
        counts: dict[tuple[Any, ...], int] = {}
        child = self._child
        for t in transitions:
            saga, service = state.labels(t.run_id)
            if t.before is None:
                key: tuple[Any, ...] = (self.runs_started, saga, service)
                counts[key] = counts.get(key, 0) + 1
                # At 0 from a saga's first run: "none orphaned" is data, not a gap.
                child(self.runs_orphaned, saga, service)
                child(self.unwinds, saga, service)
            if t.after == sc.STATE_ORPHANED:
                key = (self.runs_orphaned, saga, service)
                counts[key] = counts.get(key, 0) + 1
            elif t.after in FINISHED:
                key = (self.runs_finished, saga, service, t.after)
                counts[key] = counts.get(key, 0) + 1
                duration = state.unwind_duration(t.run_id)
                if duration is not None and t.after != sc.STATUS_COMPLETED:
                    child(self.unwind_duration, saga, service).observe(duration)
                if t.after == sc.STATUS_COMPENSATION_FAILED:
                    for step in state.failed_compensations(t.run_id):
                        key = (self.compensation_failures, saga, service, step)
                        counts[key] = counts.get(key, 0) + 1
        for (metric, *labels), n in counts.items():
            child(metric, *labels).inc(n)

    def render(self, state: RunState) -> None:
        """Set the gauges (at scrape time)."""
        # A (saga, service) once seen stays, at 0 when nothing is open: a panel shows a
        # flat line rather than no data. Bounded by sagas x services.
        counts = state.in_progress()
        overflow = 0
        for key, n in counts.items():
            if key in self._seen:
                continue
            if len(self._seen) < self._max_series:
                self._seen.add(key)
            else:
                overflow += n
        for key in self._seen:
            self.runs_in_progress.labels(*key).set(counts.get(key, 0))
        if overflow or self._seen_overflow:
            self._seen_overflow = True
            self.runs_in_progress.labels(sc.STREAM_OVERFLOW, sc.STREAM_OVERFLOW).set(overflow)

    @staticmethod
    def _labels(span: SpanRecord, state: RunState) -> tuple[str, str]:
        saga = span.attributes.get(sc.SAGA_NAME)
        known_saga, known_service = state.labels(span.run_id)
        return (saga if isinstance(saga, str) and saga else known_saga), (
            span.service or known_service
        )
