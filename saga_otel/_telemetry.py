"""Spans, log events and metrics for every run, do, compensate, unwind and escalation.

One :class:`Instrumentation` serves the engine and ``observed()`` alike, so both
emit exactly the same telemetry. Telemetry never breaks the agent: any error
raised by a tracer, logger or metric is caught, logged and counted, and the
agent's own exception always propagates unchanged.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TracerProvider,
)
from prometheus_client import CollectorRegistry

from saga_otel import semconv as sc
from saga_otel._logging import default_logger
from saga_otel._metrics import SagaMetrics, metrics_for
from saga_otel.records import Compensation, StepClass, describe_error

_VERSION = "0.1.0"

_tool_call_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "saga_otel_tool_call_id", default=None
)


@contextmanager
def tool_call_id(call_id: str | None) -> Iterator[None]:
    """Mark the saga calls made inside this block with the model's tool-call id.

    Framework adapters wrap ``run.call`` in it, so the ``do`` spans carry
    ``gen_ai.tool.call.id`` (the id the model gave the call); ``None`` marks nothing.
    """
    token = _tool_call_id.set(call_id)
    try:
        yield
    finally:
        _tool_call_id.reset(token)


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

_SPAN_NAMES: dict[str, Callable[[str], str]] = {
    sc.PHASE_DO: sc.do_span_name,
    sc.PHASE_COMPENSATE: sc.compensate_span_name,
    sc.PHASE_VALIDATE: sc.validate_span_name,
}


def _hex_trace(ctx: SpanContext) -> str:
    return format(ctx.trace_id, "032x")


def _hex_span(ctx: SpanContext) -> str:
    return format(ctx.span_id, "016x")


@dataclass(slots=True)
class RunTelemetry:
    """The live telemetry of one run: its span and the context its steps hang from."""

    run_id: str
    span: Span
    context: Context
    started: float
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def trace_id(self) -> int:
        return self.span.get_span_context().trace_id

    @property
    def span_id(self) -> int:
        return self.span.get_span_context().span_id


@dataclass(slots=True)
class Attempt:
    """Handle given to the body of one do/compensate/validate attempt."""

    span: Span
    extra: dict[str, Any] = field(default_factory=dict)

    def pushed(self, comp: Compensation) -> None:
        self.extra[sc.SAGA_COMPENSATION_TOOL] = comp.tool
        self.extra[sc.SAGA_COMPENSATION_ARGS] = compensation_json(comp)
        self.extra[sc.SAGA_COMPENSATION_DESCRIPTION] = comp.description


_OK = Status(StatusCode.OK)

#: Frames kept in a recorded exception's stack (the innermost ones): enough to
#: find the failing line, without formatting an agent's whole call stack per failure.
STACK_FRAMES = 16


def compensation_json(comp: Compensation) -> str:
    """The undo's arguments as the span attribute's JSON, encoded once per record."""
    return comp.args_json()


def bounded_stack(exc: BaseException, frames: int = STACK_FRAMES) -> str:
    """A traceback's innermost ``frames`` frames and the exception line, in Python's
    shape but without source lines: reading source files is most of what a full
    ``traceback.format_exception`` costs a failed step."""
    entries: deque[str] = deque(maxlen=frames)
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        entries.append(f'  File "{code.co_filename}", line {tb.tb_lineno}, in {code.co_name}\n')
        tb = tb.tb_next
    head = "Traceback (most recent call last):\n" if entries else ""
    return head + "".join(entries) + "".join(traceback.format_exception_only(exc))


def record_error(span: Span, exc: BaseException) -> None:
    """``span.record_exception`` made cheap: the same event and attributes (type,
    message, stacktrace, escaped), the stack bounded by :func:`bounded_stack`."""
    kind = type(exc)
    module = kind.__module__
    name = f"{module}.{kind.__qualname__}" if module and module != "builtins" else kind.__qualname__
    span.add_event(
        "exception",
        {
            "exception.type": name,
            "exception.message": str(exc),
            "exception.stacktrace": bounded_stack(exc),
            "exception.escaped": "False",
        },
    )


class _AttemptScope:
    """The ``with`` around one attempt: opens the span at enter, closes it at exit."""

    __slots__ = ("attempt", "attrs", "handle", "instr", "phase", "run", "span", "step", "t0")

    def __init__(
        self,
        instr: Instrumentation,
        run: RunTelemetry,
        phase: str,
        step: str,
        attempt: int,
        attrs: dict[str, Any],
    ) -> None:
        self.instr, self.run, self.phase, self.step = instr, run, phase, step
        self.attempt, self.attrs = attempt, attrs
        self.span: Span = trace.INVALID_SPAN
        self.handle = Attempt(trace.INVALID_SPAN)
        self.t0 = 0.0

    def common(self) -> dict[str, Any]:
        return {
            "saga": self.instr.saga,
            "run_id": self.run.run_id,
            "step": self.step,
            "phase": self.phase,
            "attempt": self.attempt,
        }

    def __enter__(self) -> Attempt:
        instr = self.instr
        try:
            self.span = instr.tracer.start_span(
                _SPAN_NAMES[self.phase](self.step), context=self.run.context, attributes=self.attrs
            )
        except Exception as exc:
            instr.swallowed("span", exc)
            self.span = trace.INVALID_SPAN
        self.handle.span = self.span
        # Start events are debug: the finish event carries everything, at half the cost.
        if instr.wants_debug():
            instr._emit("debug", sc.EV_STEP_STARTED, self.span, self.common())
        if self.attempt > 1:
            try:
                instr._child(instr.metrics.step_retries, instr.saga, self.step, self.phase).inc()
            except Exception as exc:
                instr.swallowed("metric", exc)
        self.t0 = time.perf_counter()
        return self.handle

    def __exit__(
        self, _et: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> Literal[False]:
        self.instr._finish_attempt(self, time.perf_counter() - self.t0, exc)
        return False  # the body's exception propagates unchanged


class Instrumentation:
    """Tracer, metrics and logger for one saga name; the globals unless given."""

    def __init__(
        self,
        saga: str,
        *,
        tracer_provider: TracerProvider | None = None,
        registry: CollectorRegistry | None = None,
        logger: Any = None,
    ) -> None:
        self.saga = saga
        provider = tracer_provider or trace.get_tracer_provider()
        self.tracer = provider.get_tracer("saga_otel", _VERSION)
        self.metrics: SagaMetrics = metrics_for(registry)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._steps: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self.log = logger if logger is not None else default_logger()

    # -- safety ------------------------------------------------------------
    def _guard(self, kind: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # telemetry must never break the agent
            self.swallowed(kind, exc)
            return None

    def _child(self, metric: Any, *labels: str) -> Any:
        """A labelled child, cached: prometheus-client's labels() is the costly part."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _step_children(self, step: str, phase: str, outcome: str) -> tuple[Any, Any]:
        """The attempt's counter and duration histogram, looked up once per step and outcome."""
        key = (step, phase, outcome)
        found = self._steps.get(key)
        if found is None:
            found = self._steps[key] = (
                self._child(self.metrics.steps, self.saga, step, phase, outcome),
                self._child(self.metrics.step_duration, self.saga, step, phase),
            )
        return found

    def swallowed(self, kind: str, exc: BaseException) -> None:
        """Count and log an error that must not reach the agent."""
        try:
            self.metrics.telemetry_errors.labels(kind=kind).inc()
            self.log.error(sc.EV_TELEMETRY_ERROR, kind=kind, error=describe_error(exc))
        except Exception:
            pass

    def _enabled(self, level: str) -> bool:
        check = getattr(self.log, "is_enabled_for", None)
        if check is None:
            return True
        try:
            return bool(check(_LEVELS[level]))
        except Exception:
            return True

    def wants_debug(self) -> bool:
        """Whether debug events are written: skips building one that would be dropped."""
        return self._enabled("debug")

    def _event(self, level: str, event: str, span: Span | None, **fields: Any) -> None:
        self._emit(level, event, span, fields)

    def _emit(self, level: str, event: str, span: Span | None, fields: dict[str, Any]) -> None:
        """One log event with the span's ids; ``fields`` is consumed. Never raises."""
        try:
            if not self._enabled(level):  # skip building the event at all
                return
            ctx = span.get_span_context() if span is not None else None
            if ctx is not None and ctx.is_valid:
                fields["trace_id"] = _hex_trace(ctx)
                fields["span_id"] = _hex_span(ctx)
            getattr(self.log, level)(event, **fields)
        except Exception as exc:  # telemetry must never break the agent
            self.swallowed("log", exc)

    def _identity(self, run: RunTelemetry, phase: str) -> dict[str, Any]:
        return {**run.identity, sc.SAGA_PHASE: phase}

    # -- runs ----------------------------------------------------------------
    def start_run(
        self, run_id: str | None = None, *, trace_id: int = 0, parent_span_id: int = 0
    ) -> RunTelemetry:
        """Open the run span. Given ``trace_id``, the span joins that trace (recovery)."""
        parent: Context | None = None
        if trace_id:
            remote = SpanContext(
                trace_id=trace_id,
                span_id=parent_span_id or 1,
                is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED),
            )
            parent = trace.set_span_in_context(NonRecordingSpan(remote))
        span = (
            self._guard(
                "span",
                lambda: self.tracer.start_span(
                    sc.run_span_name(self.saga), context=parent, kind=SpanKind.INTERNAL
                ),
            )
            or trace.INVALID_SPAN
        )
        rid = run_id or _hex_trace(span.get_span_context())
        if rid == "0" * 32:  # no SDK installed: still give the run a unique id
            rid = os.urandom(16).hex()
        run = RunTelemetry(
            run_id=rid,
            span=span,
            context=trace.set_span_in_context(span),
            started=time.perf_counter(),
            identity={
                sc.SAGA_RUN_ID: rid,
                sc.SAGA_NAME: self.saga,
                sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
            },
        )
        self._guard("span", lambda: span.set_attributes(self._identity(run, sc.PHASE_RUN)))
        self._guard("metric", lambda: self.metrics.runs_started.labels(saga=self.saga).inc())
        self._guard("metric", lambda: self.metrics.runs_in_progress.labels(saga=self.saga).inc())
        self._event("info", sc.EV_RUN_STARTED, span, saga=self.saga, run_id=rid)
        return run

    def end_run(self, run: RunTelemetry, status: str, failed_step: str | None) -> None:
        def close() -> None:
            run.span.set_attribute(sc.SAGA_RUN_STATUS, status)
            if failed_step is not None and status != sc.STATUS_COMPLETED:
                run.span.set_attribute(sc.SAGA_RUN_FAILED_STEP, failed_step)
            if status == sc.STATUS_COMPLETED:
                run.span.set_status(Status(StatusCode.OK))
            else:
                run.span.set_status(Status(StatusCode.ERROR, f"run ended {status}"))
            run.span.end()

        self._guard("span", close)
        self._guard("metric", lambda: self.metrics.runs_in_progress.labels(saga=self.saga).dec())
        self._guard(
            "metric",
            lambda: self.metrics.runs_finished.labels(saga=self.saga, status=status).inc(),
        )
        if status == sc.STATUS_STUCK:
            self._guard("metric", lambda: self.metrics.stuck_runs.labels(saga=self.saga).inc())
        level = "info" if status == sc.STATUS_COMPLETED else "warning"
        self._event(
            level,
            sc.EV_RUN_FINISHED,
            run.span,
            saga=self.saga,
            run_id=run.run_id,
            status=status,
            failed_step=failed_step,
            duration_s=round(time.perf_counter() - run.started, 6),
        )

    # -- attempts ----------------------------------------------------------
    def attempt(
        self,
        run: RunTelemetry,
        phase: str,
        step: str,
        *,
        index: int,
        attempt: int = 1,
        tool: str | None = None,
        step_class: StepClass | None = None,
        pivot: bool = False,
        compensation: Compensation | None = None,
    ) -> AbstractContextManager[Attempt]:
        """One attempt as a span, two log events and metrics.

        The body's exception is recorded and re-raised unchanged. Used as a
        plain ``with`` in sync and async code alike, so the span closes after
        the awaited call, never before.
        """
        attrs = dict(run.identity)
        attrs[sc.SAGA_PHASE] = phase
        attrs[sc.SAGA_STEP_NAME] = step
        if phase != sc.PHASE_VALIDATE:  # the contract gives validate spans no index/attempt
            attrs[sc.SAGA_STEP_INDEX] = index
            attrs[sc.SAGA_STEP_ATTEMPT] = attempt
        if phase == sc.PHASE_DO:
            attrs[sc.SAGA_STEP_CLASS] = (step_class or StepClass.CONVERGENT).value
            attrs[sc.SAGA_STEP_PIVOT] = bool(pivot)
            call_id = _tool_call_id.get()
            if call_id:
                attrs[sc.GEN_AI_TOOL_CALL_ID] = call_id
        if compensation is not None:
            attrs[sc.SAGA_COMPENSATION_TOOL] = compensation.tool
            attrs[sc.SAGA_COMPENSATION_ARGS] = compensation_json(compensation)
        if tool is not None and phase in (sc.PHASE_DO, sc.PHASE_COMPENSATE):
            attrs[sc.GEN_AI_OPERATION_NAME] = sc.GEN_AI_OPERATION_EXECUTE_TOOL
            attrs[sc.GEN_AI_TOOL_NAME] = tool
        return _AttemptScope(self, run, phase, step, attempt, attrs)

    def _finish_attempt(
        self, scope: _AttemptScope, elapsed: float, exc: BaseException | None
    ) -> None:
        span, handle = scope.span, scope.handle
        try:
            if handle.extra:
                span.set_attributes(handle.extra)
            if exc is None:
                span.set_status(_OK)
            else:
                record_error(span, exc)
                span.set_attribute(sc.ERROR_TYPE, type(exc).__qualname__)
                span.set_status(Status(StatusCode.ERROR, describe_error(exc)))
            span.end()
        except Exception as err:  # telemetry must never break the agent
            self.swallowed("span", err)
        outcome = "ok" if exc is None else "error"
        try:
            count, duration = self._step_children(scope.step, scope.phase, outcome)
            count.inc()
            duration.observe(elapsed)
        except Exception as err:
            self.swallowed("metric", err)
        fields = scope.common()
        fields["outcome"] = outcome
        fields["duration_s"] = round(elapsed, 6)
        fields["error"] = None if exc is None else describe_error(exc)
        self._emit("info" if exc is None else "warning", sc.EV_STEP_FINISHED, span, fields)

    # -- moments -------------------------------------------------------------
    def pivot_crossed(self, run: RunTelemetry, step: str) -> None:
        self._guard("metric", lambda: self.metrics.pivots.labels(saga=self.saga, step=step).inc())
        self._event("info", sc.EV_PIVOT, run.span, saga=self.saga, run_id=run.run_id, step=step)

    def compensation_finished(self, step: str, ok: bool) -> None:
        outcome = "ok" if ok else "failed"
        self._guard(
            "metric",
            lambda: self.metrics.compensations.labels(
                saga=self.saga, step=step, outcome=outcome
            ).inc(),
        )
        if not ok:
            self._guard(
                "metric",
                lambda: self.metrics.compensation_failures.labels(saga=self.saga, step=step).inc(),
            )

    def _instant(self, run: RunTelemetry, name: str, attrs: Mapping[str, Any]) -> Span:
        def make() -> Span:
            now = time.time_ns()
            span = self.tracer.start_span(
                name, context=run.context, attributes=dict(attrs), start_time=now
            )
            span.end(end_time=now)
            return span

        return self._guard("span", make) or trace.INVALID_SPAN

    def unwind(
        self,
        run: RunTelemetry,
        reason: str,
        failed_step: str | None,
        stack: Sequence[Compensation],
    ) -> Span:
        """The zero-duration span that tells the world an unwind begins."""
        attrs = {
            **self._identity(run, sc.PHASE_UNWIND),
            sc.SAGA_UNWIND_REASON: reason,
            sc.SAGA_RUN_FAILED_STEP: failed_step or "",
            sc.SAGA_STACK: json.dumps([c.to_dict() for c in stack], sort_keys=True),
        }
        span = self._instant(run, sc.unwind_span_name(self.saga), attrs)
        self._guard("metric", lambda: self.metrics.unwinds.labels(saga=self.saga).inc())
        self._event(
            "warning",
            sc.EV_UNWIND,
            span,
            saga=self.saga,
            run_id=run.run_id,
            failed_step=failed_step,
            reason=reason,
            pending=[c.tool for c in stack],
        )
        return span

    def escalate(self, run: RunTelemetry, reason: str, card: Mapping[str, Any]) -> Span:
        attrs = {
            **self._identity(run, sc.PHASE_ESCALATE),
            sc.SAGA_ESCALATION_REASON: reason,
            sc.SAGA_ESCALATION_CARD: json.dumps(dict(card), sort_keys=True),
        }
        # The log line is the default escalation handler's job (see _engine.log_escalation).
        return self._instant(run, sc.escalate_span_name(self.saga), attrs)
