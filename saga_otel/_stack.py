"""The compensation stack as a pure state machine.

Events go in (a step began, succeeded, failed; the run aborted; the driver gave
up waiting for its writes; a compensation ended) and a new immutable state comes
out, with the decision the driver must carry out. No clocks, no I/O, no
callables: the engine in ``_engine.py`` is the driver, and tests can walk this
machine directly.

An abort with writes still in flight is not decided at once: the run stops
(no new step) and the driver waits for them (:class:`Settle`), so the undos of
those that land are pushed before the unwind is decided. A write that ends
after the decision is late (:func:`is_late`): it is never pushed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from saga_otel._errors import StepRefusedError
from saga_otel._frozen import fast_init, replacer
from saga_otel.records import (
    Compensation,
    CompensationOutcome,
    PendingCall,
    RunStatus,
    StepClass,
    StepRecord,
    is_pivot,
)


class Phase(Enum):
    FORWARD = "forward"
    STOPPING = "stopping"  # aborted: no new step; its writes in flight are awaited
    UNWINDING = "unwinding"
    ENDED = "ended"


@fast_init
@dataclass(frozen=True, slots=True)
class Unwind:
    """Decision: run these compensations, top of stack first."""

    compensations: tuple[Compensation, ...]


@dataclass(frozen=True, slots=True)
class Escalate:
    """Decision: do not unwind; a person must take over (failure past the pivot)."""


@dataclass(frozen=True, slots=True)
class Settle:
    """Decision: wait until these writes end (or give up on them), then abort again."""

    writes: tuple[StepRecord, ...]


Decision = Unwind | Escalate | Settle


@fast_init
@dataclass(frozen=True, slots=True)
class StackState:
    run_id: str
    allow_writes_after_pivot: bool = False
    phase: Phase = Phase.FORWARD
    next_index: int = 0
    # Bottom of the stack first; the top is the last item.
    stack: tuple[Compensation, ...] = ()
    # Each write begun and not yet ended, as it began (no attempt ended, not ok).
    in_flight_writes: tuple[StepRecord, ...] = ()
    pivot: StepRecord | None = None
    steps: tuple[StepRecord, ...] = ()
    failed_step: str | None = None
    failure: str | None = None
    pending: tuple[PendingCall, ...] = ()
    outcomes: tuple[CompensationOutcome, ...] = ()
    status: RunStatus | None = None

    @property
    def pivot_crossed(self) -> bool:
        return self.pivot is not None


# ``dataclasses.replace`` for the stack's state at a fraction of its cost (it runs several
# times per step): see saga_otel/_frozen.py.
evolve = replacer(StackState)


def begin_step(
    state: StackState,
    name: str,
    step_class: StepClass,
    *,
    pivot: bool = False,
    index: int | None = None,
) -> tuple[StackState, int]:
    """Admit a forward step, or refuse it before any side effect."""
    if state.phase is not Phase.FORWARD:
        raise StepRefusedError(
            f"step {name!r} refused: run {state.run_id} is {state.phase.value}, not running "
            "forward; start a new run for new work"
        )
    if is_pivot(step_class, pivot) and state.in_flight_writes:
        raise StepRefusedError(
            f"irreversible step {name!r} refused: {len(state.in_flight_writes)} other write(s) "
            f"of run {state.run_id} are still in flight, and a failure among them could no "
            "longer be undone once this step runs; await them first, then call it"
        )
    if step_class.pushes and state.pivot_crossed and not state.allow_writes_after_pivot:
        assert state.pivot is not None
        raise StepRefusedError(
            f"{step_class.value} step {name!r} refused: run {state.run_id} crossed its pivot at "
            f"{state.pivot.name!r}, so this write could never be undone; move it before the "
            "pivot, or create the Saga with allow_writes_after_pivot=True"
        )
    # Forward recovery re-runs a step under its original index, so its
    # idempotency key (run id + index) is the same and the retry converges.
    index = state.next_index if index is None else index
    writes = state.in_flight_writes
    if step_class.writes:
        writes = (*writes, StepRecord(index, name, name, step_class, 0, False, pivot))
    return (
        evolve(
            state,
            next_index=max(state.next_index, index + 1),
            in_flight_writes=writes,
        ),
        index,
    )


def is_late(state: StackState) -> bool:
    """Whether a do ending now is late: its run already decided how it ends (unwinding
    or ended), so an undo pushed now would never run."""
    return state.phase is Phase.UNWINDING or state.phase is Phase.ENDED


def _settled(record: StepRecord, state: StackState) -> dict[str, Any]:
    """The changes every ended do makes: no longer in flight, and recorded."""
    if is_late(state):
        raise StepRefusedError(
            f"step {record.name!r} (index {record.index}) ended after run {state.run_id} "
            f"stopped waiting for it (the run is {state.phase.value}): the driver reports "
            "such a do as a late effect, never records it here"
        )
    writes = state.in_flight_writes
    if len(writes) == 1 and writes[0].index == record.index:
        writes = ()  # the common case: the only write in flight
    elif writes:
        writes = tuple(w for w in writes if w.index != record.index)
    return {"in_flight_writes": writes, "steps": (*state.steps, record)}


def step_succeeded(state: StackState, record: StepRecord) -> StackState:
    """Record a successful do; push its compensation; mark the pivot.

    A do whose undo could not be stored (``record.undo_error``) is an effect
    with nothing on the stack: it becomes the run's failure, so an unwind ends
    ``compensation_failed``. A late do (:func:`is_late`) is refused.
    """
    changes = _settled(record, state)
    if record.compensation is not None:
        changes["stack"] = (*state.stack, record.compensation)
    if record.undo_error is not None:
        changes["failed_step"] = record.name
        changes["failure"] = record.undo_error
    if state.pivot is None and is_pivot(record.step_class, record.pivot):
        changes["pivot"] = record
    return evolve(state, **changes)


def step_failed(
    state: StackState, record: StepRecord, pending: PendingCall | None = None
) -> StackState:
    """Record a failed do. Whether it ends the run is the caller's choice (see abort)."""
    owed = state.pending if state.phase is Phase.STOPPING else ()
    return evolve(
        state,
        **_settled(record, state),
        failed_step=record.name,
        failure=record.error,
        # Only the latest failure is owed: one the agent caught and worked around is not.
        # While the run stops, the failure that stopped it is owed too.
        pending=(*owed, pending) if pending else owed,
    )


def abort(
    state: StackState, error: str, *, failed_step: str | None = None
) -> tuple[StackState, Decision]:
    """The run failed: unwind before the pivot, escalate after it.

    With writes still in flight the run stops first (no new step): :class:`Settle`
    asks the driver to wait for them, or :func:`give_up` on them, and abort again
    with the same error, so an undo that lands meanwhile is unwound too and a pivot
    that lands escalates.
    """
    failed = failed_step or state.failed_step
    if state.in_flight_writes:
        stopping = evolve(state, phase=Phase.STOPPING, failed_step=failed, failure=error)
        return stopping, Settle(state.in_flight_writes)
    if state.pivot_crossed:
        return (
            evolve(
                state,
                phase=Phase.ENDED,
                status=RunStatus.STUCK,
                failed_step=failed,
                failure=error,
            ),
            Escalate(),
        )
    top_first = tuple(reversed(state.stack))
    return (
        evolve(state, phase=Phase.UNWINDING, failed_step=failed, failure=error),
        Unwind(top_first),
    )


def give_up(state: StackState, reasons: Mapping[int, str | None]) -> StackState:
    """Stop waiting for the writes still in flight: each is recorded as it began, not
    ok, with ``reasons[index]`` as its undo error (why it may stand with no undo; None
    when it could leave nothing to undo). Its end, whenever it comes, is late."""
    given_up = tuple(
        replace(
            w,
            error="still running when its run stopped waiting for it",
            undo_error=reasons.get(w.index),
        )
        for w in state.in_flight_writes
    )
    return evolve(state, in_flight_writes=(), steps=(*state.steps, *given_up))


def compensation_ended(state: StackState, outcome: CompensationOutcome) -> StackState:
    """Record one compensation's final outcome; a success pops it off the stack."""
    stack = state.stack
    if outcome.ok:
        stack = tuple(c for c in stack if c.index != outcome.compensation.index)
    return evolve(state, stack=stack, outcomes=(*state.outcomes, outcome))


def reject(state: StackState, step: str, error: str) -> StackState:
    """A pre-flight validation said no: end before any side effect."""
    return evolve(
        state, phase=Phase.ENDED, status=RunStatus.REJECTED, failed_step=step, failure=error
    )


def finish(state: StackState) -> StackState:
    """End the run, deriving the status from what happened."""
    if state.status is not None and state.phase is Phase.ENDED:
        return state
    if state.phase is Phase.FORWARD:
        status = RunStatus.COMPLETED
    elif any(not o.ok for o in state.outcomes) or any(
        s.undo_error is not None for s in state.steps
    ):
        status = RunStatus.COMPENSATION_FAILED
    else:
        status = RunStatus.COMPENSATED
    return evolve(state, phase=Phase.ENDED, status=status)


def resume(state: StackState) -> StackState:
    """Reopen a stuck run for forward recovery: only its pending calls may run."""
    if state.status is not RunStatus.STUCK:
        raise StepRefusedError(
            f"run {state.run_id} is {state.status.value if state.status else 'running'}, not "
            "stuck; only a stuck run is resumed forward"
        )
    return evolve(state, phase=Phase.FORWARD, status=None, failed_step=None, failure=None)
