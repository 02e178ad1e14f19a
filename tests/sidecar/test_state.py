"""The pure run-state machine: order-, duplicate- and split-independence, orphans, recovery."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from sidecar_testkit import (
    CREDIT,
    TICKET,
    RunScript,
    compensated_run,
    compensation_failed_run,
    completed_run,
    heartbeat_spans,
    open_run,
    stuck_run,
)

from saga_otel import semconv as sc
from saga_otel.records import Compensation
from sidecar import RunState, SpanRecord
from sidecar._otlp import extract
from sidecar._state import _Watch
from sidecar._storage import Resolution

T = 1_700_000_100.0


def records(script_spans: Any) -> list[SpanRecord]:
    decoded = extract(encode_spans(list(script_spans)))
    assert decoded.rejected == 0, decoded.errors
    return list(decoded.spans)


def recovered_run(ok: bool = True) -> list[SpanRecord]:
    first = stuck_run(instance="agent-1")
    second = RunScript(instance="agent-2", run_id=first.run_id, t0=1_700_000_050.0)
    second.compensate(0, "issue_credit", CREDIT[0], CREDIT[1], ok=ok)
    second.end(sc.STATUS_COMPENSATED if ok else sc.STATUS_COMPENSATION_FAILED, "close_ticket")
    return records(first.spans()) + records(second.spans())


SCENARIOS = {
    "completed": lambda: records(completed_run().spans()),
    "compensated": lambda: records(compensated_run().spans()),
    "compensation_failed": lambda: records(compensation_failed_run().spans()),
    "stuck": lambda: records(stuck_run().spans()),
    "open": lambda: records(open_run().spans()),
    "recovered": recovered_run,
}
EXPECTED_STATUS = {
    "completed": sc.STATUS_COMPLETED,
    "compensated": sc.STATUS_COMPENSATED,
    "compensation_failed": sc.STATUS_COMPENSATION_FAILED,
    "stuck": sc.STATUS_STUCK,
    "open": sc.STATE_RUNNING,
    "recovered": sc.STATE_RECOVERED,
}
BUILT = {name: make() for name, make in SCENARIOS.items()}


def final_view(spans: list[SpanRecord]) -> dict[str, Any]:
    state = RunState()
    state.apply(spans, T)
    (run_id,) = list(state.run_ids())
    view = state.view(run_id)
    assert view is not None
    return view


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(SCENARIOS)),
    data=st.data(),
)
def test_any_permutation_duplication_and_split_gives_the_same_view(name: str, data: Any) -> None:
    spans = BUILT[name]
    order = data.draw(st.permutations(spans))
    dupes = data.draw(st.lists(st.sampled_from(spans), max_size=len(spans)))
    delivery = data.draw(st.permutations(order + dupes))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(delivery)), max_size=5)))
    state = RunState()
    start = 0
    for cut in [*cuts, len(delivery)]:
        state.apply(delivery[start:cut], T)
        start = max(start, cut)
    (run_id,) = list(state.run_ids())
    assert state.view(run_id) == final_view(spans)
    assert state.status(run_id) == EXPECTED_STATUS[name]


def _facts_by_walking(run: Any) -> Any:
    """The facts as they were computed before the aggregates: a walk over every step."""
    from sidecar._state import Facts, _comp_failed

    failed: tuple[int, ...] = ()
    if run.first_comp_start is not None:
        ended = run.has_ended()
        lowest = min((s.index for s in run.steps if s.comps), default=None)
        failed = tuple(s.index for s in run.steps if _comp_failed(s, ended, lowest))
    return Facts(
        run.status,
        run.unwind.start if run.unwind else run.first_comp_start,
        run.escalation,
        next((s.index for s in run.steps if s.pivot_ok), None),
        failed,
        run.resolution is not None,
        len(run.drops),
        tuple(s.index for s in run.steps if s.unstorable()),
        run.lease.override if run.lease is not None else None,
    )


@given(
    name=st.sampled_from(sorted(SCENARIOS)),
    data=st.data(),
)
def test_kept_facts_and_before_views_match_a_walk_over_the_steps(name: str, data: Any) -> None:
    """The per-run aggregates (``_Run.restep``) and the snapshot without step copies
    (``_Snapshot``) give what walking and copying every step gave, batch by batch."""
    from sidecar._state import _facts

    spans = BUILT[name]
    order = data.draw(st.permutations(spans))
    dupes = data.draw(st.lists(st.sampled_from(spans), max_size=len(spans)))
    delivery = data.draw(st.permutations(order + dupes))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(delivery)), max_size=5)))
    state = RunState()
    start = 0
    for cut in [*cuts, len(delivery)]:
        batch = delivery[start:cut]
        start = max(start, cut)
        before = {r: state.view(r) for r in state.run_ids()}
        applied = state.apply(batch, T, keep_before=True)
        for run_id in applied.changed:
            assert state.view_before(applied, run_id) == before.get(run_id)
        for run_id in state.run_ids():
            run = state._runs[run_id]
            assert _facts(run) == _facts_by_walking(run)


def test_stack_items_are_compensation_to_dict() -> None:
    view = final_view(BUILT["open"])
    expected = Compensation(
        tool=CREDIT[0], args=CREDIT[1], description=CREDIT[2], step="issue_credit", index=1
    ).to_dict()
    assert view["stack"] == [expected]


def test_transitions_running_unwinding_compensated() -> None:
    spans = records(compensated_run().spans())
    state = RunState()
    forward = [s for s in spans if s.phase in (sc.PHASE_DO,)]
    rest = [s for s in spans if s.phase not in (sc.PHASE_DO, sc.PHASE_RUN)]
    run_span = [s for s in spans if s.phase == sc.PHASE_RUN]
    a = state.apply(forward, T)
    b = state.apply(rest, T + 1)
    c = state.apply(run_span, T + 2)
    assert [(t.before, t.after) for t in a.transitions] == [(None, sc.STATE_RUNNING)]
    assert [(t.before, t.after) for t in b.transitions] == [(sc.STATE_RUNNING, sc.STATE_UNWINDING)]
    assert [(t.before, t.after) for t in c.transitions] == [
        (sc.STATE_UNWINDING, sc.STATUS_COMPENSATED)
    ]
    assert state.apply(run_span, T + 3).changed == ()  # a duplicate changes nothing


def test_a_compensate_span_alone_means_unwinding() -> None:
    spans = records(compensated_run().spans())
    state = RunState()
    state.apply([s for s in spans if s.phase == sc.PHASE_COMPENSATE][:1], T)
    (run_id,) = list(state.run_ids())
    view = state.view(run_id)
    assert view is not None and view["status"] == sc.STATE_UNWINDING
    assert view["unwind_started_at"] is not None


def test_compensation_failed_step_needs_a_lower_compensate_or_the_end() -> None:
    r = RunScript()
    r.do(0, "a", comp=("undo_a", {}, ""))
    r.do(1, "b", comp=("undo_b", {}, ""))
    r.do(2, "c", ok=False)
    r.compensate(1, "b", "undo_b", {}, ok=False)
    spans = records(r.spans())
    state = RunState()
    state.apply(spans, T)
    view = state.view(r.run_id)
    assert view is not None
    assert [s["compensation_failed"] for s in view["steps"]] == [False, False, False]
    r.compensate(0, "a", "undo_a", {})
    state.apply(records(r.spans()), T)
    view = state.view(r.run_id)
    assert view is not None
    assert [s["compensation_failed"] for s in view["steps"]] == [False, True, False]
    assert [item["index"] for item in view["stack"]] == [1]


def test_idle_run_without_heartbeats_is_orphaned_after_the_timeout() -> None:
    state = RunState(idle_timeout=60)
    spans = records(open_run().spans())
    state.apply(spans, T)
    assert state.tick(T + 59) == []
    (t,) = state.tick(T + 61)
    assert (t.before, t.after, t.at) == (sc.STATE_RUNNING, sc.STATE_ORPHANED, T + 61)
    assert state.tick(T + 200) == []
    assert state.orphaned_unresolved() == 1


def test_marked_answers_the_orphan_marks_still_their_runs() -> None:
    """What the sidecar writes again of the marks the store refused: a mark its run
    outlived (heard from since, then orphaned anew) or a run it never knew is not."""
    state = RunState(idle_timeout=60)
    run = open_run(instance="agent-b")
    state.apply(records(run.spans()), T)
    (first,) = state.tick(T + 61)
    assert first.at == T + 61
    assert state.marked([(run.run_id, T + 61), ("unknown", T + 61)]) == [(run.run_id, T + 61)]
    state.apply(beats([run.run_id], [T + 62]), T + 62)  # late, not dead
    assert state.marked([(run.run_id, T + 61)]) == []
    (again,) = state.tick(T + 62 + 200)
    assert state.marked([(run.run_id, T + 61), (run.run_id, again.at)]) == [(run.run_id, again.at)]


def test_heartbeats_keep_a_run_alive_until_three_intervals_pass() -> None:
    state = RunState(idle_timeout=5)
    run = open_run(instance="agent-hb")
    state.apply(records(run.spans()), T)
    for i in range(10):  # heartbeats every second for ten seconds: never orphaned
        state.apply(records(heartbeat_spans("agent-hb", [run.run_id], T + i)), T + i)
        assert state.tick(T + i + 0.5) == []
    last = T + 9
    assert state.tick(last + 2.9) == []
    (t,) = state.tick(last + 3.1)
    assert (t.run_id, t.after) == (run.run_id, sc.STATE_ORPHANED)


def test_run_span_wins_over_orphaned_and_finished_runs_never_orphan() -> None:
    state = RunState(idle_timeout=1)
    done = completed_run()
    state.apply(records(done.spans()), T)
    assert state.tick(T + 100) == []
    r = open_run()
    state.apply(records(r.spans()), T)
    state.tick(T + 2)
    assert state.status(r.run_id) == sc.STATE_ORPHANED
    r.end(sc.STATUS_COMPLETED)
    state.apply(records(r.spans()), T + 3)
    assert state.status(r.run_id) == sc.STATUS_COMPLETED


def test_orphaned_run_recovered_by_another_process() -> None:
    state = RunState(idle_timeout=1)
    first = open_run(instance="agent-1")
    state.apply(records(first.spans()), T)
    state.tick(T + 5)
    assert state.status(first.run_id) == sc.STATE_ORPHANED
    second = RunScript(instance="agent-2", run_id=first.run_id, t0=1_700_000_060.0)
    second.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
    partial = records(second.spans())
    state.apply(partial, T + 6)
    assert state.status(first.run_id) == sc.STATE_UNWINDING
    second.end(sc.STATUS_COMPENSATED)
    applied = state.apply(records(second.spans()), T + 7)
    assert state.status(first.run_id) == sc.STATE_RECOVERED
    assert [(t.before, t.after) for t in applied.transitions] == [
        (sc.STATE_UNWINDING, sc.STATE_RECOVERED)
    ]
    view = state.view(first.run_id)
    assert view is not None and view["stack"] == [] and view["instance"] == "agent-1"


def test_a_recovery_whose_recoverer_dies_is_orphaned_again_once_its_lease_ends() -> None:
    """The agent died; a recoverer took the lease and began; then it died too. While its
    lease lives, quiet is a long undo; once the lease has ended nobody is unwinding the
    run: it is orphaned again (a page), and a recovery can be granted anew."""
    from sidecar._leases import Lease

    state = RunState(idle_timeout=1)
    first = open_run(instance="agent-1")
    state.apply(records(first.spans()), T)
    (orphaned,) = state.tick(T + 5)
    assert orphaned.after == sc.STATE_ORPHANED
    state.set_lease(Lease(first.run_id, "recoverer-7", 1, T + 5, expires_at=T + 40))
    second = RunScript(instance="agent-2", run_id=first.run_id, t0=1_700_000_060.0)
    second.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
    state.apply(records(second.spans()), T + 6)
    assert state.status(first.run_id) == sc.STATE_UNWINDING
    assert state.tick(T + 20) == []  # quiet, but its lease lives: a long undo
    assert state.tick(T + 39) == []
    (again,) = state.tick(T + 41)  # the lease ended with nobody unwinding the run
    assert (again.before, again.after) == (sc.STATE_UNWINDING, sc.STATE_ORPHANED)
    assert state.tick(T + 100) == []  # once


def test_a_recovery_that_ends_with_an_undo_still_on_the_stack_is_not_recovered() -> None:
    """The agent came back while a recoverer worked and pushed another undo after the
    recoverer had read the stack; the recoverer undid what it read and ended the run
    compensated. That undo still stands: compensation_failed (a person), not recovered."""
    state = RunState(idle_timeout=1)
    first = open_run(instance="agent-1")
    state.apply(records(first.spans()), T)
    state.tick(T + 5)
    back = RunScript(instance="agent-1", run_id=first.run_id, t0=1_700_000_006.0)
    back.do(2, "update_ticket", "reversible", comp=TICKET)
    state.apply(records(back.spans()), T + 6)
    recoverer = RunScript(instance="agent-2", run_id=first.run_id, t0=1_700_000_007.0)
    recoverer.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
    recoverer.end(sc.STATUS_COMPENSATED)
    state.apply(records(recoverer.spans()), T + 7)
    assert state.status(first.run_id) == sc.STATUS_COMPENSATION_FAILED
    view = state.view(first.run_id)
    assert view is not None and [c["tool"] for c in view["stack"]] == [TICKET[0]]
    assert [r["run_id"] for r in state.summaries(needs_person=True)] == [first.run_id]


def test_failed_recovery_is_compensation_failed() -> None:
    state = RunState()
    state.apply(recovered_run(ok=False), T)
    (run_id,) = list(state.run_ids())
    assert state.status(run_id) == sc.STATUS_COMPENSATION_FAILED
    view = state.view(run_id)
    assert view is not None and [i["index"] for i in view["stack"]] == [0]


def test_prune_forgets_finished_runs_past_retention_only() -> None:
    state = RunState(idle_timeout=10_000)
    done, running = completed_run(), open_run()
    state.apply(records(done.spans()) + records(running.spans()), T)
    assert state.prunable(T + 50, retention=100) == []
    assert state.prunable(T + 101, retention=100) == [done.run_id]
    state.forget([done.run_id])
    assert done.run_id not in state and running.run_id in state


def test_prune_keeps_runs_waiting_for_a_person_until_resolved() -> None:
    state = RunState(idle_timeout=10_000)
    stuck, failed = stuck_run(), compensation_failed_run()
    state.apply(records(stuck.spans()) + records(failed.spans()), T)
    assert state.prunable(T + 365 * 86400.0, retention=100) == []
    assert state.resolve(stuck.run_id, "finished by hand", T + 1)
    assert state.prunable(T + 365 * 86400.0, retention=100) == [stuck.run_id]


def test_keep_before_gives_before_views() -> None:
    state = RunState()
    spans = records(stuck_run().spans())
    first = state.apply(spans[:2], T, keep_before=True)
    assert [state.view_before(first, r) for r in first.changed] == [None]
    second = state.apply(spans[2:], T, keep_before=True)
    (run_id,) = second.changed
    before = state.view_before(second, run_id)
    assert before is not None and before["status"] == sc.STATE_RUNNING
    assert second.facts_changed == (run_id,)  # running -> stuck moves the facts


# --- delivery cadence: batching exporters are late, not dead -----------------------------


def beats(open_runs: list[str], times: list[float], instance: str = "agent-b") -> list[SpanRecord]:
    """Heartbeats at ``times`` (the agent's clock), as one delivery."""
    out: list[SpanRecord] = []
    for t in times:
        out += records(heartbeat_spans(instance, open_runs, t))
    return out


def batched_agent(
    state: RunState, run_id: str, start: float, seconds: float, delay: float = 5.0
) -> tuple[float, list[Any]]:
    """An agent beating every second behind a BatchSpanProcessor: a delivery each ``delay``
    (+0.2 s to export), carrying the beats since the last one. The first delivery holds one
    beat (the run opened just before the timer fired). Ticks every 0.1 s; returns the last
    delivery's receipt time and every transition."""
    transitions: list[Any] = []
    beat, receipt = start, start
    state.apply(beats([run_id], [beat]), receipt)
    now = receipt
    while now < start + seconds:
        now = round(now + 0.1, 3)
        transitions += state.tick(now)
        if now >= receipt + delay + 0.2:
            times = []
            while beat + 1.0 <= now:
                beat += 1.0
                times.append(beat)
            applied = state.apply(beats([run_id], times), now)
            transitions += applied.transitions
            receipt = now
    return receipt, transitions


def test_an_agent_delivering_every_5_s_is_never_orphaned_while_alive() -> None:
    state = RunState(idle_timeout=60)
    run = open_run(instance="agent-b")
    state.apply(records(run.spans()), T)
    last, transitions = batched_agent(state, run.run_id, T, seconds=60)
    assert transitions == [] and state.status(run.run_id) == sc.STATE_RUNNING
    # Then it dies: noticed once silent past its learned gap + 2 intervals, where the gap
    # is the widest of the receipt gaps (5.3 s) and a delivery's beat spread + 1 interval
    # (six beats, 5 s apart: 6 s).
    assert state.tick(last + 7.9) == []
    (t,) = state.tick(last + 8.1)
    assert (t.run_id, t.after) == (run.run_id, sc.STATE_ORPHANED)


def test_an_agent_sending_at_once_keeps_the_three_interval_rule() -> None:
    state = RunState(idle_timeout=60)
    run = open_run(instance="agent-b")
    state.apply(records(run.spans()), T)
    state.apply(beats([run.run_id], [T]), T)
    # One delivery only: no cadence shown yet, so an SDK's default batching is presumed.
    assert state.tick(T + 6.9) == []
    state.apply(beats([run.run_id], [T + 7]), T + 7)  # continuous? no: a 7 s break
    state.apply(beats([run.run_id], [T + 8]), T + 8)
    assert state.tick(T + 8 + 2.9) == []
    (t,) = state.tick(T + 8 + 3.1)
    assert t.after == sc.STATE_ORPHANED


def test_an_agent_clock_stepped_back_while_idle_teaches_no_delivery_gap() -> None:
    """An agent sending at once, idle a minute between runs, its clock stepped back an hour
    meanwhile (NTP). Its next beat is before the last one seen, no follow-up of it: the idle
    minute was learned as a delivery gap (a 32 s window, not 3 s)."""
    state = RunState(idle_timeout=600)
    first = completed_run(instance="agent-b", t0=T)
    for i in range(1, 6):  # beating while it runs
        state.apply(beats([first.run_id], [T + i]), T + i)
    state.apply(records(first.spans()), T + 6)
    back = -3600.0  # the agent's clock, from now on
    second = open_run(instance="agent-b", t0=T + 66 + back)
    state.apply(records(second.spans()), T + 66)
    for i in range(67, 70):
        state.apply(beats([second.run_id], [T + i + back]), T + i)
    assert state.tick(T + 69 + 2.9) == []
    (t,) = state.tick(T + 69 + 3.1)
    assert (t.run_id, t.after) == (second.run_id, sc.STATE_ORPHANED)


def test_beats_after_an_agent_clock_stepped_back_follow_the_new_clock() -> None:
    """The agent's clock steps back an hour right after its first beat: the beats after it
    are continuous by its new clock (they were measured from the old one's last, never
    continuous, and the window stayed an SDK's default batching: 7 s, not 3)."""
    state = RunState(idle_timeout=600)
    run = open_run(instance="agent-b")
    state.apply(records(run.spans()), T)
    state.apply(beats([run.run_id], [T]), T)
    for i in (1, 2, 3):
        state.apply(beats([run.run_id], [T + i - 3600.0]), T + i)
    assert state.tick(T + 3 + 2.9) == []
    (t,) = state.tick(T + 3 + 3.1)
    assert t.after == sc.STATE_ORPHANED


def test_a_learned_gap_is_capped() -> None:
    state = RunState(idle_timeout=600)
    run = open_run(instance="agent-b")
    state.apply(records(run.spans()), T)
    # Beats every second, delivered every 100 s: the gap counts only up to 30 s.
    state.apply(beats([run.run_id], [T]), T)
    state.apply(beats([run.run_id], [T + i for i in range(1, 101)]), T + 100)
    state.apply(beats([run.run_id], [T + i for i in range(101, 201)]), T + 200)
    assert state.tick(T + 200 + 31.9) == []
    (t,) = state.tick(T + 200 + 32.1)
    assert t.after == sc.STATE_ORPHANED


def test_an_orphaned_run_heard_from_again_runs_again_and_its_alert_resolves() -> None:
    from sidecar._alerting import Action, evaluate

    state = RunState(idle_timeout=60)
    run = open_run(instance="agent-b")
    state.apply(records(run.spans()), T)
    state.apply(beats([run.run_id], [T]), T)
    state.apply(beats([run.run_id], [T + 1]), T + 1)  # learned: sends at once
    (t,) = state.tick(T + 4.5)  # then a 6 s hiccup in its exporter
    assert t.after == sc.STATE_ORPHANED
    orphaned = state.view(run.run_id)
    applied = state.apply(
        beats([run.run_id], [T + 2, T + 3, T + 4, T + 5, T + 6]), T + 7, keep_before=True
    )
    (back,) = applied.transitions
    assert (back.before, back.after) == (sc.STATE_ORPHANED, sc.STATE_RUNNING)
    view = state.view(run.run_id)
    assert view is not None and view["revived"] == {"orphaned_at": T + 4.5, "at": T + 7}
    assert state.view_before(applied, run.run_id) == orphaned
    (event,) = evaluate(orphaned, view, T + 7)
    assert (event.action, event.alertname) == (Action.RESOLVE, sc.ALERT_RUN_ORPHANED)
    assert "heard from 2.5 s after the orphan mark" in event.annotations["resolution"]
    assert "late, not dead" in event.annotations["resolution"]
    assert event.at == T + 7
    # And it is watched again: silence orphans it anew (its learned gap is now 6 s).
    assert state.tick(T + 7 + 7.9) == []
    (again,) = state.tick(T + 7 + 8.1)
    assert again.after == sc.STATE_ORPHANED


def test_a_heartbeat_read_from_another_replica_revives_as_one_received_here() -> None:
    """One rule for the heartbeats of both paths: the orphaned run a heartbeat another
    replica stored names is revived, with the mark it ended (the store clears that one),
    and watched again."""
    here, there = RunState(idle_timeout=60), RunState(idle_timeout=60)
    run = open_run(instance="agent-b")
    for state in (here, there):
        state.apply(records(run.spans()), T)
        state.apply(beats([run.run_id], [T]), T)
        (t,) = state.tick(T + 10.0)
        assert (t.after, t.unmarked) == (sc.STATE_ORPHANED, None)
    (received,) = here.apply(beats([run.run_id], [T + 11]), T + 11).transitions
    (read,) = there.heard("agent-b", T + 11, 1.0, [run.run_id], T + 11, retention=3600.0)
    for t in (received, read):
        assert (t.before, t.after, t.unmarked) == (sc.STATE_ORPHANED, sc.STATE_RUNNING, T + 10)
    assert here.view(run.run_id) == there.view(run.run_id)
    assert there.read_unmarked(run.run_id, T + 10.0, T + 12) is None  # ended already
    for state in (here, there):
        assert state.tick(T + 11 + 6.9) == []
        (again,) = state.tick(T + 11 + 7.1)
        assert again.after == sc.STATE_ORPHANED


def test_a_mark_read_from_the_store_is_ordered_by_change_number_not_by_clock() -> None:
    """An orphan mark another replica stored stands unless a span or an owner's heartbeat
    of the run heard here was stored after it (a larger change number): this replica's
    clock, an hour ahead of the leader's or an hour behind, plays no part. A mark ended
    here, or read as older than what was heard, stays so when its row comes again."""
    mark, mark_change = T + 10.0, 9  # stored by the leader, its time on the leader's clock
    a, b = open_run(instance="agent-1"), open_run(instance="agent-2")
    for skew in (3600.0, -3600.0):
        dead = RunState(idle_timeout=5)  # heard all before the mark, on a skewed clock
        dead.apply(records(a.spans()), T + skew, change=5)
        dead.apply(beats([a.run_id], [T + 1], instance="agent-1"), T + 1 + skew, change=6)
        moved = dead.read_orphaned(a.run_id, mark, mark_change)
        assert moved is not None and moved.after == sc.STATE_ORPHANED
        late = RunState(idle_timeout=5)  # heard the agent after the mark
        late.apply(records(a.spans()), T + skew, change=5)
        late.apply(beats([a.run_id], [T + 11], instance="agent-1"), T + 11 + skew, change=12)
        assert late.read_orphaned(a.run_id, mark, mark_change) is None
        assert late.read_orphaned(a.run_id, mark, 15) is None  # its row changed again
        later = late.read_orphaned(a.run_id, T + 30.0, 20)  # a later mark stands
        assert later is not None and later.after == sc.STATE_ORPHANED
    # Rows of several transactions read at once: each run by its own.
    state = RunState(idle_timeout=5)
    state.apply(records(a.spans()) + records(b.spans()), T, change={a.run_id: 5, b.run_id: 12})
    assert state.read_orphaned(a.run_id, mark, mark_change) is not None
    assert state.read_orphaned(b.run_id, mark, mark_change) is None
    # Another replica's heartbeat naming the run, and a mark ended here by it.
    state = RunState(idle_timeout=5)
    state.apply(records(b.spans()), T, change=5)
    assert state.heard("agent-2", T + 1, 1.0, [b.run_id], T + 1, 3600.0, change=12) == []
    assert state.read_orphaned(b.run_id, mark, mark_change) is None
    state = RunState(idle_timeout=5)
    state.apply(records(b.spans()), T, change=5)
    assert state.read_orphaned(b.run_id, mark, mark_change) is not None
    # (a heartbeat whose commit waited: its number is below the mark's)
    (revived,) = state.heard("agent-2", T + 12, 1.0, [b.run_id], T + 12, 3600.0, change=4)
    assert (revived.after, revived.unmarked) == (sc.STATE_RUNNING, mark)
    assert state.read_orphaned(b.run_id, mark, 15) is None  # the mark it ended, again
    assert state.status(b.run_id) == sc.STATE_RUNNING


def test_a_resolution_lapses_when_the_run_comes_to_need_a_person_again() -> None:
    """Resolved while it unwound, then its undo failed; resolved while orphaned, then its
    agent came back and died: each time the run needs a person anew, its alert fires and
    it is back in the review queue."""
    from sidecar._alerting import Action, evaluate

    state = RunState(idle_timeout=60)
    failed = compensation_failed_run()
    spans = records(failed.spans())
    cut = next(i for i, s in enumerate(spans) if s.attributes[sc.SAGA_PHASE] == sc.PHASE_UNWIND)
    state.apply(spans[: cut + 1], T)
    assert state.status(failed.run_id) == sc.STATE_UNWINDING
    assert state.resolve(failed.run_id, "watching it", T + 1)
    applied = state.apply(spans[cut + 1 :], T + 2, keep_before=True)
    (t,) = applied.transitions
    assert (t.after, t.lapsed) == (sc.STATUS_COMPENSATION_FAILED, Resolution("watching it", T + 1))
    before, after = state.view_before(applied, failed.run_id), state.view(failed.run_id)
    assert after is not None and after["resolution"] is None
    fired = [e.alertname for e in evaluate(before, after, T + 2) if e.action is Action.FIRE]
    assert sc.ALERT_COMPENSATION_FAILED in fired
    assert [r["run_id"] for r in state.summaries(needs_person=True)] == [failed.run_id]

    state = RunState(idle_timeout=60)
    orphan = open_run(instance="agent-b")
    state.apply(records(orphan.spans()), T)
    state.apply(beats([orphan.run_id], [T]), T)
    state.apply(beats([orphan.run_id], [T + 1]), T + 1)  # learned: sends at once
    (first,) = state.tick(T + 4.5)
    assert (first.after, first.lapsed) == (sc.STATE_ORPHANED, None)
    assert state.resolve(orphan.run_id, "restarted the agent", T + 5)
    state.apply(beats([orphan.run_id], [T + 5, T + 6, T + 7]), T + 7)  # back
    assert state.status(orphan.run_id) == sc.STATE_RUNNING
    (second,) = state.tick(T + 60)  # then dead
    assert (second.after, second.lapsed) == (
        sc.STATE_ORPHANED,
        Resolution("restarted the agent", T + 5),
    )
    view = state.view(orphan.run_id)
    assert view is not None and view["resolution"] is None
    # A resolution given while the run needs a person holds while it stays so.
    assert state.resolve(orphan.run_id, "undone by hand", T + 61)
    assert state.tick(T + 120) == [] and state.view(orphan.run_id)["resolution"]  # type: ignore[index]


def test_a_resolution_read_from_the_store_takes_the_place_of_the_one_held() -> None:
    """Replicas: the mark row a sync reads is the row's newest version, so its resolution
    replaces the one held (a replacement made through another replica), whatever the
    clocks say; a row without one drops it (a lapse cleared there); one made at or before
    the orphan mark lapsed and does not stand."""
    state = RunState(idle_timeout=60)
    stuck = stuck_run()
    state.apply(records(stuck.spans()), T)
    alice, bob = Resolution("reversed by hand", T + 5, "alice"), Resolution("retried", T + 1)
    assert state.resolve(stuck.run_id, alice.note, alice.at, alice.by)
    assert state.read_resolution(stuck.run_id, bob)  # its clock was behind: it still stands
    view = state.view(stuck.run_id)
    assert view is not None and view["resolution"] == {"note": "retried", "at": T + 1, "by": None}
    assert not state.read_resolution(stuck.run_id, bob)  # read again: nothing changes
    assert state.read_resolution(stuck.run_id, None)
    assert state.view(stuck.run_id)["resolution"] is None  # type: ignore[index]
    assert [r["run_id"] for r in state.summaries(needs_person=True)] == [stuck.run_id]
    assert not state.read_resolution("no-such-run", alice)

    orphan = open_run(instance="agent-b")
    state.apply(records(orphan.spans()), T)
    assert state.restore_orphaned(orphan.run_id, T + 10) is not None
    assert not state.read_resolution(orphan.run_id, Resolution("restarted it", T + 10))
    assert state.view(orphan.run_id)["resolution"] is None  # type: ignore[index]
    assert state.read_resolution(orphan.run_id, Resolution("restarted it", T + 11))
    assert state.read_resolution(orphan.run_id, Resolution("older", T + 9))  # lapsed: none
    assert state.view(orphan.run_id)["resolution"] is None  # type: ignore[index]


def test_a_span_of_the_run_also_brings_it_back_but_a_strangers_heartbeat_does_not() -> None:
    state = RunState(idle_timeout=5)
    run = open_run(instance="agent-1")
    state.apply(records(run.spans()), T)
    (t,) = state.tick(T + 6)  # no heartbeats: the idle rule
    assert t.after == sc.STATE_ORPHANED
    assert state.apply(beats([run.run_id], [T + 7], instance="intruder"), T + 7).transitions == ()
    assert state.status(run.run_id) == sc.STATE_ORPHANED
    run.do(2, "tag_ticket", "reversible", comp=("untag", {"t": 1}, "untag"))
    applied = state.apply(records(run.spans()[-1:]), T + 8)
    assert [(x.before, x.after) for x in applied.transitions] == [
        (sc.STATE_ORPHANED, sc.STATE_RUNNING)
    ]


def test_a_run_past_the_idle_timeout_is_still_orphaned_when_its_process_dies() -> None:
    # Idle timeout shorter than the heartbeat window: the run leaves the idle queue while
    # its process is still believed alive, and the heartbeat rule must still find it.
    state = RunState(idle_timeout=3)
    run = open_run(instance="agent-b")
    state.apply(records(run.spans()), T)
    state.apply(beats([run.run_id], [T]), T)  # one beat, then SIGKILL: window 7 s
    assert state.tick(T + 3.5) == []
    assert state.tick(T + 6.9) == []
    (t,) = state.tick(T + 7.1)
    assert (t.run_id, t.after) == (run.run_id, sc.STATE_ORPHANED)


# --- presence: a live connection whose close says the process died -------------------------


def _watched_run(state: RunState) -> str:
    run = open_run(instance="agent-p")
    state.apply(records(run.spans()), T)
    state.apply(beats([run.run_id], [T], instance="agent-p"), T)
    state.apply(beats([run.run_id], [T + 1], instance="agent-p"), T + 1)  # sends at once
    return run.run_id


def test_a_lost_connection_orphans_after_the_grace_unless_a_heartbeat_confirms_life() -> None:
    state = RunState(idle_timeout=60)
    run_id = _watched_run(state)
    state.presence_lost("agent-p", T + 1.2)
    assert state.tick(T + 1.6) == []
    (t,) = state.tick(T + 1.75)  # 0.55 s after the close, 2.2 s before the heartbeat rule
    assert (t.run_id, t.after) == (run_id, sc.STATE_ORPHANED)

    alive = RunState(idle_timeout=60)
    run_id = _watched_run(alive)
    alive.presence_lost("agent-p", T + 1.2)
    # A heartbeat sent before the close may arrive just after it: no proof of life.
    alive.apply(beats([run_id], [T + 1.15], instance="agent-p"), T + 1.25)
    assert alive.tick(T + 1.71) != []

    alive = RunState(idle_timeout=60)
    run_id = _watched_run(alive)
    alive.presence_lost("agent-p", T + 1.2)
    alive.apply(beats([run_id], [T + 1.5], instance="agent-p"), T + 1.5)  # beating: alive
    assert alive.tick(T + 1.8) == [] and alive.tick(T + 4.4) == []
    (t,) = alive.tick(T + 4.6)  # then the heartbeat rule alone
    assert t.after == sc.STATE_ORPHANED


def test_a_step_of_the_clock_keeps_every_silence_as_it_was() -> None:
    """RunState.clock_stepped: the sidecar's clock stepped 120 s forward or an hour back
    while no time passed (NTP, a VM resumed). A heart-beating agent's window, the idle
    rule of a run whose process never beats, and a lost connection's grace each end as
    long after their last word as on a clock never stepped; a live agent stays alive."""
    for step in (120.0, -3600.0):
        state = RunState(idle_timeout=60)
        beating = _watched_run(state)  # heard at T + 1, its window 3 s
        quiet = open_run(instance="agent-q")  # never beats: the idle rule
        state.apply(records(quiet.spans()), T + 1)
        state.clock_stepped(step)
        now = T + 1 + step
        liveness = state.liveness(beating, now + 2.9)
        assert liveness is not None and liveness.alive, step
        assert state.tick(now + 2.9) == [], step
        (t,) = state.tick(now + 3.1)
        assert t.run_id == beating, step
        assert state.tick(now + 59.9) == [], step
        (t,) = state.tick(now + 60.1)
        assert t.run_id == quiet.run_id, step

        lost = RunState(idle_timeout=60)
        run_id = _watched_run(lost)
        lost.presence_lost("agent-p", T + 1.2)
        lost.clock_stepped(step)
        assert lost.tick(T + 1.6 + step) == [], step
        (t,) = lost.tick(T + 1.75 + step)
        assert (t.run_id, t.after) == (run_id, sc.STATE_ORPHANED), step


def test_a_step_of_the_clock_keeps_a_recovery_lease_as_it_was() -> None:
    """RunState.clock_stepped moves the recovery leases with the receipt times: a run under
    recovery is held for the rest of its lease and no longer (a step forward ended the
    lease at once and paged the run while its recoverer worked; a step back held it an
    hour), and an agent heard from after the grant stays after it, so the recoverer's
    renewal is still refused (``_leases.renew``)."""
    from sidecar._leases import Lease, LeaseRefusal, LeaseRequest, renew

    def orphaned_and_leased(state: RunState, instance: str) -> RunScript:
        run = open_run(instance=instance)
        state.apply(records(run.spans()), T)
        state.tick(T + 5)
        state.set_lease(Lease(run.run_id, "rec", 1, T + 5, expires_at=T + 40))
        return run

    for step in (120.0, -3600.0):
        state = RunState(idle_timeout=1)
        taken = orphaned_and_leased(state, "agent-1")
        recoverer = RunScript(instance="rec", run_id=taken.run_id, t0=T + 6)
        recoverer.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
        state.apply(records(recoverer.spans()), T + 6)
        state.clock_stepped(step)
        assert state.tick(T + 39 + step) == [], step
        (again,) = state.tick(T + 41 + step)
        assert (again.run_id, again.after) == (taken.run_id, sc.STATE_ORPHANED), step

        state = RunState(idle_timeout=1)
        back = orphaned_and_leased(state, "agent-2")
        back.do(2, "note_ticket", "read")  # its agent was only paused
        state.apply(records(back.spans()), T + 7)
        state.clock_stepped(step)
        lease, owner = state.lease(back.run_id), state.liveness(back.run_id, T + 8 + step)
        assert owner is not None, step
        refused = renew(back.run_id, lease, owner, LeaseRequest("rec", token=1), T + 8 + step)
        assert isinstance(refused, LeaseRefusal) and refused.reason == "agent_alive", step


def test_a_reconnect_cancels_a_lost_connection() -> None:
    state = RunState(idle_timeout=60)
    _watched_run(state)
    state.presence_lost("agent-p", T + 1.2)
    state.presence_opened("agent-p")
    assert state.tick(T + 2.0) == []
    state.presence_lost("unknown-instance", T + 1.2)  # no heartbeats known: nothing to do
    assert state.tick(T + 3.9) == []


def test_a_heartbeat_read_before_a_prune_does_not_bring_its_instance_back() -> None:
    # A replica's sync reads other replicas' heartbeats, then folds them; a prune may
    # forget those instances in between. Past the retention, the old heartbeat is ignored.
    state = RunState(idle_timeout=60.0)
    t0 = 1_700_000_000.0
    state.heard("pid-1", t0, 1.0, [], now=t0 + 0.5, retention=3600.0)  # heard when read
    assert state.instance_count() == 1
    assert state.stale_instances(t0 + 3601.0, 3600.0) == ["pid-1"]
    state.forget_instances(["pid-1"])
    state.heard("pid-1", t0, 1.0, [], now=t0 + 3601.0, retention=3600.0)  # the racing sync
    assert state.instance_count() == 0
    state.heard("pid-1", t0 + 3600.5, 1.0, [], now=t0 + 3601.0, retention=3600.0)  # alive
    assert state.instance_count() == 1


# --- the tick looks only at watches past due ---------------------------------------------

_INSTANCES = [f"agent-{i}" for i in range(4)]
_WATCH_OPS = st.lists(
    st.tuples(
        st.sampled_from(["beat", "lost", "opened", "restore", "heard", "forget", "tick", "step"]),
        st.sampled_from(_INSTANCES),
        st.sampled_from([0.5, 1.0, 2.0]),  # a heartbeat interval
        st.integers(min_value=1, max_value=3),  # heartbeats in one delivery
        st.floats(min_value=0.0, max_value=2.5),  # seconds the clock moves first
        st.sampled_from([120.0, -3600.0, 1.5]),  # a step of the clock (NTP, a VM resumed)
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_WATCH_OPS)
def test_a_tick_finds_the_same_dead_processes_as_a_scan_of_every_watch(ops: Any) -> None:
    """``tick`` pops watches from a queue of due moments instead of scanning every
    instance; whatever happens to the watches in between (deliveries at other cadences,
    lost and reopened connections, restores, other replicas' heartbeats, forgetting),
    each tick marks dead exactly the live watches a scan finds past due. So do steps of
    the clock (``clock_stepped``): the queue moves with the watches."""
    state = RunState(idle_timeout=3600.0)
    now = T
    for op, instance, interval, count, dt, step in ops:
        now += round(dt, 2)
        if op == "step":
            now += step
            state.clock_stepped(step)
            continue
        if op == "beat":
            times = [now - interval * k for k in range(count)][::-1]
            spans = beats([], times, instance=instance)
            for span in spans:
                span.attributes[sc.SAGA_HEARTBEAT_INTERVAL_S] = interval  # type: ignore[index]
            state.apply(spans, now)
        elif op == "lost":
            state.presence_lost(instance, now)
        elif op == "opened":
            state.presence_opened(instance)
        elif op == "restore":
            state.restore_instance(instance, now - interval, interval)
        elif op == "heard":
            state.heard(instance, now - interval, interval, [], now, retention=3600.0)
        elif op == "forget":
            state.forget_instances([instance])
        else:
            watches = state._instances
            expected = {i for i, w in watches.items() if not w.dead and now > w.due()}
            before = {i for i, w in watches.items() if w.dead}
            state.tick(now)
            after = {i for i, w in watches.items() if w.dead}
            assert after - before == expected
            assert before <= after


def test_a_watch_marked_dead_then_heard_again_is_judged_again() -> None:
    """Found by the property above: a tick pops a watch's due and marks it dead; another
    replica's heartbeat, sent within the settle after the lost connection, revives it
    with the same due. The due must be queued again, or the watch is never judged."""
    state = RunState(idle_timeout=3600.0)
    state.apply(beats([], [T], instance="a"), T)
    state.presence_lost("a", T)
    state.tick(T + 1.0)
    assert state._instances["a"].dead
    state.heard("a", T + 0.05, 1.0, [], T + 1.0, retention=3600.0)  # within the settle
    assert not state._instances["a"].dead
    state.tick(T + 1.0)
    assert state._instances["a"].dead  # still past the lost connection's grace


def test_another_replicas_heartbeat_after_a_lost_connection_keeps_the_watch_alive() -> None:
    """The same rule as our own heartbeats: beating after its connection closed (past
    the settle) means the process lives; the grace no longer applies."""
    state = RunState(idle_timeout=3600.0)
    state.apply(beats([], [T], instance="a"), T)
    state.presence_lost("a", T)
    state.heard("a", T + 0.3, 1.0, [], T + 0.3, retention=3600.0)
    state.tick(T + 1.0)
    assert not state._instances["a"].dead
    state.tick(T + 0.3 + state._instances["a"].window() + 0.01)  # silent since: dead
    assert state._instances["a"].dead


def test_another_replicas_heartbeat_counts_from_when_this_one_read_it() -> None:
    """Another replica's COMMIT of a heartbeat waited (a lock, a slow disk) while its
    agent waited for the answer: read late, it counts as heard when read, not when that
    replica screened it. (The store hands each row over once: PgStore.changes.)"""
    state = RunState(idle_timeout=3600.0)
    state.heard("a", T, 1.0, [], T, retention=3600.0)
    window = state._instances["a"].window()
    state.heard("a", T + 0.3, 1.0, [], T + 10.0, retention=3600.0)  # committed ~10 s late
    assert state.tick(T + 10.0 + window - 0.1) == [] and not state._instances["a"].dead
    state.tick(T + 10.0 + window + 0.1)
    assert state._instances["a"].dead
    # A lost connection is still judged against when the agent spoke, not when read.
    state.apply(beats([], [T + 20.0], instance="b"), T + 20.0)
    state.presence_lost("b", T + 20.0)
    state.heard("b", T + 20.05, 1.0, [], T + 25.0, retention=3600.0)  # sent within the settle
    state.tick(T + 25.0)
    assert state._instances["b"].dead


def test_a_tick_looks_at_no_watch_before_one_falls_due(monkeypatch: Any) -> None:
    """Retention keeps every instance heard from in a week (many thousands); a tick runs
    five times a second and must not walk them all: it looks at a watch only when its
    due moment has passed (then once)."""
    state = RunState(idle_timeout=3600.0)
    for i in range(5000):
        state.restore_instance(f"agent-{i}", T, interval=100.0)  # due 300 s after T
    looked: list[str] = []
    window = _Watch.window
    monkeypatch.setattr(_Watch, "window", lambda w: looked.append("") or window(w))
    for k in range(50):
        assert state.tick(T + 1 + k * 0.2) == []
    assert looked == []
    state.tick(T + 301)  # all fall due: each is looked at, and found dead
    assert all(w.dead for w in state._instances.values()) and len(looked) == 5000


def test_the_queue_of_due_moments_stays_bounded_by_the_instances_kept() -> None:
    """Each delivery queues its watch's new due moment; ticks drop the stale ones as they
    fall due, and when ticks are rare the queue is compacted to one entry per live
    watch, so it never holds more than about twice the instances kept."""
    state = RunState(idle_timeout=3600.0)
    for beat in range(20):
        for i in range(2000):
            state.heard(f"agent-{i}", T + beat, 1.0, [], T + beat, retention=3600.0)
    assert len(state._dues) <= 2 * state.instance_count() + 1024
    assert {i for _, i in state._dues} == set(state._instances)
    dead = state.tick(T + 100)
    assert dead == [] and all(w.dead for w in state._instances.values())
    assert state._dues == []
