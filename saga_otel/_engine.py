"""The saga engine: the driver around the pure stack in ``_stack.py``.

Two ways in share one engine. Agents assemble a run as they go
(``async with saga.run() as run: await run.call("issue_credit", ...)``); code
with a known plan passes a list of :class:`Step` to :meth:`Saga.execute`. Both
go through :class:`_Core`, which holds the run's state and telemetry and
writes each step's policy once (attempts and their spans, retries with the
policy's backoff, the push and its durable ack, the shielded unwind) as
scripts: generators that yield the calls, sleeps and ack waits they need
(``_outcome.py``). :class:`Run` and :class:`SyncRun` are the two drivers: the
async one awaits each yielded outcome, the sync one calls it, holding the run's turn
except while a call, sleep or wait blocks, so threads sharing a sync run see its
bookkeeping change whole, as tasks sharing an async run do (``SyncMode.drive``).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from saga_otel import _heartbeat
from saga_otel import _stack as st
from saga_otel import semconv as sc
from saga_otel._errors import ConfigurationError, StepRefusedError, ValidationRejectedError
from saga_otel._frozen import fast_init
from saga_otel._outcome import (
    AsyncMode,
    Mode,
    Outcome,
    Script,
    Signal,
    SyncMode,
    _pending,
    is_async_callable,
    retrying,
)
from saga_otel._registry import IDEMPOTENCY_PARAM, CallInfo, Tool, ToolRegistry
from saga_otel._telemetry import Attempt, Instrumentation, RunTelemetry
from saga_otel.records import (
    Compensation,
    CompensationOutcome,
    EscalationCard,
    PendingCall,
    RetryPolicy,
    RunStatus,
    SagaReport,
    StepClass,
    StepRecord,
    describe_error,
    exception_text,
    interrupted_effect,
    is_pivot,
)

T = TypeVar("T")

#: Default bound on one undo's arguments as JSON, well under the sidecar's 16 MiB body limit.
MAX_UNDO_BYTES = 64 * 1024

#: Default bound, in seconds, on an unwind's wait for its run's writes still in flight:
#: longer than a typical API call's own timeout; a write running longer is escalated.
SETTLE_TIMEOUT_S = 30.0

EscalationHandler = Callable[[EscalationCard, SagaReport], None]


@fast_init
@dataclass(frozen=True, slots=True)
class CallContext:
    """What the running tool may ask about its own call (see :func:`current_call`)."""

    saga: str
    run_id: str
    step: str
    index: int
    phase: str
    attempt: int
    idempotency_key: str


_current_call: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "saga_otel_current_call", default=None
)


def current_call() -> CallContext | None:
    """The saga call this code runs inside, or None outside any saga."""
    return _current_call.get()


def idempotency_key(run_id: str, index: int, phase: str = "do") -> str:
    """Stable per run and step, so a retried or resumed call converges on its backend."""
    return f"{run_id}:{index}" if phase == "do" else f"{run_id}:{index}:{phase}"


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a fixed plan: ``do(ctx)``, and ``compensate(ctx)`` to undo it.

    ``step_class`` defaults to compensable when a compensate is given, else
    irreversible for a pivot and convergent otherwise. ``validate(ctx)`` is a
    dry run that must not change anything; it runs before the saga's first do.

    The undo is recorded as the tool ``<step>.compensate`` with the do's result as
    its argument ``result`` when that is plain JSON within the saga's
    ``max_undo_bytes``: for people, and for a recovery from another process, which
    has no ctx and calls its own registry's ``<step>.compensate`` with the record's
    arguments. compensate(ctx) reads only ctx, so a result that cannot be kept is
    left out of the record (such a tool then gets no ``result``) and never fails the
    step.
    """

    name: str
    do: Callable[[Any], Any]
    compensate: Callable[[Any], Any] | None = None
    validate: Callable[[Any], Any] | None = None
    pivot: bool = False
    step_class: StepClass | str | None = None
    retry: RetryPolicy | None = None

    def klass(self) -> StepClass:
        if self.step_class is not None:
            return StepClass.parse(self.step_class)
        if self.compensate is not None:
            return StepClass.COMPENSABLE
        return StepClass.IRREVERSIBLE if self.pivot else StepClass.CONVERGENT

    def as_tools(self, ctx: Any, max_undo_bytes: int = MAX_UNDO_BYTES) -> tuple[Tool, Tool | None]:
        """Adapt the step to the engine's tool model (the undo named ``<step>.compensate``,
        its arguments the step's result when it fits ``max_undo_bytes``: see _result_args)."""
        undo_name = f"{self.name}.compensate"
        do, comp, validate = self.do, self.compensate, self.validate
        cls = self.klass()
        undo: Tool | None = None
        if cls.pushes:
            if comp is None:
                raise ConfigurationError(
                    f"step {self.name!r} is {cls.value} but has no compensate: give it one "
                    "or declare step_class='convergent'"
                )
            undo = Tool(undo_name, _with_ctx(comp, ctx), StepClass.CONVERGENT, retry=self.retry)
        forward = Tool(
            self.name,
            _with_ctx(do, ctx),
            cls,
            compensate=undo_name if cls.pushes else None,
            compensate_args=_result_args(max_undo_bytes),
            describe=f"undo {self.name}",
            validate=_with_ctx(validate, ctx) if validate is not None else None,
            pivot=self.pivot,
        )
        return forward, undo

    def _refuse_async(self) -> None:
        """Refuse a part (do, compensate, validate) that a sync run could not await."""
        parts = {"do": self.do, "compensate": self.compensate, "validate": self.validate}
        for part, fn in parts.items():
            if fn is not None and is_async_callable(fn):
                raise ConfigurationError(
                    f"step {self.name!r} has an async {part} ({_fn_name(fn)}), which "
                    "execute_sync cannot await: run the plan with `await saga.execute(steps, "
                    f"ctx)`, or make the step's {part} a plain function; nothing was run"
                )


def _with_ctx(fn: Callable[[Any], Any], ctx: Any) -> Callable[..., Any]:
    """``fn(ctx)`` as a tool's function: ``async def`` when ``fn`` is async, so the engine
    sees what it is (a sync run refuses it before any write, not in the unwind).

    An undo is called with its record's arguments: the do's ``result``, when kept (see
    _result_args), which is for people and is not passed on: the step's function gets
    ctx alone."""
    if is_async_callable(fn):

        async def call_async(result: Any = None) -> Any:
            del result  # for people only
            return await fn(ctx)

        return call_async

    def call(result: Any = None) -> Any:
        del result
        return fn(ctx)

    return call


def _fn_name(fn: Any) -> str:
    return str(getattr(fn, "__name__", None) or repr(fn))


def _result_args(max_undo_bytes: int) -> Callable[[CallInfo], Mapping[str, Any]]:
    """The undo arguments of a fixed plan's step: ``{"result": ...}``, kept for people (the
    sidecar shows it) and for a recovering registry's ``<step>.compensate`` tool, when the
    result is plain JSON and the record fits ``max_undo_bytes``; else none. In the run,
    compensate(ctx) reads only ctx, so a result that cannot be kept (too large, nested too
    deep for JSON, not JSON at all) is left out and never fails the step."""

    def args(info: CallInfo) -> Mapping[str, Any]:
        if info.result is None:
            return {}
        try:  # encoded as the stored record is, by the record itself
            kept = Compensation(f"{info.tool}.compensate", {"result": info.result})
        except Exception:  # not JSON, a cycle, or RecursionError: it is informational
            return {}
        return kept.args if len(kept.args_json().encode()) <= max_undo_bytes else {}

    return args


def log_escalation(instr: Instrumentation) -> EscalationHandler:
    """The default handler: one error-level log event with the card, structured and as text."""

    # The report is part of the EscalationHandler signature; the log line needs only the card.
    def handle(card: EscalationCard, _report: SagaReport) -> None:
        instr.log.error(
            "saga.escalation",
            saga=card.saga,
            run_id=card.run_id,
            reason=card.reason,
            card=card.to_dict(),
            text=card.render(),
        )

    return handle


class Saga:
    """A kind of saga (``refund``) with its tools, policies and telemetry.

    A Saga holds no per-run state: any number of runs may go at once, in
    threads or tasks, and one run's calls may too (see :class:`SyncRun` for
    threads). ``max_undo_bytes`` bounds one undo's arguments as JSON
    (default 64 KiB, well under the sidecar's body limit): a do whose undo is
    larger, or not JSON, is an effect with no stored undo and fails the call.

    A run that fails with writes still in flight (calls gathered in tasks or
    threads) takes no new step and waits for them before it unwinds, so the undo
    of each that lands is unwound too; ``settle_timeout`` (default 30 s) bounds
    that wait. A write still running past it may stand with no undo: the run
    ends ``compensation_failed`` and escalates it, and if it then returns it is
    logged at error (``saga.effect.late``) and counted, never pushed.
    """

    def __init__(
        self,
        name: str,
        *,
        tools: ToolRegistry | Iterable[Tool] | None = None,
        retry: RetryPolicy | None = None,
        forward_retry: RetryPolicy | None = None,
        recovery_retry: RetryPolicy | None = None,
        allow_writes_after_pivot: bool = False,
        escalation_handlers: Sequence[EscalationHandler] | None = None,
        tracer_provider: TracerProvider | None = None,
        registry: CollectorRegistry | None = None,
        logger: Any = None,
        sleep: Callable[[float], None] = time.sleep,
        async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        max_undo_bytes: int = MAX_UNDO_BYTES,
        settle_timeout: float = SETTLE_TIMEOUT_S,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigurationError(
                f"saga name {name!r} is empty: name the kind of saga, e.g. Saga('refund')"
            )
        if max_undo_bytes < 1:
            raise ConfigurationError(
                f"max_undo_bytes={max_undo_bytes!r} stores no undo at all: use a positive "
                f"bound (default {MAX_UNDO_BYTES})"
            )
        if not 0 <= settle_timeout < math.inf:  # also refuses NaN
            raise ConfigurationError(
                f"settle_timeout={settle_timeout!r} does not bound how long an unwind waits "
                "for its run's writes still in flight: use a finite number of seconds >= 0 "
                f"(default {SETTLE_TIMEOUT_S:g})"
            )
        self.name = name
        self.max_undo_bytes = max_undo_bytes
        self.settle_timeout = float(settle_timeout)
        self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools or ())
        self.retry = retry or RetryPolicy()
        self.forward_retry = forward_retry or RetryPolicy(attempts=1)
        self.recovery_retry = recovery_retry or RetryPolicy(attempts=5, initial=0.2, maximum=10.0)
        self.allow_writes_after_pivot = allow_writes_after_pivot
        self.instr = Instrumentation(
            name, tracer_provider=tracer_provider, registry=registry, logger=logger
        )
        self.escalation_handlers: tuple[EscalationHandler, ...] = (
            tuple(escalation_handlers)
            if escalation_handlers is not None
            else (log_escalation(self.instr),)
        )
        self.sleep = sleep
        self.async_sleep = async_sleep
        self.rng = rng or random.Random()

    # -- runtime-assembled ---------------------------------------------------
    def run(
        self,
        run_id: str | None = None,
        *,
        validate: Sequence[tuple[str, Mapping[str, Any]]] = (),
    ) -> Run:
        """``async with saga.run() as run: await run.call(tool, **args)``.

        ``validate`` lists (tool, args) whose dry runs must pass before anything
        else happens.
        """
        return Run(_Core(self, run_id, validate=validate))

    def run_sync(
        self,
        run_id: str | None = None,
        *,
        validate: Sequence[tuple[str, Mapping[str, Any]]] = (),
    ) -> SyncRun:
        """``with saga.run_sync() as run: run.call(tool, **args)``."""
        return SyncRun(_Core(self, run_id, validate=validate))

    # -- fixed plans ---------------------------------------------------------
    def _step_tools(self, steps: Sequence[Step], ctx: Any) -> tuple[dict[str, Tool], list[Tool]]:
        """A plan's steps as tools by name (do and undo), and the do tools in order."""
        overlay: dict[str, Tool] = {}
        forwards: list[Tool] = []
        for step in steps:
            fwd, undo = step.as_tools(ctx, self.max_undo_bytes)
            if fwd.name in overlay:
                raise ConfigurationError(
                    f"two steps are named {fwd.name!r}: give each step of a plan its own name"
                )
            overlay[fwd.name] = fwd
            if undo is not None:
                overlay[undo.name] = undo
            forwards.append(fwd)
        return overlay, forwards

    def _plan(self, steps: Sequence[Step], ctx: Any) -> tuple[_Core, list[Tool]]:
        overlay, forwards = self._step_tools(steps, ctx)
        core = _Core(
            self,
            None,
            validate=[(t.name, {}) for t in forwards if t.validate is not None],
            overlay=overlay,
        )
        return core, forwards

    def _plan_body(self, core: _Core, mode: Mode, forwards: list[Tool]) -> Script[None]:
        for i, forward in enumerate(forwards):
            core.remaining = [PendingCall(-1, f.name, f.name) for f in forwards[i + 1 :]]
            yield core.call(mode, forward.name, {})

    async def execute(self, steps: Sequence[Step], ctx: Any = None) -> SagaReport:
        """Run a fixed plan; the report carries any error instead of raising it."""
        core, forwards = self._plan(steps, ctx)
        mode = AsyncMode(self.async_sleep)
        return await _pending(core.whole(mode, lambda: self._plan_body(core, mode, forwards)))()

    def execute_sync(self, steps: Sequence[Step], ctx: Any = None) -> SagaReport:
        """`execute` for code without an event loop. A plan with an async do, compensate or
        validate is refused before the run opens: a sync run cannot await it (an async undo
        would fail every try, after the write it was meant to undo)."""
        for step in steps:
            step._refuse_async()
        core, forwards = self._plan(steps, ctx)
        mode = SyncMode(self.sleep)
        return mode.drive(lambda: core.whole(mode, lambda: self._plan_body(core, mode, forwards)))

    # -- forward recovery ------------------------------------------------------
    def _resume_core(self, report: SagaReport, steps: Sequence[Step], ctx: Any) -> _Core:
        if report.status is not RunStatus.STUCK:
            raise StepRefusedError(
                f"run {report.run_id} ended {report.status.value}; only a stuck run is resumed "
                "forward (a compensated run is finished, a compensation_failed one needs a person)"
            )
        overlay, _ = self._step_tools(steps, ctx)
        core = _Core(
            self,
            report.run_id,
            overlay=overlay,
            trace_id=report.trace_id,
            parent_span_id=report.span_id,
        )
        state = st.StackState(
            run_id=report.run_id,
            allow_writes_after_pivot=self.allow_writes_after_pivot,
            phase=st.Phase.ENDED,
            status=RunStatus.STUCK,
            next_index=max((s.index for s in report.steps), default=-1) + 1,
            steps=report.steps,
            pivot=next((s for s in report.steps if s.ok and is_pivot(s.step_class, s.pivot)), None),
        )
        core.state = st.resume(state)
        core.forward_policy = self.recovery_retry
        return core

    @staticmethod
    def _resume_body(core: _Core, mode: Mode, report: SagaReport) -> Script[None]:
        for p in report.pending:
            yield core.call(mode, p.tool, dict(p.args), p.index if p.index >= 0 else None)

    async def resume(
        self, report: SagaReport, steps: Sequence[Step] = (), ctx: Any = None
    ) -> SagaReport:
        """Forward recovery: retry a stuck run's remaining calls until they succeed.

        The calls must be idempotent: each is retried under its original
        idempotency key. The run ends ``completed``, or ``stuck`` again.
        """
        core = self._resume_core(report, steps, ctx)
        mode = AsyncMode(self.async_sleep)
        return await _pending(core.whole(mode, lambda: self._resume_body(core, mode, report)))()

    def resume_sync(
        self, report: SagaReport, steps: Sequence[Step] = (), ctx: Any = None
    ) -> SagaReport:
        """`resume` for agents without an event loop: the same policy, run by the sync driver."""
        core = self._resume_core(report, steps, ctx)
        mode = SyncMode(self.sleep)
        return mode.drive(lambda: core.whole(mode, lambda: self._resume_body(core, mode, report)))


class _Done(NamedTuple):
    """A do that returned: its result, the undo pushed (if any), why none could be stored,
    and the interrupt that stopped the capture of its undo (raised once it is recorded)."""

    result: Any
    pushed: bool
    unstorable: str | None
    span: Any
    interrupt: BaseException | None = None


class UndoFence(Protocol):
    """What a recovery puts around each undo it runs (``saga_otel._recovery``)."""

    def before(self) -> None:
        """Called before each undo; raising stops the unwind there and leaves the run open."""

    def after(self, comp: Compensation, ok: bool) -> None:
        """Called once the undo ended (``ok``: it succeeded); raising stops the unwind too."""


class _Core:
    """The run's state, telemetry and policy; its methods return outcomes a driver runs."""

    def __init__(
        self,
        saga: Saga,
        run_id: str | None,
        *,
        validate: Sequence[tuple[str, Mapping[str, Any]]] = (),
        overlay: Mapping[str, Tool] | None = None,
        trace_id: int = 0,
        parent_span_id: int = 0,
    ) -> None:
        saga.instr.check_run_id(run_id)
        self.saga = saga
        self.instr = saga.instr
        self.requested_run_id = run_id
        self.validations = list(validate)
        self.overlay = dict(overlay or {})
        self.trace_id, self.parent_span_id = trace_id, parent_span_id
        self.forward_policy = saga.forward_retry
        self.remaining: list[PendingCall] = []
        self.tel: RunTelemetry | None = None
        self.state: st.StackState | None = None
        self.error: BaseException | None = None
        self._stop: StopIteration | None = None  # a step's, for _as_raised
        self.report: SagaReport | None = None
        self.fence: UndoFence | None = None  # set by a recovery: its lease around each undo
        self._settling: Signal | None = None  # rung as a write ends, once an unwind waits

    @property
    def run_id(self) -> str:
        tel = self.tel  # read per call context and key: one lookup, not the telemetry property's
        assert tel is not None, "the run is not open"
        return tel.run_id

    @property
    def telemetry(self) -> RunTelemetry:
        assert self.tel is not None, "the run is not open"
        return self.tel

    def tool(self, name: str) -> Tool:
        return self.overlay[name] if name in self.overlay else self.saga.tools.get(name)

    def invoke(self, mode: Mode, fn: Callable[..., Any], name: str, **kwargs: Any) -> Outcome[Any]:
        """Call a user function; a sync run refuses an awaitable it cannot await."""
        out = mode.call(fn, **kwargs)
        return out if mode.is_async else out.map(lambda value: _no_await(value, name))

    def retrying(
        self, mode: Mode, policy: RetryPolicy, body: Callable[[int], Script[T]]
    ) -> Script[T]:
        """The one retry loop: the policy's backoff (RetryPolicy.delay), slept through the mode."""
        return retrying(mode, policy.attempts, lambda n: policy.delay(n, self.saga.rng), body)

    def kwargs_for(
        self, t: Tool, args: Mapping[str, Any], index: int, phase: str = "do"
    ) -> dict[str, Any]:
        """The call's arguments, with its idempotency key when the tool takes one."""
        kwargs = dict(args)
        if t.accepts_idempotency_key and IDEMPOTENCY_PARAM not in kwargs:
            kwargs[IDEMPOTENCY_PARAM] = idempotency_key(self.run_id, index, phase)
        return kwargs

    def call_context(self, step: str, index: int, phase: str, attempt: int) -> CallContext:
        run_id = self.run_id
        return CallContext(
            saga=self.saga.name,
            run_id=run_id,
            step=step,
            index=index,
            phase=phase,
            attempt=attempt,
            idempotency_key=idempotency_key(run_id, index, phase),
        )

    def do_attempt(self, t: Tool, idx: int, attempt: int) -> _CallScope:
        """One do attempt: the tool's call context and its telemetry, around the call."""
        return _CallScope(
            self.call_context(t.name, idx, "do", attempt),
            self.instr.attempt(
                self.telemetry, "do", t.name, index=idx, attempt=attempt, tool=t.name,
                step_class=t.step_class, pivot=t.pivot,
            ),
        )  # fmt: skip

    def undo_attempt(self, comp: Compensation, attempt: int) -> _CallScope:
        return _CallScope(
            self.call_context(comp.step, comp.index, "compensate", attempt),
            self.instr.attempt(
                self.telemetry, "compensate", comp.step or comp.tool, index=comp.index,
                attempt=attempt, tool=comp.tool, compensation=comp,
            ),
        )  # fmt: skip

    # -- opening -----------------------------------------------------------------
    def open(self) -> None:
        self.tel = self.instr.start_run(
            self.requested_run_id, trace_id=self.trace_id, parent_span_id=self.parent_span_id
        )
        if self.state is None:
            self.state = st.StackState(
                run_id=self.tel.run_id,
                allow_writes_after_pivot=self.saga.allow_writes_after_pivot,
            )
        _heartbeat.register_open_run(self.tel.run_id)

    def enter(self, mode: Mode) -> Outcome[None]:
        """Open the run and run the pre-flight validations; a rejection closes it."""
        return mode.script(lambda: self._enter(mode))

    def _enter(self, mode: Mode) -> Script[None]:
        self.open()
        for name, args in self.validations:
            t = self.tool(name)
            if t.validate is None:
                continue
            try:
                with self.instr.attempt(self.telemetry, "validate", name, index=-1):
                    yield self.invoke(mode, t.validate, name, **dict(args))
            except Exception as exc:
                self.reject(name, exc)
                self.close()
                raise ValidationRejectedError(
                    f"pre-flight validation of {name!r} rejected run {self.run_id}: "
                    f"{describe_error(exc)}; fix the input, nothing was changed"
                ) from exc
            except BaseException as exc:
                # A cancellation or an interrupt mid-validation: nothing was changed yet,
                # so the run closes rejected, and what stopped it propagates as it came.
                self.reject(name, exc)
                self.close()
                raise

    # -- forward -----------------------------------------------------------------
    def call(
        self, mode: Mode, name: str, args: Mapping[str, Any], index: int | None = None
    ) -> Outcome[Any]:
        """One forward call: attempts with retries, the push, the durable ack."""
        t = self.tool(name)
        if not mode.is_async:
            self._sync_ready(t)
        assert self.state is not None
        self.state, idx = st.begin_step(
            self.state, t.name, t.step_class, pivot=t.pivot, index=index
        )
        return mode.script(lambda: self._forward(mode, t, name, args, idx))

    def _sync_ready(self, t: Tool) -> None:
        """Refuse, before the do runs, a step a sync run could not finish: an async tool,
        or a registered async undo (its every retry would fail in the unwind, after the
        write it was meant to undo had happened)."""
        if t.is_async:
            raise ConfigurationError(
                f"tool {t.name!r} is async and cannot run in a sync run: use "
                "`async with saga.run()`, or register a sync function"
            )
        if t.compensate is None:
            return
        try:
            undo = self.tool(t.compensate)
        except Exception:  # not registered (yet): the unwind names it if it is needed
            return
        if undo.is_async:
            raise ConfigurationError(
                f"tool {t.name!r} is undone by {undo.name!r}, which is async and could not run "
                "in this sync run's unwind: use `async with saga.run()`, or register a sync "
                f"{undo.name!r}; nothing was run"
            )

    def _forward(
        self, mode: Mode, t: Tool, name: str, args: Mapping[str, Any], idx: int
    ) -> Script[Any]:
        tries = 1
        interrupted: str | None = None

        def attempt(n: int, snapshot: Any) -> Script[_Done]:
            nonlocal tries, interrupted
            tries = n
            with self.do_attempt(t, idx, n) as obs:
                kwargs = self.kwargs_for(t, args, idx)
                try:
                    result = yield self.invoke(mode, t.fn, name, **kwargs)
                except BaseException as exc:
                    if isinstance(exc, StopIteration):
                        self._stop = exc  # it leaves this frame as a RuntimeError: _as_raised
                    interrupted = interrupted_effect(t.name, idx, t.step_class, t.pivot, exc)
                    if interrupted is not None:
                        obs.extra[sc.SAGA_COMPENSATION_UNSTORABLE] = _short(interrupted)
                    raise
                return self.succeeded(t, idx, args, result, snapshot, n, obs)

        try:
            snapshot = None
            if t.snapshot is not None:
                read = yield self.invoke(mode, t.snapshot, name, **dict(args))
                snapshot = _frozen_snapshot(read, name)
            done = yield from self.retrying(
                mode, self.forward_policy, lambda n: attempt(n, snapshot)
            )
        except BaseException as exc:
            self.failed(t, idx, args, self._as_raised(exc), tries, interrupted)
            raise  # the step's error, unchanged
        if done.interrupt is not None:
            # Recorded done, with no undo: the run's exit unwinds the rest and escalates it.
            # No ack wait, as for a do interrupted before it returned: the interrupt asks to stop.
            raise done.interrupt
        if not done.pushed and done.unstorable is None:
            return done.result
        # Durable mode: the sidecar holds this undo (or knows it has none) before we go on.
        yield mode.ack(done.span)
        if done.unstorable is not None:
            raise ConfigurationError(done.unstorable)
        return done.result

    def succeeded(
        self,
        t: Tool,
        index: int,
        args: Mapping[str, Any],
        result: Any,
        snapshot: Any,
        attempts: int,
        obs: Attempt,
    ) -> _Done:
        """Record the do and capture its undo as plain data, inside the do's span."""
        assert self.state is not None and self.tel is not None
        comp: Compensation | None = None
        unstorable: str | None = None
        interrupt: BaseException | None = None
        try:
            comp = t.build_compensation(
                CallInfo(t.name, args, result, snapshot, self.run_id, index), step=t.name
            )
            if comp is not None:
                size = len(comp.args_json().encode())
                if size > self.saga.max_undo_bytes:
                    raise ConfigurationError(
                        f"its arguments are {size} bytes of JSON, over max_undo_bytes="
                        f"{self.saga.max_undo_bytes}"
                    )
        except Exception as exc:  # the do succeeded: never retry it for a bad undo
            comp = None
            why = (
                exception_text(exc) if isinstance(exc, ConfigurationError) else describe_error(exc)
            )
            unstorable = (
                f"the undo {t.compensate!r} of step {t.name!r} (index {index}) could not be "
                f"stored: {why}. The do ran once and is not retried; the run unwinds what it can "
                "and escalates. Return plain JSON references (ids) from the tool, or raise "
                "Saga(max_undo_bytes=...)"
            )
            obs.extra[sc.SAGA_COMPENSATION_UNSTORABLE] = _short(why)
        except BaseException as exc:
            # Ctrl-C or SystemExit after the do returned: its write stands with no undo.
            # Recorded as such (not as a failed do: it happened), then raised unchanged.
            comp, interrupt = None, exc
            unstorable = interrupted_effect(
                t.name, index, t.step_class, t.pivot, exc, moment="returned"
            )
            if unstorable is not None:
                obs.extra[sc.SAGA_COMPENSATION_UNSTORABLE] = _short(unstorable)
        if st.is_late(self.state):
            self._late(t, index, obs, comp)
            return _Done(result, False, None, obs.span, interrupt)
        record = _step_record(t, index, attempts, ok=True, compensation=comp, undo_error=unstorable)
        had_pivot = self.state.pivot_crossed
        self.state = st.step_succeeded(self.state, record)
        if self._settling is not None:
            self._settling.ring()  # the unwind waits for this write
        if not had_pivot and self.state.pivot_crossed:
            self.instr.pivot_crossed(self.tel, t.name)
        if comp is not None:
            obs.pushed(comp)
        return _Done(result, comp is not None, unstorable, obs.span, interrupt)

    def _late(self, t: Tool, index: int, obs: Attempt, comp: Compensation | None) -> None:
        """A do that returned after its run stopped waiting for it (given up on, or the run
        had ended): its undo would never run, so it is not pushed, and it is never silent:
        its span is marked, and it is logged at error and counted."""
        why = interrupted_effect(t.name, index, t.step_class, t.pivot, None, moment="late")
        if why is None:
            return  # it left nothing to undo
        obs.extra[sc.SAGA_COMPENSATION_UNSTORABLE] = _short(why)
        self.instr.late_effect(self.telemetry, t.name, index, why, comp)

    def failed(
        self,
        t: Tool,
        index: int,
        args: Mapping[str, Any],
        exc: BaseException,
        attempts: int,
        interrupted: str | None = None,
    ) -> None:
        """Record a failed do; ``interrupted`` says why its effect is unknown (it may
        stand with no undo: the run cannot end compensated)."""
        assert self.state is not None
        if st.is_late(self.state):
            return  # given up on (recorded then), or the run ended: its span says how it ended
        record = _step_record(
            t, index, attempts, ok=False, error=describe_error(exc), undo_error=interrupted
        )
        self.state = st.step_failed(
            self.state, record, PendingCall(index, t.name, t.name, dict(args))
        )
        if self._settling is not None:
            self._settling.ring()  # the unwind waits for this write

    # -- ending ------------------------------------------------------------------
    def reject(self, step: str, exc: BaseException) -> None:
        assert self.state is not None
        self.state = st.reject(self.state, step, describe_error(exc))
        self.error = exc

    def exit(self, mode: Mode, exc: BaseException | None) -> Outcome[None]:
        """End the run: close it, or unwind first (shielded from cancellation).

        Whatever a compensation raises, the remaining undos still run and the
        run closes (``compensation_failed``, escalated) before the first such
        exception propagates, with the agent's error as its ``__cause__``.
        """
        if self.report is not None:  # rejected in enter
            return mode.pure(None)
        if exc is None:
            return mode.run(self.close).map(lambda _: None)
        return mode.shield(mode.script(lambda: self._abort(mode, exc)))

    def _abort(self, mode: Mode, exc: BaseException) -> Script[None]:
        assert self.state is not None and self.tel is not None
        self.error = exc
        failed_step = self.state.failed_step or "(agent)"  # "(agent)": the agent's own code
        reason = describe_error(exc)
        escaped: list[BaseException] = []
        self.state, decision = st.abort(self.state, reason, failed_step=failed_step)
        if isinstance(decision, st.Settle):
            yield from self._settle(mode, decision, escaped)
            self.state, decision = st.abort(self.state, reason, failed_step=failed_step)
        assert not isinstance(decision, st.Settle)  # nothing is in flight any more
        if isinstance(decision, st.Escalate):
            later = [replace(p, index=-1) for p in self.remaining]
            self.state = replace(self.state, pending=(*self.state.pending, *later))
        else:
            span = self.instr.unwind(
                self.tel, self.state.failure or "", self.state.failed_step, decision.compensations
            )
            yield from _acked(mode, span, escaped)
            for comp in decision.compensations:
                fence = self.fence  # a recovery's lease around each undo (see UndoFence)
                if fence is not None:
                    fence.before()
                yield from self._undo(mode, comp, escaped)
                if fence is not None:
                    last = self.state.outcomes[-1] if self.state.outcomes else None
                    fence.after(comp, last is not None and last.compensation == comp and last.ok)
        self.close()
        if escaped:
            first = escaped[0]
            if first.__cause__ is None and first is not exc:
                first.__cause__ = exc  # the agent's error stays in the chain
            raise first

    def _settle(self, mode: Mode, settle: st.Settle, escaped: list[BaseException]) -> Script[None]:
        """Wait, at most ``Saga.settle_timeout``, for the run's writes still in flight, so
        the undo of each that lands is pushed before the unwind is decided. Past the bound,
        or on an interrupt (kept in ``escaped``), each still running is given up on: an
        effect that may stand with no undo (``records.interrupted_effect``)."""
        assert self.state is not None and self.tel is not None
        timeout = self.saga.settle_timeout
        self.instr.unwind_waiting(
            self.tel, self.state.failed_step, [w.name for w in settle.writes], timeout
        )
        # Set before the first read of the state: a write that ends after that read rings.
        signal = self._settling = mode.signal()
        stopped: BaseException | None = None
        try:
            yield mode.until(self._writes_settled, signal, timeout)
        except BaseException as exc:  # a cancellation or an interrupt: raised after the unwind
            stopped = exc
            escaped.append(exc)
        assert self.state is not None
        if self.state.in_flight_writes:
            self.state = st.give_up(
                self.state,
                {
                    w.index: interrupted_effect(
                        w.name, w.index, w.step_class, w.pivot, stopped, moment="running"
                    )
                    for w in self.state.in_flight_writes
                },
            )

    def _writes_settled(self) -> bool:
        return self.state is not None and not self.state.in_flight_writes

    def _undo(self, mode: Mode, comp: Compensation, escaped: list[BaseException]) -> Script[None]:
        """One undo, retried by its tool's policy; a failure is recorded (and a
        BaseException kept in ``escaped``), never raised here."""
        tries = 1

        def attempt(t: Tool, n: int) -> Script[Any]:
            nonlocal tries
            tries = n
            with self.undo_attempt(comp, n) as obs:
                yield self.invoke(
                    mode,
                    t.fn,
                    comp.tool,
                    # Afresh per attempt: an undo that mutates its arguments must not
                    # change its retry, nor the record left for recovery.
                    **self.kwargs_for(t, comp.fresh_args(), comp.index, "compensate"),
                )
                return obs.span

        try:
            t = self.tool(comp.tool)
            span = yield from self.retrying(
                mode, t.retry or self.saga.retry, lambda n: attempt(t, n)
            )
        except BaseException as exc:
            self.compensation_ended(comp, False, tries, exc)
            if not isinstance(exc, Exception):
                escaped.append(exc)  # raised once every undo has run and the run is closed
            return
        self.compensation_ended(comp, True, tries, None)
        # Once the sidecar knows this undo is done, a recovery elsewhere will not repeat it.
        # An interrupt during this wait leaves the undo succeeded: it ran, and its span is
        # queued before the run's. So the run may still end compensated; ending it
        # compensation_failed would page a person to undo what is already undone.
        yield from _acked(mode, span, escaped)

    def compensation_ended(
        self, comp: Compensation, ok: bool, attempts: int, exc: BaseException | None
    ) -> None:
        assert self.state is not None and self.tel is not None
        self.state = st.compensation_ended(
            self.state,
            CompensationOutcome(comp, ok, attempts, None if exc is None else describe_error(exc)),
        )
        self.instr.compensation_finished(comp.step or comp.tool, ok)

    def close(self) -> SagaReport:
        assert self.state is not None and self.tel is not None
        self.state = st.finish(self.state)
        s = self.state
        assert s.status is not None
        report = SagaReport(
            saga=self.saga.name,
            run_id=self.run_id,
            status=s.status,
            steps=s.steps,
            failed_step=s.failed_step if s.status is not RunStatus.COMPLETED else None,
            error=self.error,
            compensations=s.outcomes,
            pending=s.pending if s.status is RunStatus.STUCK else (),
            trace_id=self.tel.trace_id,
            span_id=self.tel.span_id,
        )
        try:
            self._escalate(report)
        except Exception as exc:  # reporting must not replace the agent's error
            self.instr.swallowed("escalation", exc)
        finally:
            # Whatever reporting raised, the run ends first (an interrupt propagates after):
            # an open run would be paged orphaned forever.
            try:
                self.instr.end_run(self.tel, s.status.value, report.failed_step)
            finally:
                _heartbeat.unregister_open_run(self.run_id)
                self.report = report
        return report

    def _escalate(self, report: SagaReport) -> None:
        card = report.escalation_card()
        if card is None:
            return
        self.instr.escalate(self.telemetry, card.reason, card.to_dict())
        for handler in self.saga.escalation_handlers:
            try:
                handler(card, report)
            except Exception as exc:  # a broken pager must not hide the escalation
                self.instr.swallowed("escalation_handler", exc)

    def whole(self, mode: Mode, body: Callable[[], Script[Any]]) -> Outcome[SagaReport]:
        """A run from open to close around ``body`` (fixed plans, forward recovery).

        The report carries an Exception instead of raising it; an interrupt
        still propagates, after the unwind.
        """
        return mode.script(lambda: self._whole(mode, body))

    def _whole(self, mode: Mode, body: Callable[[], Script[Any]]) -> Script[SagaReport]:
        failure: BaseException | None = None
        try:
            yield self.enter(mode)
            yield from body()
            yield self.exit(mode, None)
        except BaseException as exc:
            failure = self._as_raised(exc)
        if failure is not None:  # unwound outside the except block: nothing chains onto it
            yield self.exit(mode, failure)
            if not isinstance(failure, Exception):
                raise failure
        assert self.report is not None
        return self.report

    def _as_raised(self, exc: BaseException) -> BaseException:
        """What a step raised, for its record and the report: a tool's StopIteration leaves
        the policy's generator frames (and the async driver's coroutine) as Python's
        RuntimeError (PEP 479), with the object as its cause."""
        stop = self._stop
        if stop is not None and type(exc) is RuntimeError and exc.__cause__ is stop:
            return stop
        return exc


class _CallScope:
    """The ``with`` around one tool call: its :class:`CallContext` set (see
    :func:`current_call`), then its attempt's telemetry opened; both undone at exit."""

    __slots__ = ("_call", "_scope", "_token")

    def __init__(self, call: CallContext, scope: Attempt) -> None:
        self._call, self._scope = call, scope

    def __enter__(self) -> Attempt:
        self._token = _current_call.set(self._call)
        try:
            return self._scope.__enter__()
        except BaseException:
            _current_call.reset(self._token)
            raise

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        try:
            self._scope.__exit__(et, exc, tb)
        finally:
            _current_call.reset(self._token)
        return False


def _frozen_snapshot(value: Any, name: str) -> Any:
    """The snapshot as it was when read. A read may return the live object the write then
    mutates (an in-memory store, an ORM row): kept by reference, the undo would restore the
    new value. A deep copy, not a JSON round trip: the undo recipe may read the snapshot's
    attributes (a model, a dataclass), and the undo's arguments are JSON-checked anyway
    when the compensation is built. Refused before the write when it cannot be copied."""
    try:
        return copy.deepcopy(value)
    except Exception as exc:
        raise ConfigurationError(
            f"the snapshot read for tool {name!r} returned a value that cannot be copied "
            f"({describe_error(exc)}), so what the undo restores could change under it; "
            "return plain data (dicts, lists, a model) from the snapshot reader; nothing was "
            "written"
        ) from exc


def _short(text: str, limit: int = 256) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


class _RunBase:
    def __init__(self, core: _Core) -> None:
        self._core = core

    @property
    def run_id(self) -> str:
        return self._core.run_id

    @property
    def report(self) -> SagaReport | None:
        """How the run ended; set once the ``with`` block exits."""
        return self._core.report

    @property
    def stack(self) -> tuple[Compensation, ...]:
        """The pending compensations, top first."""
        s = self._core.state
        return tuple(reversed(s.stack)) if s is not None else ()


class Run(_RunBase):
    """An async run. Use as ``async with saga.run() as run``: the async driver.

    On an exception the unwind runs before it propagates, shielded from
    cancellation. A compensation that raises (any ``BaseException``, including
    ``KeyboardInterrupt`` and ``SystemExit``) fails only that undo: the others
    still run, the run ends ``compensation_failed`` (escalated), and then that
    exception propagates with the agent's error as its ``__cause__``. An interrupt
    while the unwind waits for the sidecar's ack is held the same way (the undo it
    waited on stays succeeded). A cancellation arriving during the unwind is
    re-raised once the unwind is done.
    """

    def __init__(self, core: _Core) -> None:
        super().__init__(core)
        self._mode = AsyncMode(core.saga.async_sleep)

    async def __aenter__(self) -> Run:
        await _pending(self._core.enter(self._mode))()
        return self

    async def call(self, tool: str, /, **args: Any) -> Any:
        """Run one tool; on success its compensation is pushed before this returns."""
        return await _pending(self._core.call(self._mode, tool, args))()

    async def __aexit__(
        self, _et: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> Literal[False]:
        await _pending(self._core.exit(self._mode, exc))()
        return False  # the agent's own exception propagates unchanged


class SyncRun(_RunBase):
    """A sync run. Use as ``with saga.run_sync() as run``: the sync driver (see :class:`Run`).

    Thread-safe: threads may call ``run.call`` at once (a framework's parallel tool calls
    on a thread pool). Their tools run in parallel; everything else a call does (its step
    index, the push of its undo, its records, spans and metrics) runs whole, one call at
    a time, as between two awaits of an async run: the run's code holds the run's turn
    and lets go of it only while it blocks (the tool, a retry's sleep, the ack wait).
    Code of yours the run calls back while it holds the turn (an undo recipe, a span
    processor, an escalation handler) must not wait for another thread's call of it.

    A call that fails in one thread does not end the run; the ``with`` block's exit
    does. With other threads' calls still in flight it takes no new step (their next
    call is refused with :class:`StepRefusedError`), waits for them at most
    ``Saga(settle_timeout=...)`` and unwinds every undo pushed, each once, in reverse
    push order (see :class:`Saga`).
    """

    def __init__(self, core: _Core) -> None:
        super().__init__(core)
        self._mode = SyncMode(core.saga.sleep)

    def __enter__(self) -> SyncRun:
        self._mode.drive(lambda: self._core.enter(self._mode))
        return self

    def call(self, tool: str, /, **args: Any) -> Any:
        """Run one tool; on success its compensation is pushed before this returns."""
        return self._mode.drive(lambda: self._core.call(self._mode, tool, args))

    def __exit__(
        self, _et: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> Literal[False]:
        # KeyboardInterrupt too: the unwind runs before it propagates.
        self._mode.drive(lambda: self._core.exit(self._mode, exc))
        return False


def _step_record(
    t: Tool,
    index: int,
    attempts: int,
    *,
    ok: bool,
    compensation: Compensation | None = None,
    error: str | None = None,
    undo_error: str | None = None,
) -> StepRecord:
    return StepRecord(
        index=index,
        name=t.name,
        tool=t.name,
        step_class=t.step_class,
        attempts=attempts,
        ok=ok,
        pivot=t.pivot,
        compensation=compensation,
        error=error,
        undo_error=undo_error,
    )


def _acked(mode: Mode, span: Any, escaped: list[BaseException]) -> Script[None]:
    """An unwind's wait for the sidecar's ack: an interrupt during it (Ctrl-C, SystemExit)
    is kept in ``escaped`` like one an undo raised, so the remaining undos still run and
    the run closes before it propagates."""
    try:
        yield mode.ack(span)
    except BaseException as exc:  # the wait itself never raises an Exception
        escaped.append(exc)


def _no_await(value: Any, name: str) -> Any:
    if inspect.isawaitable(value):
        close = getattr(value, "close", None)
        if close is not None:
            close()  # avoid "coroutine was never awaited" noise
        raise ConfigurationError(
            f"{name!r} returned an awaitable inside a sync run: use `async with saga.run()` "
            "(or Saga.execute) for async tools"
        )
    return value
