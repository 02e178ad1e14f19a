"""The intake shortcuts give what the plain ways give: lean decoding, facts-only listeners."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sidecar_testkit import (
    CREDIT,
    TICKET,
    FakeClock,
    RunScript,
    compensated_run,
    compensation_failed_run,
    completed_run,
    export_http,
    heartbeat_spans,
    open_run,
    settings_for,
    stuck_run,
)

from saga_otel import semconv as sc
from sidecar import Sidecar, _otlp
from sidecar._alerting import evaluate
from sidecar._otlp import Decoded, _extract_exact, extract
from sidecar._state import RunState

SCRIPTS = (completed_run, compensated_run, compensation_failed_run, stuck_run, open_run)


def _same(fast: Decoded, exact: Decoded) -> None:
    assert fast.spans == exact.spans
    assert (fast.total, fast.ignored, fast.rejected, fast.errors) == (
        exact.total,
        exact.ignored,
        exact.rejected,
        exact.errors,
    )
    # The lean path keeps each Span's bytes as received; the exact path re-serialises.
    assert [Span.FromString(r) for r in fast.raw] == [Span.FromString(r) for r in exact.raw]


def test_lean_decoding_matches_the_generated_types() -> None:
    spans = [s for make in SCRIPTS for s in make().spans()]
    spans += heartbeat_spans("agent-1", ["a", "b"], 1.5)
    request = encode_spans(spans)
    body = request.SerializeToString()
    _same(extract(ExportTraceServiceRequest.FromString(body), body), _extract_exact(request))
    _same(extract(request), _extract_exact(request))


_VALUES = st.one_of(
    st.text(max_size=300),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.text(max_size=3), max_size=3),
    st.binary(max_size=4),
    st.none(),
)
_KEYS = st.sampled_from(
    [
        sc.SAGA_PHASE,
        sc.SAGA_RUN_ID,
        sc.SAGA_STEP_INDEX,
        sc.SAGA_STEP_ATTEMPT,
        sc.SAGA_STEP_PIVOT,
        sc.SAGA_STEP_CLASS,
        sc.SAGA_COMPENSATION_ARGS,
        sc.SAGA_RUN_STATUS,
        sc.SAGA_HEARTBEAT_INTERVAL_S,
        sc.SAGA_HEARTBEAT_OPEN_RUNS,
        "other.key",
    ]
)


def _set(kv: Any, key: str, value: Any) -> None:
    kv.key = key
    if value is None:
        return  # an empty AnyValue
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, bytes):
        kv.value.bytes_value = value
    elif isinstance(value, list):
        for item in value:
            kv.value.array_value.values.add().string_value = item
    else:
        kv.value.string_value = value


@settings(max_examples=300, deadline=None)
@given(
    spans=st.lists(
        st.lists(
            st.tuples(_KEYS, _VALUES)
            | st.sampled_from([(sc.SAGA_PHASE, p) for p in sorted(sc.PHASES)])
            | st.just((sc.SAGA_RUN_ID, "r1")),
            max_size=8,
        ),
        max_size=5,
    ),
    events=st.booleans(),
)
def test_lean_decoding_matches_on_odd_attributes(
    spans: list[list[tuple[str, Any]]], events: bool
) -> None:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    _set(rs.resource.attributes.add(), sc.SERVICE_INSTANCE_ID, "i-1")
    out = rs.scope_spans.add().spans
    for n, attrs in enumerate(spans, 1):
        span = out.add()
        span.trace_id, span.span_id = b"\x01" * 16, n.to_bytes(8, "big")
        span.status.code = 2 if events else 1  # type: ignore[assignment]
        for key, value in attrs:
            _set(span.attributes.add(), key, value)
        if events:
            event = span.events.add()
            event.name = "exception"
            _set(event.attributes.add(), "exception.type", "ValueError")
    body = request.SerializeToString()
    exact = _extract_exact(request)  # an array saga.phase is rejected, never a TypeError
    _same(extract(ExportTraceServiceRequest.FromString(body), body), exact)


def test_lean_attribute_entries_of_every_shape_match_the_generated_types() -> None:
    """The KeyValue shortcut (_otlp._entry) and its cache against the exact path: long
    keys and values (multi-byte lengths), a key repeated (the last wins), a value-less
    key, a KeyValue with its fields in the other order, and "saga.phase" only in an event."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    _set(rs.resource.attributes.add(), sc.SERVICE_INSTANCE_ID, "i-1")
    out = rs.scope_spans.add().spans
    shapes: list[list[tuple[str, Any]]] = [
        [("k" * 200, "v"), (sc.SAGA_NAME, "x" * 200), (sc.SAGA_NAME, "y" * 20_000)],
        [(sc.SAGA_STEP_NAME, "a"), (sc.SAGA_STEP_NAME, "b"), (sc.SAGA_STEP_CLASS, None)],
        [(sc.SAGA_STEP_INDEX, 300), (sc.SAGA_STEP_ATTEMPT, -1), (sc.SAGA_STEP_PIVOT, True)],
        [(sc.SAGA_COMPENSATION_DESCRIPTION, "\u00e9" * 70), ("", "no key")],
    ]
    for n, attrs in enumerate(shapes * 2, 1):  # twice: the second time from the cache
        span = out.add()
        span.trace_id, span.span_id = b"\x02" * 16, n.to_bytes(8, "big")
        _set(span.attributes.add(), sc.SAGA_PHASE, sc.PHASE_DO)
        _set(span.attributes.add(), sc.SAGA_RUN_ID, "r1")
        for key, value in attrs:
            _set(span.attributes.add(), key, value)
    span = out.add()  # the phase key only in an event: not a saga span
    span.trace_id, span.span_id = b"\x02" * 16, (99).to_bytes(8, "big")
    _set(span.events.add().attributes.add(), sc.SAGA_PHASE, sc.PHASE_DO)
    body = request.SerializeToString()
    exact = _extract_exact(request)
    _same(extract(ExportTraceServiceRequest.FromString(body), body), exact)
    assert exact.ignored == 1
    # A KeyValue written value first, then key: the shortcut declines, the parse decides.
    kv = KeyValue(key=sc.SAGA_PHASE)
    kv.value.string_value = sc.PHASE_DO
    flipped = kv.value.SerializeToString()
    entry = b"\x12" + bytes([len(flipped)]) + flipped + b"\x0a\x0a" + sc.SAGA_PHASE.encode()
    assert _otlp._entry(entry) == (sc.SAGA_PHASE, sc.PHASE_DO)


def test_the_attribute_cache_is_bounded() -> None:
    for n in range(_otlp._ENTRY_CACHE_MAX + 10):
        kv = KeyValue(key=sc.SAGA_STEP_NAME)
        kv.value.string_value = f"step-{n}"
        _otlp._read_entry(kv.SerializeToString())
        kv = KeyValue(key=sc.SAGA_RUN_ID)  # one per run: never kept
        kv.value.string_value = f"run-{n}"
        _otlp._read_entry(kv.SerializeToString())
    assert 0 < len(_otlp._entries) <= _otlp._ENTRY_CACHE_MAX
    assert all(key != sc.SAGA_RUN_ID for key, _ in _otlp._entries.values())


def test_a_resource_seen_before_decodes_the_same_and_warns_again() -> None:
    """The resource cache (_otlp._resources): every request still gets its warning."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    _set(rs.resource.attributes.add(), sc.SERVICE_NAME, "no-instance")
    span = rs.scope_spans.add().spans.add()
    span.trace_id, span.span_id = b"\x03" * 16, b"\x04" * 8
    _set(span.attributes.add(), sc.SAGA_PHASE, sc.PHASE_VALIDATE)
    _set(span.attributes.add(), sc.SAGA_RUN_ID, "r1")
    body = request.SerializeToString()
    first, again = (extract(ExportTraceServiceRequest.FromString(body), body) for _ in "ab")
    _same(first, _extract_exact(request))
    _same(again, _extract_exact(request))
    assert first.warnings == again.warnings == _extract_exact(request).warnings
    assert first.warnings and first.spans[0].instance.startswith("derived:")
    for n in range(_otlp._RESOURCE_CACHE_MAX + 10):
        rs.resource.attributes[0].value.string_value = f"service-{n}"
        body = request.SerializeToString()
        extract(ExportTraceServiceRequest.FromString(body), body)
    assert 0 < len(_otlp._resources) <= _otlp._RESOURCE_CACHE_MAX


def test_attempts_arriving_out_of_order_fold_the_same() -> None:
    r = RunScript()
    r.do(0, "issue_credit", ok=False, attempt=1)
    r.do(0, "issue_credit", ok=False, attempt=2)
    r.do(0, "issue_credit", comp=CREDIT, attempt=3)
    r.do(2, "update_ticket", comp=TICKET)
    r.do(1, "notify", "read")
    records = list(extract(encode_spans(r.spans())).spans)
    views = []
    for order in itertools.islice(itertools.permutations(records), 0, None, 17):
        state = RunState()
        for span in order:  # one span per batch: every insertion path
            state.apply([span], 1.0)
        views.append(state.view(r.run_id))
    assert all(v == views[0] for v in views)
    assert views[0] is not None
    assert [s["index"] for s in views[0]["steps"]] == [0, 1, 2]
    assert [a["attempt"] for a in views[0]["steps"][0]["attempts"]] == [1, 2, 3]


async def test_facts_only_listener_hears_exactly_the_alert_relevant_changes(
    tmp_path: Path,
) -> None:
    every: list[tuple[Any, Any]] = []
    facts: list[tuple[Any, Any]] = []
    async with Sidecar(settings_for(tmp_path), clock=FakeClock()) as sc_:
        sc_.add_listener(lambda b, a, now: every.append((b, a)))
        sc_.add_listener(lambda b, a, now: facts.append((b, a)), facts_only=True)
        for make in SCRIPTS:
            for span in make().spans():  # one span per request: every step of every run
                await export_http(sc_, [span])
    assert facts and len(facts) < len(every)
    for before, after in every:
        if (before, after) not in facts:
            assert evaluate(before, after, 0.0) == []  # what it missed fires nothing
    for before, after in facts:
        assert (before, after) in every  # and it hears the same views
