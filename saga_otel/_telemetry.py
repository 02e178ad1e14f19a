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
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
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
from saga_otel._errors import ConfigurationError
from saga_otel._logging import default_logger, emitter
from saga_otel._metrics import SagaMetrics, metrics_for
from saga_otel.records import Compensation, StepClass, describe_error, exception_text

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
    return ctx.trace_id.to_bytes(16).hex()  # format(.., "032x"), at half the cost


def _hex_span(ctx: SpanContext) -> str:
    return ctx.span_id.to_bytes(8).hex()  # format(.., "016x")


@dataclass(slots=True)
class RunTelemetry:
    """The live telemetry of one run: its span and the context its steps hang from."""

    run_id: str
    span: Span
    context: Context
    started: float
    identity: dict[str, Any] = field(default_factory=dict)
    # The span's ids, read once when it opened (guarded there): a span that raises when
    # asked them must not keep the run from closing. Invalid (ids 0) if unreadable.
    span_context: SpanContext = trace.INVALID_SPAN_CONTEXT

    @property
    def trace_id(self) -> int:
        return self.span_context.trace_id

    @property
    def span_id(self) -> int:
        return self.span_context.span_id


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
    return head + "".join(entries) + exception_only(exc)


def exception_only(exc: BaseException) -> str:
    """``"".join(traceback.format_exception_only(exc))``, without building a
    ``TracebackException`` (and its walk of the cause chain) for the plain case: an
    exception with no notes, not a syntax error or a group."""
    kind = type(exc)
    if (
        issubclass(kind, (SyntaxError, BaseExceptionGroup))
        or getattr(exc, "__notes__", None) is not None
    ):
        return "".join(traceback.format_exception_only(exc))
    text = exception_text(exc)
    module = kind.__module__
    name = kind.__qualname__
    if module not in ("__main__", "builtins"):
        name = f"{module if isinstance(module, str) else '<unknown>'}.{name}"
    return f"{name}: {text}\n" if text else f"{name}\n"


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
            "exception.message": exception_text(exc),
            "exception.stacktrace": bounded_stack(exc),
            "exception.escaped": "False",
        },
    )


class _Kind:
    """What every attempt of one step kind shares (phase, step, tool, class, pivot),
    computed once per Instrumentation: the span name, the attributes that follow the
    run's identity, and the metric children by outcome."""

    __slots__ = (
        "after",
        "before",
        "error",
        "middle",
        "name",
        "ok",
        "retries",
        "template",
    )

    def __init__(
        self,
        phase: str,
        step: str,
        tool: str | None,
        step_class: StepClass | None,
        pivot: bool,
    ) -> None:
        self.name = _SPAN_NAMES[phase](step)
        # The attribute order of the contract's tables: identity, phase and step, index
        # and attempt (not for validate), class and pivot (do), [tool call id],
        # [compensation], then the gen_ai tool.
        self.before: dict[str, Any] = {sc.SAGA_PHASE: phase, sc.SAGA_STEP_NAME: step}
        self.middle: dict[str, Any] = {}
        if phase == sc.PHASE_DO:
            self.middle[sc.SAGA_STEP_CLASS] = (step_class or StepClass.CONVERGENT).value
            self.middle[sc.SAGA_STEP_PIVOT] = bool(pivot)
        self.after: dict[str, Any] = {}
        if tool is not None and phase in (sc.PHASE_DO, sc.PHASE_COMPENSATE):
            self.after[sc.GEN_AI_OPERATION_NAME] = sc.GEN_AI_OPERATION_EXECUTE_TOOL
            self.after[sc.GEN_AI_TOOL_NAME] = tool
        self.ok: tuple[Any, Any] | None = None
        self.error: tuple[Any, Any] | None = None
        self.retries: Any = None
        # The identity of the last run seen and its start attributes (index and attempt
        # as placeholders), for the common attempt (no tool call id, no compensation):
        # one dict copy. One tuple, replaced whole and read once per attempt: runs on
        # other threads share it, and two attributes could pair one run's identity with
        # another run's attributes, for good. No lock on the hot path.
        self.template: tuple[dict[str, Any] | None, dict[str, Any]] = (None, {})


class Attempt:
    """One do/compensate/validate attempt: the ``with`` around it (opens the span at
    enter, closes it at exit) and the handle its body gets (``span``, ``extra``
    attributes set at the end, :meth:`pushed`)."""

    __slots__ = (
        "_attempt",
        "_attrs",
        "_instr",
        "_kind",
        "_phase",
        "_run",
        "_step",
        "_t0",
        "extra",
        "span",
    )

    def __init__(
        self,
        instr: Instrumentation,
        run: RunTelemetry,
        phase: str,
        step: str,
        attempt: int,
        attrs: dict[str, Any],
        kind: _Kind,
    ) -> None:
        self._instr, self._run, self._phase, self._step = instr, run, phase, step
        self._attempt, self._attrs, self._kind = attempt, attrs, kind
        self.span: Span = trace.INVALID_SPAN
        self.extra: dict[str, Any] = {}
        self._t0 = 0.0

    def pushed(self, comp: Compensation) -> None:
        extra = self.extra
        extra[sc.SAGA_COMPENSATION_TOOL] = comp.tool
        extra[sc.SAGA_COMPENSATION_ARGS] = comp.args_json()
        extra[sc.SAGA_COMPENSATION_DESCRIPTION] = comp.description

    def common(self) -> dict[str, Any]:
        return {
            "saga": self._instr.saga,
            "run_id": self._run.run_id,
            "step": self._step,
            "phase": self._phase,
            "attempt": self._attempt,
        }

    def __enter__(self) -> Attempt:
        instr = self._instr
        try:
            self.span = instr.tracer.start_span(
                self._kind.name, context=self._run.context, attributes=self._attrs
            )
        except Exception as exc:
            instr.swallowed("span", exc)
        # Start events are debug: the finish event carries everything, at half the cost.
        if instr.wants_debug():
            instr._emit("debug", sc.EV_STEP_STARTED, self.span, self.common())
        if self._attempt > 1:
            try:
                kind = self._kind
                if kind.retries is None:
                    kind.retries = instr._child(
                        instr.metrics.step_retries, instr.saga, self._step, self._phase
                    )
                kind.retries.inc()
            except Exception as exc:
                instr.swallowed("metric", exc)
        self._t0 = time.perf_counter()
        return self

    def __exit__(
        self, _et: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> Literal[False]:
        self._instr._finish_attempt(self, time.perf_counter() - self._t0, exc)
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
        self._kinds: dict[tuple[str, str, str | None, StepClass | None, bool], _Kind] = {}
        self._trace_hex: tuple[int, str] = (0, "")
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

    @property
    def log(self) -> Any:
        """The logger the events go to (settable)."""
        return self._log

    @log.setter
    def log(self, logger: Any) -> None:
        self._log = logger
        fast = emitter(logger)
        # The library's own logger has a fixed level: which levels pass is known now,
        # and its events are written from the fields dict as built.
        self._on: dict[str, bool] | None = None
        self._write: Callable[[str, str, dict[str, Any]], None] | None = None
        if fast is not None:
            level, self._write = fast
            self._on = {name: number >= level for name, number in _LEVELS.items()}

    def _enabled(self, level: str) -> bool:
        if self._on is not None:
            return self._on[level]
        check = getattr(self._log, "is_enabled_for", None)
        if check is None:
            return True
        try:
            return bool(check(_LEVELS[level]))
        except Exception:
            return True

    def wants_debug(self) -> bool:
        """Whether debug events are written: skips building one that would be dropped."""
        on = self._on
        return on["debug"] if on is not None else self._enabled("debug")

    def _event(self, level: str, event: str, span: Span | None, **fields: Any) -> None:
        self._emit(level, event, span, fields)

    def _emit(self, level: str, event: str, span: Span | None, fields: dict[str, Any]) -> None:
        """One log event with the span's ids; ``fields`` is consumed. Never raises."""
        try:
            on = self._on
            if not (on[level] if on is not None else self._enabled(level)):
                return  # skip building the event at all
            ctx = span.get_span_context() if span is not None else None
            if ctx is not None and ctx.is_valid:
                trace_id = ctx.trace_id
                last = self._trace_hex
                if last[0] != trace_id:  # a run's spans share one trace: format it once
                    last = self._trace_hex = (trace_id, _hex_trace(ctx))
                fields["trace_id"] = last[1]
                fields["span_id"] = _hex_span(ctx)
            write = self._write
            if write is not None:
                write(level, event, fields)
            else:
                getattr(self._log, level)(event, **fields)
        except Exception as exc:  # telemetry must never break the agent
            self.swallowed("log", exc)

    def _identity(self, run: RunTelemetry, phase: str) -> dict[str, Any]:
        return {**run.identity, sc.SAGA_PHASE: phase}

    # -- runs ----------------------------------------------------------------
    @staticmethod
    def check_run_id(run_id: str | None) -> None:
        """Refuse, before the run opens, a run id the sidecar would refuse: its spans would
        never show there (no alert, no recovery). None or "" asks for a generated id."""
        if run_id:
            problem = sc.run_id_problem(run_id)
            if problem is not None:
                raise ConfigurationError(
                    f"{problem}. The sidecar refuses every span of such a run, so it could "
                    "neither alert on it nor recover it: pass a valid id (an id an end user "
                    "chose is better hashed), or none for a generated one"
                )

    def start_run(
        self, run_id: str | None = None, *, trace_id: int = 0, parent_span_id: int = 0
    ) -> RunTelemetry:
        """Open the run span. Given ``trace_id``, the span joins that trace (recovery, a
        resume); else it is the root of a trace of its own, linked to the current span."""
        links: tuple[Link, ...] = ()
        if not trace_id:
            # A fresh run's trace id is its run id: joining the current trace would give
            # every run begun in one agent span the same id (one run in the sidecar, shared
            # idempotency keys). A root with a link keeps the agent's trace connected.
            parent = Context()
            # The current span is the user's: one whose context raises costs the link only.
            current = self._guard("span", lambda: trace.get_current_span().get_span_context())
            if current is not None and current.is_valid:
                links = (Link(current),)
        else:
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
                    sc.run_span_name(self.saga),
                    context=parent,
                    kind=SpanKind.INTERNAL,
                    links=links,
                ),
            )
            or trace.INVALID_SPAN
        )
        ctx = self._guard("span", lambda: span.get_span_context()) or trace.INVALID_SPAN_CONTEXT
        rid = run_id or _hex_trace(ctx)
        if rid == "0" * 32:  # no SDK installed, or no ids to read: still a unique id
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
            span_context=ctx,
        )
        self._guard("span", lambda: span.set_attributes(self._identity(run, sc.PHASE_RUN)))
        self._guard("metric", lambda: self._child(self.metrics.runs_started, self.saga).inc())
        self._guard("metric", lambda: self._child(self.metrics.runs_in_progress, self.saga).inc())
        self._event("info", sc.EV_RUN_STARTED, span, saga=self.saga, run_id=rid)
        return run

    def end_run(self, run: RunTelemetry, status: str, failed_step: str | None) -> None:
        def close() -> None:
            ending: dict[str, Any] = {sc.SAGA_RUN_STATUS: status}
            if failed_step is not None and status != sc.STATUS_COMPLETED:
                ending[sc.SAGA_RUN_FAILED_STEP] = failed_step
            try:
                run.span.set_attributes(ending)  # one pass through the SDK's attribute cleaning
                if status == sc.STATUS_COMPLETED:
                    run.span.set_status(_OK)
                else:
                    run.span.set_status(Status(StatusCode.ERROR, f"run ended {status}"))
            finally:
                run.span.end()  # as an attempt's: never left open

        self._guard("span", close)
        self._guard("metric", lambda: self._child(self.metrics.runs_in_progress, self.saga).dec())
        self._guard(
            "metric",
            lambda: self._child(self.metrics.runs_finished, self.saga, status).inc(),
        )
        if status == sc.STATUS_STUCK:
            self._guard("metric", lambda: self._child(self.metrics.stuck_runs, self.saga).inc())
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
    ) -> Attempt:
        """One attempt as a span, two log events and metrics.

        The body's exception is recorded and re-raised unchanged. Used as a
        plain ``with`` in sync and async code alike, so the span closes after
        the awaited call, never before.
        """
        key = (phase, step, tool, step_class, pivot)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = _Kind(phase, step, tool, step_class, pivot)
        if compensation is None and (phase != sc.PHASE_DO or not _tool_call_id.get()):
            template = kind.template
            if template[0] != run.identity:  # another run (or its identity grew): rebuild
                ident = dict(run.identity)  # the attributes are made from this very copy
                template = kind.template = (
                    ident,
                    self._start_attributes(ident, kind, phase, 0, 1, None, None),
                )
            attrs = template[1].copy()  # the same keys in the same order
            if phase != sc.PHASE_VALIDATE:
                attrs[sc.SAGA_STEP_INDEX] = index
                attrs[sc.SAGA_STEP_ATTEMPT] = attempt
        else:
            attrs = self._start_attributes(
                run.identity, kind, phase, index, attempt, _tool_call_id.get(), compensation
            )
        return Attempt(self, run, phase, step, attempt, attrs, kind)

    @staticmethod
    def _start_attributes(
        identity: Mapping[str, Any],
        kind: _Kind,
        phase: str,
        index: int,
        attempt: int,
        call_id: str | None,
        compensation: Compensation | None,
    ) -> dict[str, Any]:
        """An attempt's span attributes at start, in the contract tables' order."""
        attrs = {**identity, **kind.before}
        if phase != sc.PHASE_VALIDATE:  # the contract gives validate spans no index/attempt
            attrs[sc.SAGA_STEP_INDEX] = index
            attrs[sc.SAGA_STEP_ATTEMPT] = attempt
        if phase == sc.PHASE_DO:
            attrs.update(kind.middle)
            if call_id:
                attrs[sc.GEN_AI_TOOL_CALL_ID] = call_id
        if compensation is not None:
            attrs[sc.SAGA_COMPENSATION_TOOL] = compensation.tool
            attrs[sc.SAGA_COMPENSATION_ARGS] = compensation_json(compensation)
        if kind.after:
            attrs.update(kind.after)
        return attrs

    def _finish_attempt(self, scope: Attempt, elapsed: float, exc: BaseException | None) -> None:
        span, kind = scope.span, scope._kind
        try:
            try:
                if scope.extra:
                    span.set_attributes(scope.extra)
                if exc is None:
                    span.set_status(_OK)
                else:
                    record_error(span, exc)
                    span.set_attribute(sc.ERROR_TYPE, type(exc).__qualname__)
                    span.set_status(Status(StatusCode.ERROR, describe_error(exc)))
            finally:
                span.end()  # a span left open is never exported: end it whatever failed above
        except Exception as err:  # telemetry must never break the agent
            self.swallowed("span", err)
        outcome = "ok" if exc is None else "error"
        try:
            children = kind.ok if exc is None else kind.error
            if children is None:
                children = self._step_children(scope._step, scope._phase, outcome)
                if exc is None:
                    kind.ok = children
                else:
                    kind.error = children
            children[0].inc()
            children[1].observe(elapsed)
        except Exception as err:
            self.swallowed("metric", err)
        level = "info" if exc is None else "warning"
        if self._on is not None and not self._on[level]:
            return  # the event would be dropped: do not build it
        self._emit(
            level,
            sc.EV_STEP_FINISHED,
            span,
            {
                "saga": self.saga,
                "run_id": scope._run.run_id,
                "step": scope._step,
                "phase": scope._phase,
                "attempt": scope._attempt,
                "outcome": outcome,
                "duration_s": round(elapsed, 6),
                "error": None if exc is None else describe_error(exc),
            },
        )

    # -- moments -------------------------------------------------------------
    def pivot_crossed(self, run: RunTelemetry, step: str) -> None:
        self._guard("metric", lambda: self._child(self.metrics.pivots, self.saga, step).inc())
        self._event("info", sc.EV_PIVOT, run.span, saga=self.saga, run_id=run.run_id, step=step)

    def compensation_finished(self, step: str, ok: bool) -> None:
        outcome = "ok" if ok else "failed"
        self._guard(
            "metric",
            lambda: self._child(self.metrics.compensations, self.saga, step, outcome).inc(),
        )
        if not ok:
            self._guard(
                "metric",
                lambda: self._child(self.metrics.compensation_failures, self.saga, step).inc(),
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
        self._guard("metric", lambda: self._child(self.metrics.unwinds, self.saga).inc())
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

    def unwind_waiting(
        self, run: RunTelemetry, failed_step: str | None, waiting: Sequence[str], timeout: float
    ) -> None:
        """The run failed with writes in flight: its unwind waits for them first."""
        self._event(
            "warning",
            sc.EV_UNWIND_WAITING,
            run.span,
            saga=self.saga,
            run_id=run.run_id,
            failed_step=failed_step,
            waiting=list(waiting),
            timeout_s=timeout,
        )

    def late_effect(
        self, run: RunTelemetry, step: str, index: int, reason: str, comp: Compensation | None
    ) -> None:
        """A write that returned after its run stopped waiting for it: it stands, and its
        undo never runs. Counted as a compensation failure of its step: an effect that
        stands with no undo, as the sidecar counts one."""
        self._guard(
            "metric",
            lambda: self._child(self.metrics.compensation_failures, self.saga, step).inc(),
        )
        self._event(
            "error",
            sc.EV_LATE_EFFECT,
            run.span,
            saga=self.saga,
            run_id=run.run_id,
            step=step,
            index=index,
            reason=reason,
            compensation=comp.to_dict() if comp is not None else None,
        )

    def escalate(self, run: RunTelemetry, reason: str, card: Mapping[str, Any]) -> Span:
        attrs = {
            **self._identity(run, sc.PHASE_ESCALATE),
            sc.SAGA_ESCALATION_REASON: reason,
            sc.SAGA_ESCALATION_CARD: json.dumps(dict(card), sort_keys=True),
        }
        # The log line is the default escalation handler's job (see _engine.log_escalation).
        return self._instant(run, sc.escalate_span_name(self.saga), attrs)
