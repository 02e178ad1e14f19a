"""Records: compensations, retry policies, step classes, escalation cards."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saga_otel import (
    Compensation,
    ConfigurationError,
    EscalationCard,
    RetryPolicy,
    StepClass,
)


def test_compensation_records_round_trip_through_json() -> None:
    comp = Compensation("reverse_credit", {"credit_id": "cr_1", "n": [1, 2]}, "undo", "issue", 3)
    assert Compensation.from_json(comp.to_json()) == comp
    assert json.loads(comp.to_json())["index"] == 3
    with pytest.raises(ConfigurationError, match="JSON-serialisable"):
        Compensation("t", {"x": object()})
    with pytest.raises(ConfigurationError, match="not a compensation record"):
        Compensation.from_dict({"args": {}})


def test_compensation_args_are_frozen_at_capture_time() -> None:
    refs = {"credit_id": "cr_1"}
    comp = Compensation("reverse_credit", refs)
    refs["credit_id"] = "cr_2"
    assert comp.args == {"credit_id": "cr_1"}


def test_retry_policy_rejects_nonsense() -> None:
    with pytest.raises(ConfigurationError, match="attempts=0"):
        RetryPolicy(attempts=0)
    p = RetryPolicy(initial=1, multiplier=3, maximum=5, jitter=0)
    assert [p.delay(n) for n in (1, 2, 3)] == [1, 3, 5]


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("initial", NAN),
        ("initial", INF),
        ("initial", 1e10),
        ("maximum", NAN),
        ("maximum", INF),
        ("maximum", 86_400.5),
        ("jitter", NAN),
        ("jitter", 1e10),
        ("multiplier", NAN),
        ("multiplier", INF),
        ("attempts", NAN),
        ("attempts", INF),
        ("attempts", 2.5),
    ],
)
def test_retry_policy_refuses_what_no_sleep_could_wait(field: str, value: float) -> None:
    """NaN, infinite and huge delays used to be accepted, and the backoff's sleep then
    raised (ValueError, OverflowError) in place of the tool's own error."""
    with pytest.raises(ConfigurationError) as info:
        RetryPolicy(**{field: value})  # type: ignore[arg-type]
    text = str(info.value)
    assert f"{field}={value!r}" in text and ": use " in text, text


def test_retry_policy_at_its_bounds_waits_at_most_its_maximum_plus_jitter() -> None:
    day = 86_400.0
    longest = RetryPolicy(attempts=100, initial=day, maximum=day, jitter=day)
    assert all(day <= longest.delay(n) <= 2 * day for n in (1, 2, 99))
    # A multiplier so large its power overflows a float reaches the cap, not OverflowError.
    steep = RetryPolicy(attempts=100, initial=1.0, multiplier=1e10, maximum=60.0, jitter=0)
    assert [steep.delay(n) for n in (1, 2, 99)] == [1.0, 60.0, 60.0]
    assert RetryPolicy(initial=0, multiplier=1e10, jitter=0).delay(99) == 0.0


def test_step_classes_are_the_five_of_the_contract() -> None:
    assert [c.value for c in StepClass] == [
        "read",
        "convergent",
        "reversible",
        "compensable",
        "irreversible",
    ]
    assert [c.pushes for c in StepClass] == [False, False, True, True, False]


_LIST_FIELDS = ("done", "undone", "not_undone", "irreversible", "decide")


def test_escalation_card_round_trips_and_renders_every_section() -> None:
    card = EscalationCard(
        saga="refund",
        run_id="r1",
        reason="compensation_failed",
        failed_step="send_reply",
        error="ServiceDown: mail",
        done=("issue_credit (compensable)",),
        undone=("set ticket back",),
        not_undone=("reverse credit cr_1: LedgerDown",),
        irreversible=(),
        decide=("Undo by hand or accept: reverse credit cr_1",),
    )
    assert EscalationCard.from_dict(json.loads(card.to_json())) == card
    text = card.render()
    for part in ("needs a person", "Done:", "Undone:", "Could NOT be undone:", "You must decide:"):
        assert part in text


# Any value a card's JSON text may hold, NaN and Infinity too (Python's parser, the
# sidecar's, reads them).
_any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
_CARD_KEYS = ("saga", "run_id", "reason", "failed_step", "error", *_LIST_FIELDS)
_cards = st.fixed_dictionaries(
    {}, optional={key: _any_json for key in _CARD_KEYS}
) | st.dictionaries(st.sampled_from(_CARD_KEYS) | st.text(), _any_json, max_size=8)


@given(_any_json | _cards)
@settings(max_examples=400, deadline=None)
def test_a_card_is_read_from_any_json_value(data: object) -> None:
    """Agents in any language write cards (Go's nil slice is null): reading one never
    raises, and gives text and tuples of text that render."""
    card = EscalationCard.from_dict(data)
    for name in ("saga", "run_id", "reason"):
        assert isinstance(getattr(card, name), str)
    for name in ("failed_step", "error"):
        assert getattr(card, name) is None or isinstance(getattr(card, name), str)
    for name in _LIST_FIELDS:
        lines = getattr(card, name)
        assert isinstance(lines, tuple) and all(isinstance(line, str) for line in lines)
    assert "needs a person" in card.render()
    assert EscalationCard.from_dict(json.loads(json.dumps(card.to_dict()))) == card


@pytest.mark.parametrize(
    ("value", "lines"),
    [
        (None, ()),
        (5, ("5",)),
        (2.5, ("2.5",)),
        (True, ("true",)),
        ("issue_credit (compensable)", ("issue_credit (compensable)",)),  # not its letters
        ({"step": "x"}, ('{"step": "x"}',)),  # not its keys
        (["a", 1, None, ["b"], {"c": "é"}], ("a", "1", "null", '["b"]', '{"c": "é"}')),
    ],
)
def test_a_list_field_takes_a_list_null_or_one_value(value: object, lines: tuple[str, ...]) -> None:
    for name in _LIST_FIELDS:
        assert getattr(EscalationCard.from_dict({name: value}), name) == lines


def test_a_text_field_takes_any_value_as_its_text() -> None:
    card = EscalationCard.from_dict(
        {"saga": 7, "run_id": None, "reason": ["stuck"], "failed_step": {"n": 1}, "error": None}
    )
    assert (card.saga, card.run_id, card.reason) == ("7", "", '["stuck"]')
    assert (card.failed_step, card.error) == ('{"n": 1}', None)
    assert EscalationCard.from_dict({"failed_step": 0, "error": False}).failed_step == "0"


@pytest.mark.parametrize("data", [None, 5, "a card", ["done"], []])
def test_a_card_that_is_not_an_object_holds_no_field(data: object) -> None:
    empty = EscalationCard("", "", "", None, None, (), (), (), (), ())
    assert EscalationCard.from_dict(data) == empty


def test_a_python_value_json_cannot_hold_is_still_read() -> None:
    """from_dict is public: a caller's dict may hold what JSON cannot encode."""
    cyclic: list[object] = []
    cyclic.append(cyclic)
    card = EscalationCard.from_dict({"done": [object(), {1: "a", "b": 2}], "error": cyclic})
    assert card.done[0].startswith('"<object object at') and card.done[1] == '{"1": "a", "b": 2}'
    assert card.error == "<list that is not JSON>"


def test_backoff_seconds_grows_caps_and_spreads() -> None:
    import random

    from saga_otel.records import backoff_seconds

    plain = [backoff_seconds(n, initial=0.5, maximum=3.0) for n in (1, 2, 3, 4, 500)]
    assert plain == [0.5, 1.0, 2.0, 3.0, 3.0]  # a long outage neither overflows nor exceeds the cap
    rng = random.Random(7)
    spread = [
        backoff_seconds(3, initial=0.5, maximum=3.0, jitter=0.2, jitter_ratio=0.5, rng=rng)
        for _ in range(200)
    ]
    assert all(2.0 <= d <= 2.0 + 0.2 + 1.0 for d in spread)
    assert max(spread) - min(spread) > 0.5  # the spread is really random, not a constant offset


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(st.text(), _json_values, max_size=6))
@settings(max_examples=200, deadline=None)
def test_compensation_json_is_one_encode_of_json_dumps(args: dict[str, object]) -> None:
    comp = Compensation("undo", args)
    assert comp.args_json() == json.dumps(args, sort_keys=True)  # the span attribute
    assert comp.args == json.loads(json.dumps(args))  # the frozen copy
    assert comp.args is not args


def test_compensation_refuses_what_json_cannot_hold() -> None:
    cyclic: dict[str, object] = {}
    cyclic["self"] = cyclic
    for bad in ({"x": object()}, cyclic, {"x": {1, 2}}):
        with pytest.raises(ConfigurationError, match="must be JSON-serialisable"):
            Compensation("undo", bad)
    assert Compensation("undo", {1: "a", "b": 2}).args == {"1": "a", "b": 2}


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_compensation_refuses_numbers_json_has_no_form_for(number: float) -> None:
    # Python's json would write NaN/Infinity; no sink that parses an alert would read it.
    for args in ({"amount": number}, {"nested": [1, {"x": number}]}, {1: number}):
        with pytest.raises(ConfigurationError, match="no NaN or Infinity") as info:
            Compensation("undo", args)
        assert "not JSON compliant" in str(info.value)  # the encoder's own words: which value
