"""Properties of the compensation stack over random plans with random failures."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saga_otel import (
    RetryPolicy,
    RunStatus,
    StepClass,
    StepRefusedError,
    ToolRegistry,
    _stack,
    tool,
)
from saga_otel.records import Compensation, CompensationOutcome, StepRecord
from saga_otel.testing import capture

ATTEMPTS = 3


@dataclass(frozen=True)
class PlannedStep:
    klass: StepClass
    do_fails: bool
    comp_failures: int  # failing compensate attempts before success; >= ATTEMPTS is permanent


steps_strategy = st.lists(
    st.builds(
        PlannedStep,
        klass=st.sampled_from(list(StepClass)),
        do_fails=st.sampled_from([False, False, False, True]),
        comp_failures=st.sampled_from([0, 0, 0, 1, 2, ATTEMPTS, ATTEMPTS + 5]),
    ),
    min_size=1,
    max_size=8,
)


def _build(plan: list[PlannedStep], effects: list[tuple[str, int]]) -> ToolRegistry:
    tools = []
    failures_left = {i: p.comp_failures for i, p in enumerate(plan)}
    for i, p in enumerate(plan):

        def do(i: int = i, p: PlannedStep = p) -> dict[str, int]:
            if p.do_fails:
                raise RuntimeError(f"do {i} failed")
            effects.append(("do", i))
            return {"ref": i}

        def undo(ref: int) -> None:
            if failures_left[ref] > 0:
                failures_left[ref] -= 1
                raise RuntimeError(f"undo {ref} failed")
            effects.append(("undo", ref))

        if p.klass.pushes:
            tools.append(
                tool(
                    p.klass,
                    name=f"s{i}",
                    compensate=f"u{i}",
                    compensate_args=lambda info: {"ref": info.result["ref"]},
                )(do)
            )
            tools.append(tool("convergent", name=f"u{i}")(undo))
        else:
            tools.append(tool(p.klass, name=f"s{i}")(do))
    return ToolRegistry(tools)


@settings(max_examples=300, deadline=None)
@given(plan=steps_strategy)
def test_unwind_properties(plan: list[PlannedStep]) -> None:
    effects: list[tuple[str, int]] = []
    cap = capture()
    saga = cap.saga(
        "prop",
        tools=_build(plan, effects),
        retry=RetryPolicy(attempts=ATTEMPTS, jitter=0),
        allow_writes_after_pivot=True,
    )
    run = saga.run_sync()
    try:
        with run:
            for i in range(len(plan)):
                run.call(f"s{i}")
    except RuntimeError:
        pass
    report = run.report
    assert report is not None

    first_fail = next((i for i, p in enumerate(plan) if p.do_fails), None)
    ran = plan if first_fail is None else plan[:first_fail]
    succeeded = list(range(len(ran)))
    pivot_at = next((i for i in succeeded if plan[i].klass is StepClass.IRREVERSIBLE), None)
    pushed = [i for i in succeeded if plan[i].klass.pushes]
    undone = [ref for kind, ref in effects if kind == "undo"]

    if first_fail is None:
        assert report.status is RunStatus.COMPLETED
        assert undone == []
    elif pivot_at is not None:
        # Past the pivot: no compensation runs, a person is called.
        assert report.status is RunStatus.STUCK
        assert undone == []
        assert report.escalation_card() is not None
    else:
        # Exactly the pushed steps, most recent first, each at most once.
        attempted = [o.compensation.index for o in report.compensations]
        assert attempted == sorted(pushed, reverse=True)
        permanent = {i for i in pushed if plan[i].comp_failures >= ATTEMPTS}
        assert undone == [i for i in sorted(pushed, reverse=True) if i not in permanent]
        assert len(undone) == len(set(undone))
        failed = {o.compensation.index for o in report.compensations_failed}
        assert failed == permanent
        if permanent:
            assert report.status is RunStatus.COMPENSATION_FAILED
            card = report.escalation_card()
            assert card is not None and len(card.not_undone) == len(permanent)
        else:
            assert report.status is RunStatus.COMPENSATED


def _record(i: int, klass: StepClass, comp: bool = True, pivot: bool = False) -> StepRecord:
    c = Compensation(f"u{i}", {"ref": i}, step=f"s{i}", index=i) if comp else None
    return StepRecord(i, f"s{i}", f"s{i}", klass, 1, True, pivot=pivot, compensation=c)


def test_pure_machine_walk() -> None:
    s = _stack.StackState(run_id="r")
    s, i0 = _stack.begin_step(s, "s0", StepClass.COMPENSABLE)
    s = _stack.step_succeeded(s, _record(i0, StepClass.COMPENSABLE))
    s, i1 = _stack.begin_step(s, "s1", StepClass.REVERSIBLE)
    # An irreversible step may not start while s1 is in flight.
    with pytest.raises(StepRefusedError, match="in flight"):
        _stack.begin_step(s, "s2", StepClass.IRREVERSIBLE)
    s = _stack.step_succeeded(s, _record(i1, StepClass.REVERSIBLE))
    s, decision = _stack.abort(s, "Boom: x", failed_step="s2")
    assert isinstance(decision, _stack.Unwind)
    assert [c.index for c in decision.compensations] == [1, 0]
    for c in decision.compensations:
        s = _stack.compensation_ended(s, CompensationOutcome(c, c.index == 1, 1))
    s = _stack.finish(s)
    assert s.status is RunStatus.COMPENSATION_FAILED
    assert [c.index for c in s.stack] == [0]  # the failed one stays on the stack


def test_pure_machine_pivot_escalates() -> None:
    s = _stack.StackState(run_id="r")
    s, i = _stack.begin_step(s, "send", StepClass.IRREVERSIBLE)
    s = _stack.step_succeeded(s, _record(i, StepClass.IRREVERSIBLE, comp=False))
    assert s.pivot_crossed
    with pytest.raises(StepRefusedError, match="crossed its pivot"):
        _stack.begin_step(s, "credit", StepClass.COMPENSABLE)
    s, decision = _stack.abort(s, "E: later step failed")
    assert isinstance(decision, _stack.Escalate)
    assert s.status is RunStatus.STUCK
    resumed = _stack.resume(s)
    assert resumed.phase is _stack.Phase.FORWARD


def test_steps_refused_once_the_run_has_ended() -> None:
    s = _stack.finish(_stack.StackState(run_id="r"))
    with pytest.raises(StepRefusedError, match="not running forward"):
        _stack.begin_step(s, "late", StepClass.READ)


def test_evolve_is_dataclasses_replace() -> None:
    """The stack's own replace (saga_otel/_frozen.py) changes exactly the named fields."""
    import dataclasses

    base = _stack.StackState(run_id="r1", next_index=2, failed_step="a", failure="boom")
    changes: dict[str, object] = {
        "phase": _stack.Phase.UNWINDING,
        "stack": (Compensation("undo", {"id": 1}, "", "a", 0),),
        "in_flight_writes": frozenset({3}),
        "status": RunStatus.COMPENSATED,
        "failure": None,
    }
    for name, value in changes.items():
        assert _stack.evolve(base, **{name: value}) == dataclasses.replace(base, **{name: value})
    assert _stack.evolve(base, **changes) == dataclasses.replace(base, **changes)
    every = {f.name: object() for f in dataclasses.fields(base)}
    assert _stack.evolve(base, **every) == dataclasses.replace(base, **every)
    with pytest.raises(TypeError, match="no field"):
        _stack.evolve(base, nope=1)


def _credit(index: int, comp: Compensation | None = None) -> StepRecord:
    ok = comp is not None
    return StepRecord(index, "issue_credit", "issue_credit", StepClass.COMPENSABLE, 1, ok,
                      compensation=comp)  # fmt: skip


def _failing_fraud_check() -> tuple[_stack.StackState, int]:
    """issue_credit begun and still in flight when check_fraud fails and the run aborts."""
    s = _stack.StackState(run_id="r")
    s, credit = _stack.begin_step(s, "issue_credit", StepClass.COMPENSABLE)
    s, fraud = _stack.begin_step(s, "check_fraud", StepClass.READ)
    failed = StepRecord(fraud, "check_fraud", "check_fraud", StepClass.READ, 1, False, error="E")
    return _stack.step_failed(s, failed), credit


def test_an_abort_waits_for_the_writes_in_flight_then_unwinds_their_undos() -> None:
    s, credit = _failing_fraud_check()
    s, decision = _stack.abort(s, "E: fraud service down")
    assert isinstance(decision, _stack.Settle)
    assert [(w.index, w.name) for w in decision.writes] == [(credit, "issue_credit")]
    with pytest.raises(StepRefusedError, match="stopping"):
        _stack.begin_step(s, "more", StepClass.READ)  # no new step while it settles
    comp = Compensation("reverse_credit", {"credit_id": "cr_1"}, "", "issue_credit", credit)
    s = _stack.step_succeeded(s, _credit(credit, comp))  # the credit lands: pushed
    s, decision = _stack.abort(s, "E: fraud service down")
    assert decision == _stack.Unwind((comp,))
    assert (s.failed_step, s.failure) == ("check_fraud", "E: fraud service down")


def test_a_write_given_up_on_may_stand_and_its_late_end_is_refused() -> None:
    s, credit = _failing_fraud_check()
    s, decision = _stack.abort(s, "E: fraud service down")
    assert isinstance(decision, _stack.Settle)
    s = _stack.give_up(s, {credit: "it may have taken effect"})
    assert not s.in_flight_writes
    given_up = s.steps[-1]
    assert (given_up.name, given_up.ok, given_up.undo_error) == (
        "issue_credit", False, "it may have taken effect",
    )  # fmt: skip
    s, decision = _stack.abort(s, "E: fraud service down")
    assert decision == _stack.Unwind(())
    assert _stack.is_late(s)
    comp = Compensation("reverse_credit", {"credit_id": "cr_1"}, "", "issue_credit", credit)
    with pytest.raises(StepRefusedError, match="stopped waiting"):
        _stack.step_succeeded(s, _credit(credit, comp))  # never pushed onto a decided run
    assert _stack.finish(s).status is RunStatus.COMPENSATION_FAILED
