"""The pure alert rules: which views fire and resolve which alert, and what the alert says."""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_testkit import agent_cards, card_objects

from saga_otel import semconv as sc
from sidecar._alerting import (
    ALERT_NAMES,
    Action,
    AlertEvent,
    RuleConfig,
    counted,
    dedup_key,
    evaluate,
    is_open,
    open_alerts,
    render_card,
    resolve_stale,
)

RUN_ID = "4f2a9c0e1d2b3a4f5e6d7c8b9a0f1e2d"


def step(
    index: int,
    name: str,
    cls: str = "compensable",
    *,
    ok: bool = True,
    tool: str | None = None,
    args: dict[str, Any] | None = None,
    compensated: bool = False,
    failed: bool = False,
    error: str | None = None,
    pivot: bool = False,
) -> dict[str, Any]:
    comp = (
        {
            "step": name,
            "index": index,
            "tool": tool,
            "args": args or {},
            "description": f"undo {name}",
        }
        if tool
        else None
    )
    return {
        "index": index,
        "name": name,
        "class": cls,
        "pivot": pivot,
        "ok": ok,
        "attempts": [{"attempt": 1, "ok": ok, "error": error, "start": 1.0, "end": 1.1}],
        "compensation": comp,
        "compensations": (
            [{"attempt": 1, "ok": not failed, "error": "HTTPError: 500" if failed else None}]
            if compensated or failed
            else []
        ),
        "compensated": compensated,
        "compensation_failed": failed,
    }


def view(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "run_id": RUN_ID,
        "saga": "refund",
        "service": "refund-agent",
        "instance": "inst-1",
        "trace_id": RUN_ID,
        "status": "running",
        "started_at": 100.0,
        "updated_at": 101.0,
        "ended_at": None,
        "failed_step": None,
        "unwind_reason": None,
        "unwind_started_at": None,
        "pivot": None,
        "steps": [
            step(0, "issue_credit", tool="reverse_credit", args={"credit_id": "cr_1"}),
            step(1, "tag_ticket", tool="untag_ticket", args={"ticket": 7}),
        ],
        "stack": [
            {
                "step": "tag_ticket",
                "index": 1,
                "tool": "untag_ticket",
                "args": {"ticket": 7},
                "description": "undo tag_ticket",
            },
            {
                "step": "issue_credit",
                "index": 0,
                "tool": "reverse_credit",
                "args": {"credit_id": "cr_1"},
                "description": "undo issue_credit",
            },
        ],
        "escalation": None,
        "resolution": None,
    }
    base.update(over)
    return base


UNWINDING = {
    "status": "unwinding",
    "failed_step": "send_reply",
    "unwind_reason": "SMTPError: mail down",
    "unwind_started_at": 105.0,
    "updated_at": 105.0,
}


def names(events: list[AlertEvent], action: Action) -> list[str]:
    return [e.alertname for e in events if e.action is action]


# --- the four alerts ---------------------------------------------------------------------


def test_counts_are_written_in_words() -> None:
    assert [counted(n, "attempt") for n in (0, 1, 2)] == ["0 attempts", "1 attempt", "2 attempts"]


def test_compensation_started_fires_when_unwinding_begins() -> None:
    events = evaluate(view(), view(**UNWINDING), now=105.2)
    assert len(events) == 1
    (event,) = events
    assert event.action is Action.FIRE
    assert event.alertname == sc.ALERT_COMPENSATION_STARTED
    assert event.severity == "warning"
    assert event.labels == {
        "alertname": "SagaCompensationStarted",
        "severity": "warning",
        "saga": "refund",
        "run_id": RUN_ID,
        "service": "refund-agent",
        "step": "send_reply",
    }
    assert event.annotations["description"] == (
        "refund run 4f2a9c0e… unwinding after send_reply failed: SMTPError: mail down; "
        "2 compensations pending"
    )
    assert event.annotations["run_url"] == f"http://127.0.0.1:4320/runs/{RUN_ID}"
    assert event.annotations["runbook_url"] == (
        "https://github.com/saga-otel/saga-otel/blob/main/docs/operations.md"
        "#sagacompensationstarted"
    )
    # The delay is measured from the unwind itself, not from evaluation.
    assert event.at == 105.0
    assert event.dedup_key == dedup_key(sc.ALERT_COMPENSATION_STARTED, RUN_ID)
    card = json.loads(event.annotations["escalation_card"])
    assert card["will_undo"] == ["undo tag_ticket", "undo issue_credit"]
    assert card["done"] == ["issue_credit (compensable)", "tag_ticket (compensable)"]
    assert card["decide"][0].startswith("Nothing yet: the agent is undoing 2 steps by itself")
    assert "Will be undone" in event.annotations["escalation_card_text"]


def test_unwind_started_at_alone_fires_even_if_status_lags() -> None:
    events = evaluate(None, view(unwind_started_at=105.0), now=106.0)
    assert names(events, Action.FIRE) == [sc.ALERT_COMPENSATION_STARTED]


def test_compensation_started_resolves_when_compensated() -> None:
    unwinding = view(**UNWINDING)
    done = view(**{**UNWINDING, "status": "compensated", "ended_at": 107.0, "stack": []})
    events = evaluate(unwinding, done, now=107.5)
    assert [(e.action, e.alertname) for e in events] == [
        (Action.RESOLVE, sc.ALERT_COMPENSATION_STARTED)
    ]
    assert events[0].at == 107.0


def test_an_agent_clock_ahead_never_puts_an_alert_in_the_sidecars_future() -> None:
    """An agent whose clock runs an hour fast: its span times are in the sidecar's future.
    Alertmanager refuses a start past its now + resolve_timeout (the page was marked failed
    and lost), and an end in the future keeps a resolved alert firing: the events carry the
    sidecar's now, the agent's time in a note."""
    ahead = {**UNWINDING, "unwind_started_at": 3705.0, "updated_at": 3705.0}
    (fire,) = evaluate(view(), view(**ahead), now=105.2)
    assert fire.at == fire.starts_at == 105.2
    assert fire.annotations["agent_clock_ahead_by_s"] == "3599.800"
    note = fire.annotations["agent_clock_ahead"]
    assert "3599.8 s in the sidecar's future (1970-01-01T01:01:45Z)" in note
    assert fire.details["reported_at"] == 3705.0
    done = view(**{**ahead, "status": "compensated", "ended_at": 3707.0, "stack": []})
    (resolve,) = evaluate(view(**ahead), done, now=107.5)
    assert resolve.action is Action.RESOLVE and resolve.at == 107.5
    assert resolve.resolving_with(fire).starts_at == 105.2
    # Behind, or within the usual spread of synchronized clocks: the agent's times, no note.
    (fire,) = evaluate(view(), view(**{**UNWINDING, "unwind_started_at": 105.9}), now=105.2)
    assert fire.at == 105.2 and "agent_clock_ahead" not in fire.annotations
    (fire,) = evaluate(view(), view(**UNWINDING), now=105.2)
    assert fire.at == 105.0 and "reported_at" not in fire.details


@pytest.mark.parametrize("status", ["completed", "compensated", "recovered"])
def test_every_alert_clears_when_nothing_is_left_to_do(status: str) -> None:
    steps = [step(0, "issue_credit", tool="reverse_credit", failed=True)]
    messy = view(**{**UNWINDING, "steps": steps, "status": "compensation_failed"})
    assert set(open_alerts(messy)) == {
        sc.ALERT_COMPENSATION_STARTED,
        sc.ALERT_COMPENSATION_FAILED,
    }
    assert open_alerts(view(**{**UNWINDING, "steps": steps, "status": status})) == ()


def test_compensation_failed_fires_on_a_failed_step_before_the_run_ends() -> None:
    unwinding = view(**UNWINDING)
    steps = [
        step(0, "issue_credit", tool="reverse_credit", args={"credit_id": "cr_1"}, failed=True),
        step(1, "tag_ticket", tool="untag_ticket", compensated=True),
    ]
    events = evaluate(unwinding, view(**{**UNWINDING, "steps": steps}), now=106.0)
    assert names(events, Action.FIRE) == [sc.ALERT_COMPENSATION_FAILED]
    (event,) = events
    assert event.severity == "critical"
    assert "could not undo issue_credit" in event.annotations["description"]
    card = json.loads(event.annotations["escalation_card"])
    assert card["undone"] == ["undo tag_ticket"]
    assert card["not_undone"] == [
        'undo issue_credit: HTTPError: 500 (tool reverse_credit, args {"credit_id": "cr_1"})'
    ]
    assert card["decide"][0].startswith("Undo by hand or accept: undo issue_credit")


def test_compensation_failed_fires_on_the_run_status() -> None:
    events = evaluate(
        view(**UNWINDING), view(**{**UNWINDING, "status": "compensation_failed"}), now=1.0
    )
    assert names(events, Action.FIRE) == [sc.ALERT_COMPENSATION_FAILED]
    # Compensation did not finish, so the warning stays open beside the page.
    assert names(events, Action.RESOLVE) == []


def test_the_agents_escalation_card_is_used_when_present() -> None:
    card = {"saga": "refund", "run_id": RUN_ID, "reason": "compensation_failed", "done": ["x"]}
    after = view(
        **{
            **UNWINDING,
            "status": "compensation_failed",
            "escalation": {"reason": "compensation_failed", "card": card},
        }
    )
    (event,) = evaluate(view(**UNWINDING), after, now=1.0)
    assert json.loads(event.annotations["escalation_card"]) == card
    assert "  - x" in event.annotations["escalation_card_text"]


def test_stuck_fires_and_resolves_on_forward_recovery() -> None:
    stuck = view(
        status="stuck",
        failed_step="post_ledger",
        ended_at=110.0,
        updated_at=110.0,
        steps=[step(0, "send_email", "irreversible", pivot=True)],
        stack=[],
    )
    events = evaluate(view(), stuck, now=111.0)
    assert names(events, Action.FIRE) == [sc.ALERT_RUN_STUCK]
    assert events[0].labels["step"] == "post_ledger"
    assert events[0].at == 110.0
    assert "Finish forward" in json.loads(events[0].annotations["escalation_card"])["decide"][0]
    # A recovery process picks it up: the run is running again but still owes its end.
    reopened = {
        **stuck,
        "status": "running",
        "escalation": {"reason": "stuck", "card": {}},
    }
    stuck_esc = {**stuck, "escalation": {"reason": "stuck", "card": {}}}
    assert evaluate(stuck_esc, reopened, now=112.0) == []
    for end in ("completed", "recovered"):
        resolved = evaluate(reopened, {**reopened, "status": end}, now=113.0)
        assert [(e.action, e.alertname) for e in resolved] == [(Action.RESOLVE, sc.ALERT_RUN_STUCK)]


def test_stuck_escalation_arriving_before_the_run_span_is_described_from_its_card() -> None:
    card = {"failed_step": "close_ticket", "error": "CloseDown: ticket system said 503"}
    early = view(
        status="running",
        steps=[step(0, "send_reply", "irreversible", pivot=True)],
        escalation={"reason": "stuck", "card": card},
    )
    events = evaluate(view(), early, now=111.0)
    assert names(events, Action.FIRE) == [sc.ALERT_RUN_STUCK]
    assert events[0].labels["step"] == "close_ticket"
    description = events[0].annotations["description"]
    assert "close_ticket failed" in description and "CloseDown" in description


def test_orphaned_fires_with_the_stack_and_resolves_when_recovered() -> None:
    orphaned = view(status="orphaned")
    events = evaluate(view(), orphaned, now=200.0)
    assert names(events, Action.FIRE) == [sc.ALERT_RUN_ORPHANED]
    (event,) = events
    assert event.at == 200.0
    assert event.labels["step"] == "tag_ticket"  # where the agent went silent
    assert json.loads(event.annotations["stack"]) == orphaned["stack"]
    assert event.details["stack"] == orphaned["stack"]
    assert "went silent" in event.annotations["description"]
    resolved = evaluate(orphaned, view(status="recovered"), now=300.0)
    assert [(e.action, e.alertname) for e in resolved] == [(Action.RESOLVE, sc.ALERT_RUN_ORPHANED)]


@pytest.mark.parametrize("status", ["orphaned", "stuck"])
def test_the_cards_commands_quote_a_hostile_run_id_for_the_shell(status: str) -> None:
    """A run id may hold any printable character; the card's commands are pasted into a
    shell, so each quotes it: split as a shell would, the id is one word, unchanged."""
    hostile = "ord-1; touch pwned $(id) 'q'"
    bad = view(run_id=hostile, status=status, failed_step="post_ledger", ended_at=110.0)
    (event,) = evaluate(view(run_id=hostile), bad, now=200.0)
    lines = json.loads(event.annotations["escalation_card"])["decide"]
    commands = [part for line in lines for part in line.split("`")[1::2]]
    assert commands, lines
    for command in commands:
        words = shlex.split(command.replace("...", "x"))
        assert hostile in words, (command, words)
        assert "touch" not in words and "$(id)" not in words


def test_a_person_resolving_the_run_resolves_all_its_alerts() -> None:
    steps = [step(0, "issue_credit", tool="reverse_credit", failed=True)]
    bad = view(**{**UNWINDING, "status": "compensation_failed", "steps": steps})
    assert len(evaluate(None, bad, now=1.0)) == 2
    settled = {**bad, "resolution": {"note": "refunded by hand", "at": 500.0}}
    events = evaluate(bad, settled, now=501.0)
    assert sorted(names(events, Action.RESOLVE)) == sorted(
        [sc.ALERT_COMPENSATION_STARTED, sc.ALERT_COMPENSATION_FAILED]
    )
    assert all(e.at == 500.0 for e in events)
    assert "refunded by hand" in events[0].annotations["description"]
    # Who resolved it, when they said: in the description and the resolution annotation.
    for event in events:
        assert event.annotations["resolution"].endswith("resolved by a person: refunded by hand")
    named = {**bad, "resolution": {"note": "refunded by hand", "at": 500.0, "by": "alice"}}
    for event in evaluate(bad, named, now=501.0):
        for key in ("description", "resolution"):
            assert event.annotations[key].endswith(
                "resolved by a person (alice): refunded by hand"
            ), event.annotations[key]


def test_links_follow_the_configuration() -> None:
    config = RuleConfig(public_url="https://sidecar.example/", runbook_base="https://rb/ops.md")
    (event,) = evaluate(None, view(status="orphaned"), now=1.0, config=config)
    assert event.annotations["run_url"] == f"https://sidecar.example/runs/{RUN_ID}"
    assert event.annotations["runbook_url"] == "https://rb/ops.md#sagarunorphaned"


def test_resolve_stale_resolves_only_what_the_view_no_longer_holds() -> None:
    fired = [sc.ALERT_COMPENSATION_STARTED, sc.ALERT_RUN_ORPHANED]
    events = resolve_stale(fired, view(**UNWINDING), now=1.0)
    assert [(e.action, e.alertname) for e in events] == [(Action.RESOLVE, sc.ALERT_RUN_ORPHANED)]


def test_event_round_trips_through_json() -> None:
    (event,) = evaluate(None, view(**UNWINDING), now=1.0)
    assert AlertEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event


def test_unknown_alert_name_is_an_error_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="SagaRunOrphaned"):
        is_open("SagaSomething", view())


def test_render_card_tolerates_foreign_cards() -> None:
    assert "Done:" in render_card({"reason": "stuck"})


@given(card_objects)
@settings(max_examples=300, deadline=None)
def test_render_card_reads_any_card_object(card: dict[str, Any]) -> None:
    """An agent in any language writes the card (Go's nil slice is null): any value of
    any field renders."""
    assert "needs a person" in render_card(card)


@pytest.mark.parametrize(
    ("done", "shown"),
    [
        (None, "  (nothing)"),  # Go's nil slice
        (5, "  - 5"),
        ("issue_credit", "  - issue_credit"),  # not a line per letter
        ({"step": "issue_credit"}, '  - {"step": "issue_credit"}'),  # not its keys
    ],
)
def test_an_agents_card_of_any_shape_still_pages_compensation_failed(
    done: object, shown: str
) -> None:
    card = {"reason": "compensation_failed", "done": done, "decide": ["look"]}
    after = view(
        **{
            **UNWINDING,
            "status": "compensation_failed",
            "escalation": {"reason": "compensation_failed", "card": card},
        }
    )
    (event,) = evaluate(view(**UNWINDING), after, now=1.0)
    assert event.alertname == sc.ALERT_COMPENSATION_FAILED
    assert json.loads(event.annotations["escalation_card"]) == card
    text = event.annotations["escalation_card_text"]
    assert f"Done:\n{shown}\nUndone:" in text
    assert "  - look" in text


@given(agent_cards)
@settings(max_examples=300, deadline=None)
def test_any_agent_card_pages_compensation_failed(card: object) -> None:
    after = view(
        **{
            **UNWINDING,
            "status": "compensation_failed",
            "escalation": {"reason": "compensation_failed", "card": card},
        }
    )
    events = evaluate(view(**UNWINDING), after, now=1.0)
    assert names(events, Action.FIRE) == [sc.ALERT_COMPENSATION_FAILED]
    assert "needs a person" in events[0].annotations["escalation_card_text"]


# --- properties --------------------------------------------------------------------------

STATUSES = [
    "running",
    "unwinding",
    "completed",
    "compensated",
    "compensation_failed",
    "stuck",
    "rejected",
    "orphaned",
    "recovered",
]


@st.composite
def views(draw: st.DrawFn) -> dict[str, Any]:
    status = draw(st.sampled_from(STATUSES))
    failed_flags = draw(st.lists(st.booleans(), min_size=0, max_size=3))
    steps = [
        step(i, f"s{i}", tool=f"undo{i}", failed=f, compensated=not f and draw(st.booleans()))
        for i, f in enumerate(failed_flags)
    ]
    escalation = draw(
        st.one_of(
            st.none(),
            st.sampled_from(["stuck", "compensation_failed", "other"]).map(
                lambda r: {"reason": r, "card": {}}
            ),
        )
    )
    resolution = draw(
        st.one_of(st.none(), st.just({"note": "by hand", "at": 9.0})),
    )
    return view(
        status=status,
        steps=steps,
        unwind_started_at=draw(st.one_of(st.none(), st.just(5.0))),
        failed_step=draw(st.one_of(st.none(), st.just("s0"))),
        escalation=escalation,
        resolution=resolution,
        updated_at=draw(st.floats(min_value=0, max_value=1e9, allow_nan=False)),
    )


def replay(sequence: list[dict[str, Any]]) -> list[AlertEvent]:
    events: list[AlertEvent] = []
    before: dict[str, Any] | None = None
    for i, after in enumerate(sequence):
        events += evaluate(before, after, now=float(i))
        before = after
    return events


@settings(max_examples=100, deadline=None)
@given(st.lists(views(), min_size=1, max_size=8))
def test_fire_and_resolve_alternate_per_alert(sequence: list[dict[str, Any]]) -> None:
    events = replay(sequence)
    for name in ALERT_NAMES:
        actions = [e.action for e in events if e.alertname == name]
        assert actions == [Action.FIRE, Action.RESOLVE] * (len(actions) // 2) + (
            [Action.FIRE] if len(actions) % 2 else []
        )
        assert len({e.dedup_key for e in events if e.alertname == name}) <= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(views(), min_size=1, max_size=8))
def test_history_agrees_with_a_fresh_evaluation_of_the_last_view(
    sequence: list[dict[str, Any]],
) -> None:
    # What a restart sees (only the last stored view) matches what was paged.
    events = replay(sequence)
    still_firing = {
        name
        for name in ALERT_NAMES
        if sum(1 if e.action is Action.FIRE else -1 for e in events if e.alertname == name)
    }
    assert still_firing == set(open_alerts(sequence[-1]))
    fresh = evaluate(None, sequence[-1], now=99.0, replay=True)
    assert {e.alertname for e in fresh} == still_firing


@settings(max_examples=100, deadline=None)
@given(
    st.lists(views(), min_size=0, max_size=6),
    st.sampled_from(["compensated", "recovered", "completed"]),
    st.booleans(),
)
def test_every_fired_alert_is_resolved_when_the_run_ends_clean_or_is_resolved(
    sequence: list[dict[str, Any]], end: str, by_person: bool
) -> None:
    last = (
        view(status="compensation_failed", resolution={"note": "ok", "at": 1.0})
        if by_person
        else view(status=end)
    )
    events = replay([*sequence, last])
    fired = [e.alertname for e in events if e.action is Action.FIRE]
    resolved = [e.alertname for e in events if e.action is Action.RESOLVE]
    assert sorted(fired) == sorted(resolved)


@settings(max_examples=80, deadline=None)
@given(views(), views())
def test_rules_are_pure(before: dict[str, Any], after: dict[str, Any]) -> None:
    snapshot = copy.deepcopy((before, after))
    first = evaluate(before, after, now=3.0)
    assert evaluate(before, after, now=3.0) == first
    assert (before, after) == snapshot
    assert evaluate(after, after, now=4.0) == []


# --- an unwind first seen with the run's end (a batching exporter) ------------------------

COMPENSATED = {
    **UNWINDING,
    "status": "compensated",
    "ended_at": 106.0,
    "updated_at": 106.0,
    "stack": [],
}


@pytest.mark.parametrize("before", [None, view()], ids=["new-run", "forward-steps-seen"])
def test_an_unwind_seen_with_its_end_fires_late_then_resolves(before: Any) -> None:
    events = evaluate(before, view(**COMPENSATED), now=112.5)
    assert [(e.alertname, e.action) for e in events] == [
        (sc.ALERT_COMPENSATION_STARTED, Action.FIRE),
        (sc.ALERT_COMPENSATION_STARTED, Action.RESOLVE),
    ]
    fire, resolve = events
    assert fire.at == 105.0 and resolve.at == 106.0  # the page history keeps span times
    for event in events:
        assert event.annotations["late_by_s"] == "7.500"
        assert "arrived batched, 7.5 s after the unwind began" in event.annotations["late"]
        assert "SimpleSpanProcessor" in event.annotations["late"]
        assert event.annotations["late"] in event.annotations["description"]
        assert event.details["late_by_s"] == 7.5
    assert "arrived batched" in resolve.annotations["resolution"]


def test_late_compensation_alerts_can_be_turned_off() -> None:
    off = RuleConfig(late_compensation=False)
    assert evaluate(None, view(**COMPENSATED), now=112.5, config=off) == []


def test_no_late_alert_on_replay_nor_for_an_unwind_seen_in_time() -> None:
    # A restart re-reads views it already judged: no second late page.
    assert evaluate(None, view(**COMPENSATED), now=200.0, replay=True) == []
    seen = view(**UNWINDING)
    events = evaluate(seen, view(**COMPENSATED), now=106.1)
    assert [(e.alertname, e.action) for e in events] == [
        (sc.ALERT_COMPENSATION_STARTED, Action.RESOLVE)
    ]
    assert "late" not in events[0].annotations
    # A run a person resolved is not a batched arrival: nothing late.
    resolved = view(**UNWINDING, resolution={"note": "by hand", "at": 107.0})
    assert evaluate(None, resolved, now=110.0) == []
