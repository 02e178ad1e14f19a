"""Decoding and validation, and a live sidecar fed Hypothesis-made garbage."""

from __future__ import annotations

import gzip
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from sidecar_testkit import completed_run, heartbeat_spans, start_sidecar

from saga_otel import semconv as sc
from sidecar import DecodeError
from sidecar._otlp import extract, parse_json, parse_protobuf, response, validate

VALID = completed_run()
VALID_BODY = encode_spans(VALID.spans()).SerializeToString()


def test_extract_builds_span_records() -> None:
    decoded = extract(parse_protobuf(VALID_BODY))
    assert decoded.total == 5 and decoded.ignored == 0 and decoded.rejected == 0
    run_span = next(s for s in decoded.spans if s.phase == sc.PHASE_RUN)
    assert run_span.run_id == VALID.run_id
    assert run_span.instance == "agent-1" and run_span.service == "refund-agent"
    assert len(run_span.trace_id) == 32 and len(run_span.span_id) == 16
    assert run_span.end >= run_span.start > 1e9
    assert len(decoded.raw) == len(decoded.spans)


def test_heartbeat_needs_no_run_id() -> None:
    decoded = extract(encode_spans(heartbeat_spans("agent-1", ["a", "b"], 1.0)))
    assert decoded.rejected == 0
    assert decoded.spans[0].attributes[sc.SAGA_HEARTBEAT_OPEN_RUNS] == ["a", "b"]


@pytest.mark.parametrize(
    ("attrs", "needle"),
    [
        ({sc.SAGA_PHASE: "dance"}, "saga.phase"),
        ({sc.SAGA_PHASE: "do", sc.SAGA_STEP_INDEX: 1}, sc.SAGA_RUN_ID),
        ({sc.SAGA_PHASE: "do", sc.SAGA_RUN_ID: "r"}, sc.SAGA_STEP_INDEX),
        ({sc.SAGA_PHASE: "do", sc.SAGA_RUN_ID: "r", sc.SAGA_STEP_INDEX: True}, "int"),
        ({sc.SAGA_PHASE: "do", sc.SAGA_RUN_ID: 5}, "string"),
        (
            {
                sc.SAGA_PHASE: "do",
                sc.SAGA_RUN_ID: "r",
                sc.SAGA_STEP_INDEX: 0,
                sc.SAGA_STEP_PIVOT: "yes",
            },
            "bool",
        ),
        (
            {
                sc.SAGA_PHASE: "do",
                sc.SAGA_RUN_ID: "r",
                sc.SAGA_STEP_INDEX: 0,
                sc.SAGA_COMPENSATION_ARGS: "[1]",
            },
            "JSON object",
        ),
        (
            {
                sc.SAGA_PHASE: "do",
                sc.SAGA_RUN_ID: "r",
                sc.SAGA_STEP_INDEX: 0,
                sc.SAGA_STEP_CLASS: "magic",
            },
            sc.SAGA_STEP_CLASS,
        ),
        (
            {sc.SAGA_PHASE: "run", sc.SAGA_RUN_ID: "r", sc.SAGA_RUN_STATUS: "fine"},
            sc.SAGA_RUN_STATUS,
        ),
        ({sc.SAGA_PHASE: "heartbeat", sc.SAGA_HEARTBEAT_OPEN_RUNS: [1, 2]}, "string array"),
        ({sc.SAGA_PHASE: "heartbeat", sc.SAGA_HEARTBEAT_INTERVAL_S: -1.0}, "positive"),
        ({sc.SAGA_PHASE: "escalate", sc.SAGA_RUN_ID: "r", sc.SAGA_ESCALATION_CARD: "{"}, "JSON"),
    ],
)
def test_validate_names_the_problem(attrs: dict[str, Any], needle: str) -> None:
    problem = validate(attrs)
    assert problem is not None and needle in problem


def test_json_decoding_rejects_bad_shapes() -> None:
    for body in (
        b"[]",
        b'{"resourceSpans": 5}',
        b'{"resourceSpans": [{"scopeSpans": "x"}]}',
        b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"zz"}]}]}]}',
    ):
        try:
            extract(parse_json(body))
        except DecodeError as exc:
            assert str(exc)
        # a shape json_format tolerates must still decode to zero spans, not crash


# --- a live sidecar under fire ----------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    db: Path = tmp_path_factory.mktemp("live") / "sidecar.db"
    proc, ports = start_sidecar(db, "--max-body", "64KiB")
    try:
        yield ports
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _any_value() -> st.SearchStrategy[dict[str, Any]]:
    scalar = st.one_of(
        st.builds(lambda v: {"stringValue": v}, st.text(max_size=8)),
        st.builds(lambda v: {"intValue": v}, st.integers(-(2**63), 2**63 - 1)),
        st.builds(lambda v: {"boolValue": v}, st.booleans()),
        st.builds(lambda v: {"doubleValue": v}, st.floats(allow_nan=False)),
        st.builds(
            lambda v: {"arrayValue": {"values": v}},
            st.lists(st.builds(lambda s: {"stringValue": s}, st.text(max_size=3)), max_size=3),
        ),
    )
    return scalar


KEYS = [
    sc.SAGA_PHASE,
    sc.SAGA_RUN_ID,
    sc.SAGA_STEP_INDEX,
    sc.SAGA_STEP_PIVOT,
    sc.SAGA_RUN_STATUS,
    sc.SAGA_COMPENSATION_ARGS,
    sc.SAGA_HEARTBEAT_OPEN_RUNS,
    sc.SAGA_HEARTBEAT_INTERVAL_S,
    sc.SAGA_ESCALATION_CARD,
    "other",
]

json_spans = st.fixed_dictionaries(
    {
        "traceId": st.sampled_from(["", "00" * 16, "ab" * 8, "q" * 32]),
        "spanId": st.sampled_from(["", "01" * 8, "02" * 4]),
        "name": st.text(max_size=5),
        "startTimeUnixNano": st.one_of(st.integers(0, 2**64 - 1), st.just("x")),
        "attributes": st.lists(
            st.fixed_dictionaries({"key": st.sampled_from(KEYS), "value": _any_value()}),
            max_size=6,
        ),
    }
)
json_bodies = st.one_of(
    st.builds(
        lambda spans: {"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]},
        st.lists(json_spans, max_size=4),
    ),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    ),
)


def _check(ports: dict[str, Any], resp: httpx.Response) -> None:
    assert 200 <= resp.status_code < 500, resp.text
    if resp.status_code == 200 and "json" in resp.headers["content-type"]:
        assert isinstance(resp.json(), dict)
    assert httpx.get(f"http://127.0.0.1:{ports['api']}/healthz").status_code == 200


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.binary(max_size=300)
    | st.builds(lambda n: VALID_BODY[:n], st.integers(0, len(VALID_BODY)))
)
def test_random_and_truncated_protobuf(live: dict[str, Any], body: bytes) -> None:
    url = f"http://127.0.0.1:{live['otlp_http']}/v1/traces"
    resp = httpx.post(url, content=body, headers={"Content-Type": "application/x-protobuf"})
    _check(live, resp)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=json_bodies, zipped=st.booleans())
def test_wrong_json_shapes_and_types(live: dict[str, Any], body: Any, zipped: bool) -> None:
    url = f"http://127.0.0.1:{live['otlp_http']}/v1/traces"
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if zipped:
        raw, headers["Content-Encoding"] = gzip.compress(raw), "gzip"
    _check(live, httpx.post(url, content=raw, headers=headers))


def test_gzip_bomb_against_live_sidecar(live: dict[str, Any]) -> None:
    url = f"http://127.0.0.1:{live['otlp_http']}/v1/traces"
    bomb = gzip.compress(b"\x0a" * (8 * 1024 * 1024))
    assert len(bomb) < 64 * 1024
    resp = httpx.post(
        url,
        content=bomb,
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
    )
    assert resp.status_code == 413
    _check(live, httpx.get(f"http://127.0.0.1:{live['api']}/healthz"))


# --- instance identity: a stream without service.instance.id ---------------------------

JS_LIKE = {
    sc.SERVICE_NAME: "refund-agent-js",
    sc.HOST_NAME: "web-7",
    sc.PROCESS_PID: 4242,
    "process.executable.name": "node",
    "telemetry.sdk.language": "nodejs",
    "telemetry.sdk.name": "opentelemetry",
    "telemetry.sdk.version": "1.30.0",
}


def _decode(resource: dict[str, Any], **kw: Any) -> Any:
    return extract(encode_spans(completed_run(resource=resource, **kw).spans()))


def test_missing_instance_is_derived_from_the_resource_with_a_warning() -> None:
    decoded = _decode(JS_LIKE)
    assert decoded.rejected == 0 and len(decoded.spans) == 5
    instances = {s.instance for s in decoded.spans}
    assert len(instances) == 1
    (instance,) = instances
    assert instance.startswith("derived:web-7:4242:")
    (warning,) = decoded.warnings
    assert sc.SERVICE_INSTANCE_ID in warning and "OTEL_RESOURCE_ATTRIBUTES" in warning
    assert instance in warning and "refund-agent-js" in warning
    # Partial success with nothing rejected: the OTLP way to warn.
    assert decoded.error_message == warning
    answer = ExportTraceServiceResponse.FromString(
        response(decoded.rejected, decoded.error_message, as_json=False)[0]
    )
    assert answer.partial_success.rejected_spans == 0
    assert sc.SERVICE_INSTANCE_ID in answer.partial_success.error_message


def test_resources_differing_only_in_pid_never_share_an_instance() -> None:
    one = _decode(JS_LIKE).spans[0].instance
    two = _decode({**JS_LIKE, sc.PROCESS_PID: 4243}).spans[0].instance
    again = _decode(JS_LIKE).spans[0].instance  # stable: another request, a restart
    assert one != two and one == again
    # Whatever differs counts, not only the pid: a restart with the same pid elsewhere.
    other_start = _decode({**JS_LIKE, sc.PROCESS_CREATION_TIME: "2026-01-01T00:00:00Z"})
    assert other_start.spans[0].instance not in (one, two)


def test_empty_instance_counts_as_missing() -> None:
    decoded = _decode({**JS_LIKE, sc.SERVICE_INSTANCE_ID: ""})
    assert decoded.spans[0].instance.startswith("derived:") and decoded.warnings


def test_given_instance_is_kept_without_warning() -> None:
    decoded = _decode({**JS_LIKE, sc.SERVICE_INSTANCE_ID: "i-1"})
    assert {s.instance for s in decoded.spans} == {"i-1"} and decoded.warnings == ()
    assert decoded.error_message == ""


def test_resource_naming_no_process_makes_each_run_its_own_instance() -> None:
    bare = {sc.SERVICE_NAME: "refund-agent-js", "telemetry.sdk.language": "nodejs"}
    one, two = _decode(bare), _decode(bare)
    first, second = one.spans[0].instance, two.spans[0].instance
    assert first != second  # two processes with the same resource: never one instance
    assert {s.instance for s in one.spans} == {first}  # one run: one instance
    assert "tells one process from another" in one.warnings[0]
    beat = extract(encode_spans(heartbeat_spans("", ["r"], 1.0, resource=bare)))
    assert beat.spans[0].instance == first.split("/trace:")[0]
