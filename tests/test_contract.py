"""One span-contract validator (saga_otel.contract), used by the sidecar's intake and by
saga_otel.testing: both give the same answer on the same real spans. (That every span
saga-otel emits keeps the complete contract is tests/saga_otel/test_telemetry.py's.)"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from saga_otel import semconv as sc
from saga_otel.contract import MISSING, Problem, check
from saga_otel.testing import contract_violations
from sidecar._otlp import extract, parse_protobuf

RUN_ID = "0123456789abcdef0123456789abcdef"


def do_attrs(**over: Any) -> dict[str, Any]:
    """A do span's attributes exactly as saga-otel emits them, with changes."""
    attrs: dict[str, Any] = {
        sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
        sc.SAGA_PHASE: sc.PHASE_DO,
        sc.SAGA_RUN_ID: RUN_ID,
        sc.SAGA_NAME: "refund",
        sc.SAGA_STEP_NAME: "issue_credit",
        sc.SAGA_STEP_INDEX: 0,
        sc.SAGA_STEP_CLASS: "compensable",
        sc.SAGA_STEP_ATTEMPT: 1,
        sc.SAGA_STEP_PIVOT: False,
    }
    attrs.update(over)
    return {k: v for k, v in attrs.items() if v is not None}


def real_span(attrs: dict[str, Any], name: str = "saga.do issue_credit") -> ReadableSpan:
    """An SDK span (the real type testing.contract_violations reads) with these attributes."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({sc.SERVICE_INSTANCE_ID: "i1"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("test").start_span(name, attributes=attrs).end()
    (span,) = exporter.get_finished_spans()
    return span


def intake(span: ReadableSpan) -> tuple[int, str]:
    """What the sidecar's intake does with the span, over real OTLP protobuf bytes."""
    body = encode_spans([span]).SerializeToString()
    decoded = extract(parse_protobuf(body), body)
    return decoded.rejected, decoded.error_message


def test_a_missing_step_class_is_accepted_by_intake_and_by_the_testing_helper() -> None:
    span = real_span(do_attrs(**{sc.SAGA_STEP_CLASS: None}))
    assert sc.SAGA_STEP_CLASS not in (span.attributes or {})
    assert check(dict(span.attributes or {})) == []
    assert check(dict(span.attributes or {}), span.name, complete=True) == []
    assert contract_violations([span]) == []
    assert intake(span) == (0, "")


def test_an_unknown_step_class_is_refused_by_both_naming_value_and_fix() -> None:
    span = real_span(do_attrs(**{sc.SAGA_STEP_CLASS: "magic"}))
    (problem,) = check(dict(span.attributes or {}))
    assert problem.attribute == sc.SAGA_STEP_CLASS and problem.value == "magic"
    assert "irreversible" in problem.fix  # the fix lists the classes
    violations = contract_violations([span])
    assert violations == [f"span {span.name!r}: {problem}"]
    rejected, message = intake(span)
    assert rejected == 1 and str(problem) in message


@pytest.mark.parametrize(
    ("over", "attribute", "value"),
    [
        ({sc.SAGA_RUN_ID: None}, sc.SAGA_RUN_ID, MISSING),
        ({sc.SAGA_STEP_INDEX: -1}, sc.SAGA_STEP_INDEX, -1),
        ({sc.SAGA_STEP_INDEX: "0"}, sc.SAGA_STEP_INDEX, "0"),
        ({sc.SAGA_STEP_ATTEMPT: 0}, sc.SAGA_STEP_ATTEMPT, 0),
        ({sc.SAGA_STEP_PIVOT: "yes"}, sc.SAGA_STEP_PIVOT, "yes"),
        ({sc.SAGA_COMPENSATION_ARGS: "[1]"}, sc.SAGA_COMPENSATION_ARGS, "[1]"),
        # Python's json reads these; RFC 8259 JSON (and every sink) does not.
        ({sc.SAGA_COMPENSATION_ARGS: '{"x": NaN}'}, sc.SAGA_COMPENSATION_ARGS, '{"x": NaN}'),
        (
            {sc.SAGA_COMPENSATION_ARGS: '{"a": [1, -Infinity]}'},
            sc.SAGA_COMPENSATION_ARGS,
            '{"a": [1, -Infinity]}',
        ),
        ({sc.SAGA_PHASE: "dance"}, sc.SAGA_PHASE, "dance"),
        # An int, as every other int attribute: True == 1 in Python, "1" is text.
        ({sc.SAGA_CONTRACT_VERSION: True}, sc.SAGA_CONTRACT_VERSION, True),
        ({sc.SAGA_CONTRACT_VERSION: "1"}, sc.SAGA_CONTRACT_VERSION, "1"),
    ],
)
def test_intake_and_testing_refuse_the_same_spans(
    over: dict[str, Any], attribute: str, value: Any
) -> None:
    span = real_span(do_attrs(**over))
    problems = check(dict(span.attributes or {}))
    assert [(p.attribute, p.value) for p in problems][:1] == [(attribute, value)]
    assert problems[0].fix  # says what to do
    rejected, message = intake(span)
    assert rejected == 1 and str(problems[0]) in message
    assert f"span {span.name!r}: {problems[0]}" in contract_violations([span])


def test_complete_adds_what_saga_otel_always_emits() -> None:
    attrs = do_attrs(**{sc.SAGA_CONTRACT_VERSION: None, sc.SAGA_STEP_PIVOT: None})
    assert check(attrs) == []  # the sidecar takes it: it can fold it
    got = {(p.attribute, p.value) for p in check(attrs, "saga.do other", complete=True)}
    assert got == {
        (sc.SAGA_CONTRACT_VERSION, MISSING),
        (sc.SAGA_STEP_PIVOT, MISSING),
        ("span name", "saga.do other"),
    }


def test_a_problem_reads_as_attribute_value_and_fix() -> None:
    problem = Problem(sc.SAGA_STEP_ATTEMPT, 0, "counts from 1")
    assert str(problem) == "saga.step.attempt=0: counts from 1"
    assert str(Problem(sc.SAGA_RUN_ID, MISSING, "add it")) == "saga.run.id=<missing>: add it"


@pytest.mark.parametrize(
    "bad", ["..", ".", "a\nb", "run\x07id", "bidi\u202e", "x" * (sc.RUN_ID_MAX_CHARS + 1)]
)
def test_a_run_id_the_sidecar_refuses_is_a_violation_with_the_rule_s_words(bad: str) -> None:
    span = real_span(do_attrs(**{sc.SAGA_RUN_ID: bad}))
    rule = sc.run_id_problem(bad)
    assert rule is not None
    assert check(dict(span.attributes or {})) == [Problem(sc.SAGA_RUN_ID, bad, rule)]
    assert contract_violations([span]) == [
        f"span {span.name!r}: {Problem(sc.SAGA_RUN_ID, bad, rule)}"
    ]
    # Decoding lets it through: the intake's screening refuses it next, as bad_run_id, with
    # the same words (tests/sidecar/test_ownership.py).
    assert intake(span) == (0, "")
    assert check(dict(span.attributes or {}), run_id_rule=False) == []


def test_the_longest_printable_run_id_is_kept() -> None:
    span = real_span(do_attrs(**{sc.SAGA_RUN_ID: "日" * sc.RUN_ID_MAX_CHARS}))
    assert contract_violations([span]) == []


def _heartbeat(**over: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        sc.SAGA_PHASE: sc.PHASE_HEARTBEAT,
        sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
        sc.SAGA_HEARTBEAT_OPEN_RUNS: ["run-1"],
        sc.SAGA_HEARTBEAT_INTERVAL_S: 1.0,
    }
    attrs.update(over)
    return attrs


@pytest.mark.parametrize(
    ("over", "attribute", "value"),
    [
        ({sc.SAGA_HEARTBEAT_BEAT: -1}, sc.SAGA_HEARTBEAT_BEAT, -1),
        ({sc.SAGA_HEARTBEAT_BEAT: "7"}, sc.SAGA_HEARTBEAT_BEAT, "7"),
        ({sc.SAGA_HEARTBEAT_PARTS: 0}, sc.SAGA_HEARTBEAT_PARTS, 0),
        ({sc.SAGA_HEARTBEAT_PARTS: True}, sc.SAGA_HEARTBEAT_PARTS, True),
    ],
)
def test_a_heartbeat_part_needs_an_int_beat_and_a_positive_count_of_parts(
    over: dict[str, Any], attribute: str, value: Any
) -> None:
    span = real_span(_heartbeat(**over), sc.HEARTBEAT_SPAN_NAME)
    (problem,) = check(dict(span.attributes or {}))
    assert (problem.attribute, problem.value) == (attribute, value) and problem.fix
    rejected, message = intake(span)
    assert rejected == 1 and str(problem) in message
