"""The rich run diagram, checked as text."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from rich.console import Console
from sidecar_testkit import agent_cards, compensated_run, compensation_failed_run, stuck_run

from sidecar import RunState, render_run
from sidecar._otlp import extract
from sidecar._render import printable


def view_of(script: Any) -> dict[str, Any]:
    state = RunState()
    state.apply(extract(encode_spans(script.spans())).spans, 1_700_000_100.0)
    view = state.view(script.run_id)
    assert view is not None
    return view


def text(view: dict[str, Any]) -> str:
    console = Console(record=True, width=100)
    console.print(render_run(view))
    return console.export_text()


def test_compensated_run() -> None:
    out = text(view_of(compensated_run()))
    assert "COMPENSATED" in out
    assert "FORWARD" in out and "COMPENSATION STACK" in out
    assert "#1 issue_credit (compensable)" in out
    assert "UNWIND (reverse order)" in out
    unwind = out.split("UNWIND (reverse order)")[1]
    assert unwind.index("#2 update_ticket") < unwind.index("#1 issue_credit")
    assert "✓ #2 update_ticket" in unwind and "✓ #1 issue_credit" in unwind
    assert "(empty: nothing left to undo)" in out
    assert "failed step: notify_billing" in out
    assert "PIVOT" not in out


def test_compensation_failed_run() -> None:
    out = text(view_of(compensation_failed_run()))
    assert "COMPENSATION_FAILED" in out
    assert "✓ #2 update_ticket" in out
    assert "✗ #1 issue_credit" in out
    assert "last error: HTTPError: 500 from billing" in out
    # Each undo's attempts, counted in words, its call on the next line.
    unwind = out.split("UNWIND (reverse order)")[1].split("LEFT ON THE STACK")[0]
    assert "✓ #2 update_ticket  1 attempt\n" in unwind
    assert "✗ #1 issue_credit  2 attempts\n    reverse_credit(" in unwind
    assert "(s)" not in out
    left = out.split("LEFT ON THE STACK")[1]
    assert 'reverse_credit(credit_id="cr_1")' in left
    assert "ESCALATED: compensation_failed" in out


def test_stuck_run() -> None:
    out = text(view_of(stuck_run()))
    assert "STUCK" in out
    assert "PIVOT: send_reply (#1)" in out and "no undo past this line" in out
    assert out.index("#1 send_reply") < out.index("PIVOT") < out.index("#2 close_ticket")
    assert "UNWIND" not in out
    assert "#0 issue_credit" in out.split("LEFT ON THE STACK")[1]
    assert "(cannot be undone)" in out


FAILED_VIEW = view_of(compensation_failed_run())


@given(agent_cards)
@settings(max_examples=200, deadline=None)
def test_any_agent_card_is_drawn(card: object) -> None:
    """`runs show` draws the card an agent in any language wrote (Go's nil slice is
    null, a number where a list was meant): never a TypeError instead of the run."""
    out = text({**FAILED_VIEW, "escalation": {"reason": "compensation_failed", "card": card}})
    assert "ESCALATED: compensation_failed" in out and "#1 issue_credit" in out


def test_a_card_whose_lists_are_null_or_a_number_is_drawn() -> None:
    for done, shown in ((None, "Done:\n  (nothing)"), (5, "Done:\n  - 5")):
        card = {"reason": "compensation_failed", "done": done, "decide": ["look"]}
        out = text({**FAILED_VIEW, "escalation": {"reason": "compensation_failed", "card": card}})
        assert shown in out and "You must decide:\n  - look" in out


def test_section_rules_are_as_wide_as_the_step_table_on_a_wide_console() -> None:
    """Piped, `runs show` prints 200 columns wide (no id cut): the rules stop where the
    drawing does instead of running to the console's edge."""
    console = Console(record=True, width=200)
    console.print(render_run(view_of(compensation_failed_run())))
    lines = console.export_text().splitlines()
    table = len(next(line for line in lines if line.startswith("┏")))
    rules = [line for line in lines if line.startswith(("UNWIND", "LEFT ON THE STACK"))]
    assert len(rules) == 2 and table < 120
    assert all(len(line.rstrip()) == table for line in rules), (table, rules)


def test_printable_escapes_what_steers_a_terminal_and_keeps_the_rest() -> None:
    kept = "refund: crédit №7 ✓ 退款 [bold]\tnext\nline \\x1b"
    assert printable(kept) == kept
    assert printable("\x00\x1b[2J\r\x7f\x85\x9b") == "\\x00\\x1b[2J\\x0d\\x7f\\x85\\x9b"
    bidi = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    assert printable(bidi) == "".join(f"\\u{ord(c):04x}" for c in bidi)
