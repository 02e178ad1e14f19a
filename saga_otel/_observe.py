"""observed(): the engine's telemetry for saga steps that users already have.

Wrap a step object (``do`` and ``compensate``) or a single function, sync or
async, and each call emits the same spans, log events and metrics as a step
run by :class:`saga_otel.Saga`. Wrap the runner's body in
:func:`observed_run` so the steps share one run span, run id and index
counter; without it each call joins the current trace (its trace id becomes
the run id) as the contract's default.
"""

from __future__ import annotations

import contextvars
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import wrapt
from opentelemetry import trace
from opentelemetry.trace import TracerProvider
from prometheus_client import CollectorRegistry

from saga_otel import _heartbeat
from saga_otel import semconv as sc
from saga_otel._errors import ConfigurationError
from saga_otel._outcome import (
    AsyncMode,
    Mode,
    Outcome,
    Script,
    SyncMode,
    _immediate,
    _pending,
    is_async_callable,
)
from saga_otel._registry import CallInfo
from saga_otel._telemetry import Attempt, Instrumentation, RunTelemetry
from saga_otel.records import (
    Compensation,
    StepClass,
    args_json,
    describe_error,
    exception_text,
    interrupted_effect,
    is_pivot,
)

#: Bound on one undo's arguments as JSON (as Saga's max_undo_bytes default).
MAX_UNDO_BYTES = 64 * 1024

CompensationRecipe = Callable[[CallInfo], Compensation | Mapping[str, Any] | None]


@dataclass(slots=True)
class ObservedRun:
    """The shared state of one run driven by the user's own runner."""

    instr: Instrumentation
    tel: RunTelemetry
    next_index: int = 0
    indexes: dict[str, int] = field(default_factory=dict)  # the last index each step took
    # Per step name, the indexes whose undo is still owed (pushed, or marked unstorable),
    # as an ordered set: a step called more than once has one per call, and a compensate
    # picks among them (_Observer._undo_index).
    owed: dict[str, dict[int, None]] = field(default_factory=dict)
    stack: dict[int, Compensation] = field(default_factory=dict)
    # Steps whose undo could not be stored, until their own compensate succeeds.
    unstorable: dict[int, str] = field(default_factory=dict)
    pivot: str | None = None
    failed_step: str | None = None
    failure: str = ""  # "Type: message" of the failed step's exception (the unwind's reason)
    unwound: bool = False
    compensations_failed: int = 0
    status: str | None = None  # set by the user to override the derived status

    @property
    def run_id(self) -> str:
        return self.tel.run_id


_current: contextvars.ContextVar[ObservedRun | None] = contextvars.ContextVar(
    "saga_otel_observed_run", default=None
)


@contextmanager
def observed_run(
    saga: str,
    run_id: str | None = None,
    *,
    tracer_provider: TracerProvider | None = None,
    registry: CollectorRegistry | None = None,
    logger: Any = None,
) -> Iterator[ObservedRun]:
    """One run span around a user's own saga runner (use a plain ``with``, also in async code).

    The run's status is derived: completed without an exception; else stuck
    past a pivot, compensation_failed if an observed compensate failed, a
    step's undo could not be stored and was not run, or an undo pushed was
    never run OK (a runner that catches only ``Exception`` and was cancelled,
    one that stopped part way), and compensated otherwise. Set ``run.status``
    to say otherwise.
    """
    Instrumentation.check_run_id(run_id)
    instr = Instrumentation(saga, tracer_provider=tracer_provider, registry=registry, logger=logger)
    run = ObservedRun(instr, instr.start_run(run_id))
    token = _current.set(run)
    _heartbeat.register_open_run(run.run_id)
    try:
        yield run
    except BaseException:
        status = run.status or (
            sc.STATUS_STUCK
            if run.pivot
            else sc.STATUS_COMPENSATION_FAILED
            # Owed undos the runner never ran OK: "compensated" would say all is undone.
            if run.compensations_failed or run.unstorable or run.stack
            else sc.STATUS_COMPENSATED
        )
        _end(run, status)
        raise
    else:
        _end(run, run.status or sc.STATUS_COMPLETED)
    finally:
        _current.reset(token)
        _heartbeat.unregister_open_run(run.run_id)


def _end(run: ObservedRun, status: str) -> None:
    if status in (sc.STATUS_STUCK, sc.STATUS_COMPENSATION_FAILED):
        card = {
            "saga": run.instr.saga,
            "run_id": run.run_id,
            "reason": status,
            "failed_step": run.failed_step,
            "not_undone": [c.to_dict() for c in run.stack.values()]
            + [{"step_index": i, "undo_error": why} for i, why in run.unstorable.items()],
        }
        run.instr.escalate(run.tel, status, card)
    run.instr.end_run(run.tel, status, run.failed_step)


def _adhoc_run(instr: Instrumentation) -> ObservedRun:
    """No observed_run around the call: join the current trace, its id being the run id."""
    ctx = trace.get_current_span().get_span_context()
    rid = format(ctx.trace_id, "032x") if ctx.is_valid else os.urandom(16).hex()
    tel = RunTelemetry(
        run_id=rid,
        span=trace.get_current_span(),
        context=trace.set_span_in_context(trace.get_current_span()),
        started=0.0,
        identity={
            sc.SAGA_RUN_ID: rid,
            sc.SAGA_NAME: instr.saga,
            sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
        },
        span_context=ctx,
    )
    return ObservedRun(instr, tel)


class _Observer:
    """Instruments one step's do and compensate calls: one policy, run sync or async."""

    def __init__(
        self,
        instr: Instrumentation,
        step: str,
        step_class: StepClass,
        pivot: bool,
        index: int | None,
        compensation: CompensationRecipe | None,
    ) -> None:
        self.instr, self.step, self.step_class = instr, step, step_class
        self.pivot, self.fixed_index = pivot, index
        self.recipe = compensation
        self._adhoc: ObservedRun | None = None
        self.sync_mode, self.async_mode = SyncMode(), AsyncMode()

    def run(self) -> ObservedRun:
        current = _current.get()
        if current is not None:
            return current
        if self._adhoc is None or self._adhoc.run_id != _adhoc_run(self.instr).run_id:
            self._adhoc = _adhoc_run(self.instr)
        return self._adhoc

    def _index(self, run: ObservedRun) -> int:
        idx = self.fixed_index if self.fixed_index is not None else run.next_index
        run.next_index = max(run.next_index, idx + 1)
        run.indexes[self.step] = idx
        return idx

    def _owe(self, run: ObservedRun, idx: int) -> None:
        """``idx`` now waits for its undo (one dict operation: this is the do's path)."""
        owed = run.owed.get(self.step)
        if owed is None:
            run.owed[self.step] = {idx: None}
        else:
            owed[idx] = None

    def _undo_index(self, run: ObservedRun, args: Any, kwargs: Any) -> int:
        """The index a compensate undoes. An explicit ``index=`` wins. Else, among the
        step's calls still owed an undo, the one whose stored undo arguments equal this
        call's (compared as the record stores them, its JSON), else the latest (the
        unwind's reverse order; a failed undo stays owed, so its retry lands there too).
        With none owed, the step's last index (-1 if it never ran here)."""
        if self.fixed_index is not None:
            return self.fixed_index
        owed = run.owed.get(self.step)
        if not owed:
            return run.indexes.get(self.step, -1)
        if len(owed) > 1:
            text = _call_args_json(args, kwargs)
            if text is not None:
                same = [i for i in owed if (c := run.stack.get(i)) and c.args_json() == text]
                if same:
                    return max(same)
        return max(owed)

    def _compensation(
        self, run: ObservedRun, idx: int, args: Any, result: Any
    ) -> tuple[Compensation | None, str | None, BaseException | None]:
        """The undo to push, or None and why it could not be stored as plain data, and the
        interrupt that stopped its capture (the caller raises it once it is recorded)."""
        if not self.step_class.pushes:
            return None, None, None
        info = CallInfo(
            self.step, {"args": list(args)} if args else {}, result, None, run.run_id, idx
        )
        made: Any = None
        if self.recipe is not None:
            try:
                made = self.recipe(info)
            except Exception as exc:  # the user's recipe must not break their step
                self.instr.swallowed("compensation_recipe", exc)
                return None, f"the compensation recipe raised {describe_error(exc)}", None
            except BaseException as exc:  # Ctrl-C after the do returned: its write stands
                why = interrupted_effect(
                    self.step, idx, self.step_class, self.pivot, exc, moment="returned"
                )
                return None, why, exc
        try:
            if isinstance(made, Compensation):
                comp = Compensation(made.tool, made.args, made.description, self.step, idx)
            else:
                args_map = dict(made) if isinstance(made, Mapping) else {}
                comp = Compensation(
                    f"{self.step}.compensate", args_map, f"undo {self.step}", self.step, idx
                )
        except ConfigurationError as exc:
            self.instr.swallowed("compensation_recipe", exc)
            return None, exception_text(exc), None
        size = len(comp.args_json().encode())
        if size > MAX_UNDO_BYTES:
            return None, f"its arguments are {size} bytes of JSON, over {MAX_UNDO_BYTES}", None
        return comp, None, None

    def _after_do(
        self, run: ObservedRun, obs: Attempt, idx: int, args: Any, result: Any
    ) -> tuple[bool, BaseException | None]:
        """Push the do's undo (or mark why none was stored): whether to wait for the ack,
        and the interrupt that stopped the undo's capture, if one did."""
        comp, unstorable, interrupt = self._compensation(run, idx, args, result)
        if comp is not None:
            obs.pushed(comp)
            run.stack[idx] = comp
            self._owe(run, idx)
        if unstorable is not None:
            obs.extra[sc.SAGA_COMPENSATION_UNSTORABLE] = unstorable[:256]
            run.unstorable[idx] = unstorable
            self._owe(run, idx)
        if run.pivot is None and is_pivot(self.step_class, self.pivot):
            run.pivot = self.step
            self.instr.pivot_crossed(run.tel, self.step)
        return comp is not None or unstorable is not None, interrupt

    def _begin_unwind(self, mode: Mode, run: ObservedRun) -> Script[None]:
        if run.unwound:
            return
        # The first compensate of a run is the moment the unwind begins.
        run.unwound = True
        pending = sorted(run.stack.values(), key=lambda c: -c.index)
        yield mode.ack(self.instr.unwind(run.tel, run.failure, run.failed_step, pending))

    def _compensate_ended(self, run: ObservedRun, idx: int, ok: bool, claimed: bool) -> None:
        if ok:
            run.stack.pop(idx, None)
            run.unstorable.pop(idx, None)
        else:
            run.compensations_failed += 1
            if claimed:  # still owed: the next compensate of this step may retry it
                self._owe(run, idx)
        self.instr.compensation_finished(self.step, ok)

    # -- the policy, written once ------------------------------------------------
    def do(self, mode: Mode, fn: Callable[..., Any], args: Any, kwargs: Any) -> Outcome[Any]:
        return mode.script(lambda: self._do(mode, fn, args, kwargs))

    def _do(self, mode: Mode, fn: Callable[..., Any], args: Any, kwargs: Any) -> Script[Any]:
        run = self.run()
        idx = self._index(run)
        try:
            with self.instr.attempt(
                run.tel,
                sc.PHASE_DO,
                self.step,
                index=idx,
                tool=self.step,
                step_class=self.step_class,
                pivot=self.pivot,
            ) as obs:
                try:
                    result = yield mode.call(fn, *args, **kwargs)
                except BaseException as exc:
                    why = interrupted_effect(self.step, idx, self.step_class, self.pivot, exc)
                    if why is not None:  # its effect may stand with no undo
                        obs.extra[sc.SAGA_COMPENSATION_UNSTORABLE] = why[:256]
                        run.unstorable[idx] = why
                        self._owe(run, idx)
                    raise
                pushed, interrupt = self._after_do(run, obs, idx, args, result)
            if interrupt is not None:
                raise interrupt  # after the do's span ended OK, marked: its write happened
        except BaseException as exc:
            run.failed_step, run.failure = self.step, describe_error(exc)
            raise  # the step's exception, unchanged
        if pushed:
            yield mode.ack(obs.span)
        return result

    def compensate(
        self, mode: Mode, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> Outcome[Any]:
        return mode.script(lambda: self._compensate(mode, fn, args, kwargs))

    def _compensate(
        self, mode: Mode, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> Script[Any]:
        run = self.run()
        yield from self._begin_unwind(mode, run)
        idx = self._undo_index(run, args, kwargs)
        # Claimed while it runs (no wait between here and the call), so a concurrent
        # compensate of the same step (gathered undos) takes another owed index; given
        # back if it fails.
        owed, claimed = run.owed.get(self.step), False
        if owed is not None and idx in owed:
            del owed[idx]
            claimed = True
        comp = run.stack.get(idx) or Compensation(
            f"{self.step}.compensate", {}, f"undo {self.step}", self.step, idx
        )
        try:
            with self.instr.attempt(
                run.tel,
                sc.PHASE_COMPENSATE,
                self.step,
                index=idx,
                tool=comp.tool,
                compensation=comp,
            ) as obs:
                out = yield mode.call(fn, *args, **kwargs)
        except BaseException:
            self._compensate_ended(run, idx, False, claimed)
            raise  # the undo's exception, unchanged
        self._compensate_ended(run, idx, True, claimed)
        # As the engine's undo: once the sidecar knows it is done, a recovery elsewhere
        # will not repeat it.
        yield mode.ack(obs.span)
        return out


def _call_args_json(args: Any, kwargs: Any) -> str | None:
    """A compensate call's arguments in the form of a stored undo's (its JSON), or None:
    its keyword arguments, or its one positional argument when that is a mapping (the
    do's result, or the undo's arguments, handed back); no arguments read as ``{}``."""
    if not args:
        return args_json(kwargs or {})
    if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
        return args_json(args[0])
    return None


def _wrap(fn: Callable[..., Any], observer: _Observer, phase: str) -> Any:
    policy = observer.do if phase == sc.PHASE_DO else observer.compensate
    if is_async_callable(fn):

        @wrapt.decorator
        async def async_wrapper(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
            return await _pending(policy(observer.async_mode, wrapped, args, kwargs))()

        return async_wrapper(fn)

    @wrapt.decorator
    def sync_wrapper(wrapped: Any, _instance: Any, args: Any, kwargs: Any) -> Any:
        out = _immediate(policy(observer.sync_mode, wrapped, args, kwargs))()
        if inspect.isawaitable(out):
            # The span closed before the awaitable ran: its outcome goes unobserved. The
            # agent still gets its value unchanged; the miss is logged and counted.
            observer.instr.swallowed(
                "observed_awaitable",
                ConfigurationError(
                    f"observed step {observer.step!r} ({phase}) was called as a sync function "
                    f"but returned {type(out).__name__}, so its span says ok whatever the "
                    "awaitable does: make it `async def` (or its __call__), so observed() "
                    "awaits it inside the span"
                ),
            )
        return out

    return sync_wrapper(fn)


class _ObservedStep(wrapt.ObjectProxy):  # type: ignore[type-arg]
    """The user's step object, with ``do`` and ``compensate`` instrumented."""

    def __init__(self, target: Any, observer: _Observer) -> None:
        super().__init__(target)
        self._self_do = _wrap(target.do, observer, sc.PHASE_DO)
        self._self_compensate = _wrap(target.compensate, observer, sc.PHASE_COMPENSATE)

    @property
    def do(self) -> Any:
        return self._self_do

    @property
    def compensate(self) -> Any:
        return self._self_compensate


def observed(
    target: Any,
    *,
    saga: str,
    step: str | None = None,
    step_class: StepClass | str | None = None,
    pivot: bool = False,
    index: int | None = None,
    compensation: CompensationRecipe | None = None,
    phase: str = sc.PHASE_DO,
    tracer_provider: TracerProvider | None = None,
    registry: CollectorRegistry | None = None,
    logger: Any = None,
) -> Any:
    """Instrument an existing saga step (object with do/compensate) or one function.

    A step object comes back with the same shape; a function keeps its name,
    signature and docstring (``phase="compensate"`` marks an undo function).
    ``compensation(info)`` may return the record (or its args) to push, so the
    sidecar can show what would be undone. Exceptions pass through unchanged.

    A step called more than once in a run has an index per call; a compensate
    undoes the call still owed an undo whose stored arguments equal its own
    (its keyword arguments, or its one mapping argument, as JSON), else the
    latest; ``index`` fixes it (docs/frameworks.md, "Your own saga runner").
    """
    has_do = callable(getattr(target, "do", None))
    has_comp = callable(getattr(target, "compensate", None))
    if not (has_do and has_comp) and not callable(target):
        raise ConfigurationError(
            f"observed() needs an object with do() and compensate(), or a function; got "
            f"{type(target).__name__}: wrap the step object or its function"
        )
    name = step or getattr(target, "name", None) or getattr(target, "__name__", None)
    if not isinstance(name, str) or not name:
        name = type(target).__name__
    if step_class is None:
        cls = StepClass.COMPENSABLE if has_do and has_comp else StepClass.CONVERGENT
        if pivot and cls is StepClass.CONVERGENT:
            cls = StepClass.IRREVERSIBLE  # a declared pivot with no undo cannot be undone
    else:
        cls = StepClass.parse(step_class)
    if phase not in (sc.PHASE_DO, sc.PHASE_COMPENSATE):
        raise ConfigurationError(f"phase={phase!r}: use 'do' or 'compensate'")
    instr = Instrumentation(saga, tracer_provider=tracer_provider, registry=registry, logger=logger)
    observer = _Observer(instr, name, cls, pivot, index, compensation)
    if has_do and has_comp:
        return _ObservedStep(target, observer)
    return _wrap(target, observer, phase)
