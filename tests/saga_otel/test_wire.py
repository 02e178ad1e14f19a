"""saga_otel._wire writes the bytes the SDK's OTLP encoder writes, for any span."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.span import TraceState

from saga_otel import semconv as sc
from saga_otel._wire import encode, string_item_bytes

KEYS = st.text(min_size=1, max_size=150)  # past 127 bytes the lengths take two bytes
TEXT = st.text(max_size=300)
SCALARS = st.one_of(
    TEXT,
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.floats(allow_nan=False),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(TEXT, max_size=4).map(tuple),
    st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), max_size=4),
    st.lists(st.booleans(), max_size=3),
    st.lists(st.floats(allow_nan=False), max_size=3),
)
ATTRS = st.dictionaries(KEYS, VALUES, max_size=14)
IDS = st.integers(min_value=1, max_value=(1 << 64) - 1)


class _Ids(IdGenerator):
    """Counted ids: the SDK's random ones would draw from ``random`` inside a strategy."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self._next)

    def generate_trace_id(self) -> int:
        return next(self._next) << 64 | 5


def _context(remote: bool, span_id: int, state: dict[str, str]) -> SpanContext:
    return SpanContext(
        trace_id=span_id << 8 | 7,
        span_id=span_id,
        is_remote=remote,
        trace_flags=trace.TraceFlags(1),
        trace_state=TraceState(list(state.items())),
    )


@st.composite
def batches(draw: st.DrawFn) -> list[ReadableSpan]:
    providers = [
        TracerProvider(
            resource=Resource(draw(ATTRS), schema_url=draw(st.sampled_from(["", "s"]))),
            id_generator=_Ids(),
        )
        for _ in range(draw(st.integers(1, 2)))
    ]
    spans: list[ReadableSpan] = []
    for _ in range(draw(st.integers(1, 4))):
        provider = draw(st.sampled_from(providers))
        tracer = provider.get_tracer(
            draw(st.sampled_from(["saga_otel", "agent"])),
            draw(st.sampled_from([None, "1.0"])),
            schema_url=draw(st.sampled_from([None, "https://opentelemetry.io/schemas/1.21.0"])),
            attributes=draw(st.none() | ATTRS),
        )
        parent = None
        if draw(st.booleans()):
            ctx = _context(
                draw(st.booleans()),
                draw(IDS),
                draw(
                    st.dictionaries(st.sampled_from(["a", "vendor"]), st.sampled_from(["1", "x"]))
                ),
            )
            parent = trace.set_span_in_context(NonRecordingSpan(ctx))
        links = [
            Link(_context(draw(st.booleans()), draw(IDS), {}), draw(st.none() | ATTRS))
            for _ in range(draw(st.integers(0, 2)))
        ]
        span = tracer.start_span(
            draw(TEXT),
            context=parent,
            kind=draw(st.sampled_from(list(SpanKind))),
            attributes=draw(ATTRS),
            links=links,
        )
        for _ in range(draw(st.integers(0, 2))):
            span.add_event(draw(TEXT), draw(ATTRS))
        if draw(st.booleans()):
            span.record_exception(ValueError(draw(TEXT)))
        code = draw(st.sampled_from(list(StatusCode)))
        span.set_status(Status(code, draw(TEXT) if code is StatusCode.ERROR else None))
        span.end()
        spans.append(span)  # type: ignore[arg-type]
    return spans


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_bytes_equal_the_sdk_encoders(spans: list[ReadableSpan]) -> None:
    assert encode(spans) == encode_spans(spans).SerializeToString()


def _one(**attrs: Any) -> ReadableSpan:
    span = TracerProvider().get_tracer("t").start_span("s", attributes=attrs)
    span.end()
    return span  # type: ignore[return-value]


def test_a_saga_step_span_round_trips_through_protobuf() -> None:
    span = _one(
        **{
            sc.SAGA_RUN_ID: "run-1",
            sc.SAGA_STEP_INDEX: 3,
            sc.SAGA_STEP_PIVOT: False,
            sc.SAGA_COMPENSATION_ARGS: '{"charge_id": "ch_1"}',
        }
    )
    got = ExportTraceServiceRequest.FromString(encode([span]))
    attrs = {kv.key: kv.value for kv in got.resource_spans[0].scope_spans[0].spans[0].attributes}
    assert attrs[sc.SAGA_RUN_ID].string_value == "run-1"
    assert attrs[sc.SAGA_STEP_INDEX].int_value == 3
    assert attrs[sc.SAGA_STEP_PIVOT].HasField("bool_value")


def test_values_it_does_not_write_go_to_the_sdk_encoder() -> None:
    # bytes, and an int past int64 (which the SDK logs and leaves out): same bytes as the SDK.
    for span in (_one(blob=b"\x00\x01"), _one(big=1 << 70, ok="yes")):
        assert encode([span]) == encode_spans([span]).SerializeToString()


def test_equal_resources_share_one_group_as_in_the_sdk() -> None:
    a = TracerProvider(resource=Resource({"service.name": "x"}))
    b = TracerProvider(resource=Resource({"service.name": "x"}))
    spans = []
    for provider in (a, b, a):
        span = provider.get_tracer("t").start_span("s")
        span.end()
        spans.append(span)
    body = encode(spans)  # type: ignore[arg-type]
    assert body == encode_spans(spans).SerializeToString()  # type: ignore[arg-type]
    assert len(ExportTraceServiceRequest.FromString(body).resource_spans) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=300), min_size=1, max_size=5))
def test_string_item_bytes_is_what_one_more_array_item_adds(items: list[str]) -> None:
    """What the heartbeat's size budget counts per run id: the item's own bytes, exactly.
    The fields around the array grow by their length prefixes only (a few bytes)."""
    resource = Resource({"service.name": "agent"})

    def size(values: list[str]) -> int:
        span = ReadableSpan(
            name=sc.HEARTBEAT_SPAN_NAME,
            context=SpanContext(1, 1, is_remote=False),
            resource=resource,
            attributes={sc.SAGA_HEARTBEAT_OPEN_RUNS: tuple(values)},
            start_time=1,
            end_time=2,
        )
        return len(encode([span]))

    for value in items:
        grown = size([*items, value]) - size(items)
        assert string_item_bytes(value) <= grown <= string_item_bytes(value) + 5
    long = ["x" * 20_000]
    assert size([*long, "é" * 200]) - size(long) == string_item_bytes("é" * 200)
