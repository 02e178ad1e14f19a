"""OTLP requests of saga spans, built the way an agent's exporter sends them.

One place for the benches that feed the sidecar raw protobuf (ingest, scale,
retention): a request of one resource (``bench-agent``, instance ``i-1``) and
one scope, and saga spans with the contract's attributes.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from saga_otel import semconv as sc

T0_NS = 1_700_000_000_000_000_000


def new_request() -> tuple[ExportTraceServiceRequest, object]:
    """An empty request of the bench agent's resource, and its one scope's span list."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for key, value in ((sc.SERVICE_NAME, "bench-agent"), (sc.SERVICE_INSTANCE_ID, "i-1")):
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = key, value
    return req, rs.scope_spans.add().spans


def saga_span(
    spans: object,
    trace_id: int,
    span_id: int,
    name: str,
    start_ns: int,
    end_ns: int,
    strings: Iterable[tuple[str, str]],
    ints: Iterable[tuple[str, int]],
) -> None:
    """Append one finished (status OK) span with these string and int attributes."""
    span = spans.add()  # type: ignore[attr-defined]
    span.trace_id = trace_id.to_bytes(16, "big")
    span.span_id = span_id.to_bytes(8, "big")
    span.name = name
    span.start_time_unix_nano = start_ns
    span.end_time_unix_nano = end_ns
    span.status.code = 1  # STATUS_CODE_OK
    for key, val in strings:
        kv = span.attributes.add()
        kv.key, kv.value.string_value = key, val
    for key, num in ints:
        kv = span.attributes.add()
        kv.key, kv.value.int_value = key, num


def do_span(spans: object, run: int, index: int, counter: int, step: str) -> None:
    """A compensable step's do span (a credit issued, its reversal pushed) of run ``run``."""
    start = T0_NS + counter * 1000
    saga_span(
        spans,
        run,
        counter,
        sc.do_span_name(step),
        start,
        start + 500,
        (
            (sc.SAGA_RUN_ID, f"{run:032x}"),
            (sc.SAGA_NAME, "refund"),
            (sc.SAGA_PHASE, sc.PHASE_DO),
            (sc.SAGA_STEP_NAME, step),
            (sc.SAGA_STEP_CLASS, "compensable"),
            (sc.SAGA_COMPENSATION_TOOL, "reverse_credit"),
            (sc.SAGA_COMPENSATION_ARGS, f'{{"credit_id": "cr_{counter}"}}'),
            (sc.SAGA_COMPENSATION_DESCRIPTION, "reverse the credit"),
        ),
        ((sc.SAGA_STEP_INDEX, index), (sc.SAGA_STEP_ATTEMPT, 1), (sc.SAGA_CONTRACT_VERSION, 1)),
    )
