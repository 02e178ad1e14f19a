"""Secret arguments never leave the machine in any alert payload; stored views keep them."""

from __future__ import annotations

import copy
import io
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar._alerting import evaluate
from sidecar._errors import ConfigError
from sidecar._redact import MASK, Redactor
from sidecar._sinks import AlertmanagerSink, LogSink, PagerDutySink, WebhookSink

CARD = "4111111111111111"
TOKEN = "tok-abcdef-123456"
NESTED = "nested-secret-value"


def secret_view() -> dict[str, Any]:
    args = {
        "credit_id": "cr_1",
        "card_number": CARD,
        "auth": {"api_token": TOKEN, "inner": {"password": NESTED}},
    }
    return {
        "run_id": "r1",
        "saga": "refund",
        "service": "refund-agent",
        "instance": "i1",
        "status": "compensation_failed",
        "started_at": 1.0,
        "updated_at": 2.0,
        "ended_at": 3.0,
        "failed_step": "send_reply",
        # The failure text quotes the card number too.
        "unwind_reason": f"CardError: card {CARD} declined",
        "unwind_started_at": 2.0,
        "steps": [
            {
                "index": 0,
                "name": "charge",
                "class": "compensable",
                "pivot": False,
                "ok": True,
                "attempts": [],
                "compensation": {
                    "step": "charge",
                    "index": 0,
                    "tool": "refund",
                    "args": args,
                    "description": "refund the charge",
                },
                "compensations": [{"attempt": 1, "ok": False, "error": "HTTPError: 500"}],
                "compensated": False,
                "compensation_failed": True,
            }
        ],
        "stack": [
            {
                "step": "charge",
                "index": 0,
                "tool": "refund",
                "args": args,
                "description": "refund the charge",
            }
        ],
        "escalation": None,
        "resolution": None,
    }


REDACTOR = Redactor.build(keys=["card_number"], patterns=[r"(?i)token|password"])


def assert_clean(payload: Any) -> None:
    text = json.dumps(payload)
    for secret in (CARD, TOKEN, NESTED):
        assert secret not in text
    assert MASK in text
    assert "cr_1" in text  # other arguments stay readable


def test_keys_and_patterns_are_masked_recursively_in_args_only() -> None:
    data = {
        "routing_key": "keep-me",
        "args": {"card_number": CARD, "x": [{"my_token": TOKEN}], "keep": 1},
        "deep": {"args": {"auth": {"password": NESTED}}},
    }
    out = REDACTOR.redact(data)
    assert out == {
        "routing_key": "keep-me",
        "args": {"card_number": MASK, "x": [{"my_token": MASK}], "keep": 1},
        "deep": {"args": {"auth": {"password": MASK}}},
    }


def test_json_text_and_quoting_text_are_masked() -> None:
    data = {
        "stack": json.dumps([{"args": {"card_number": CARD}}]),
        "line": f"refund failed (args {{'card_number': '{CARD}'}})",
    }
    out = REDACTOR.redact(data)
    assert json.loads(out["stack"]) == [{"args": {"card_number": MASK}}]
    assert CARD not in out["line"]


def test_redaction_never_touches_the_input() -> None:
    view = secret_view()
    snapshot = copy.deepcopy(view)
    events = evaluate(None, view, now=5.0)
    for event in events:
        WebhookSink("http://127.0.0.1:1/", redactor=REDACTOR).payload(event)
        # The event itself (what the outbox stores) keeps real values for recovery.
        assert CARD in json.dumps(event.details)
    assert view == snapshot


def test_without_configuration_nothing_is_masked() -> None:
    data = {"args": {"card_number": CARD}}
    assert Redactor().redact(data) == data


def test_a_bad_pattern_names_itself_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"'\(unclosed'.*regular expression"):
        Redactor.build(patterns=["(unclosed"])


@pytest.mark.parametrize("sink_kind", ["alertmanager", "pagerduty", "webhook", "log"])
async def test_every_outgoing_payload_is_redacted(sink_kind: str) -> None:
    events = evaluate(None, secret_view(), now=5.0)
    assert events  # started + failed
    for event in events:
        if sink_kind == "alertmanager":
            assert_clean(AlertmanagerSink("http://am", redactor=REDACTOR).payload(event))
        elif sink_kind == "pagerduty":
            payload = PagerDutySink("rk-123", redactor=REDACTOR).payload(event)
            assert_clean(payload)
            assert payload["routing_key"] == "rk-123"
            assert payload["dedup_key"] == event.dedup_key
        elif sink_kind == "webhook":
            assert_clean(WebhookSink("http://hook", redactor=REDACTOR).payload(event))
        else:
            stream = io.StringIO()
            await LogSink(redactor=REDACTOR, stream=stream).send(event)
            line = json.loads(stream.getvalue())
            assert line["event"] == "saga.alert"
            assert_clean(line)


# Secrets and the rest are drawn apart: a secret is 4+ of "XYZ0-9", keys and other text
# are lower case, so a secret can only be in the output if redaction missed it.
_secret = st.text(alphabet="XYZ0123456789", min_size=4, max_size=8)
_key = st.sampled_from(["args", "note", "credit_id", "stack"])
_plain = st.none() | st.integers(0, 99) | st.text(alphabet="abc {}[]", max_size=6)


@st.composite
def _documents(draw: st.DrawFn) -> tuple[Any, set[str]]:
    """A nested document with secrets under secret keys inside args (some as JSON text),
    the same secrets quoted in free text elsewhere; and the secrets."""
    secrets: set[str] = set()

    def args_value() -> Any:
        out: dict[str, Any] = {}
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.booleans()):
                out[draw(st.sampled_from(["password", "api_token"]))] = draw(_secret)
            else:
                out[draw(_key)] = draw(_plain | st.builds(dict))
        secrets.update(v for k, v in out.items() if k in ("password", "api_token"))
        return json.dumps(out) if draw(st.booleans()) else out

    def node(depth: int) -> Any:
        choice = draw(st.integers(0, 3 if depth < 3 else 1))
        if choice == 0:
            return draw(_plain)
        if choice == 1:
            quoted = sorted(secrets)[:1]
            return "text quoting " + (quoted[0] if quoted else "nothing")
        if choice == 2:
            return [node(depth + 1) for _ in range(draw(st.integers(0, 3)))]
        doc = {"args": args_value()}
        # Distinct keys, args written once: no drawn secret is overwritten unseen.
        others = st.lists(st.sampled_from(["note", "credit_id", "stack"]), unique=True, max_size=2)
        doc.update({key: node(depth + 1) for key in draw(others)})
        return doc

    return node(0), secrets


@given(_documents())
def test_no_secret_under_args_is_left_anywhere_in_the_masked_copy(
    doc: tuple[Any, set[str]],
) -> None:
    value, secrets = doc
    redactor = Redactor.build(["password"], ["(?i)token"])
    original = copy.deepcopy(value)
    found = redactor.secrets_in(value)
    assert secrets <= found
    text = json.dumps(redactor.redact(value))
    assert not [s for s in secrets if s in text]
    assert value == original  # the stored view keeps the real values
