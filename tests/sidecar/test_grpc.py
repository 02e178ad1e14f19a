"""OTLP/gRPC intake with the SDK's gRPC exporter, plus raw-channel error codes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_testkit import (
    BOTH_BACKENDS,
    CREDIT,
    FakeClock,
    compensation_failed_run,
    export_grpc,
    settings_for,
    stuck_run,
)

from saga_otel import semconv as sc
from sidecar import Sidecar

pytestmark = BOTH_BACKENDS

METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def channel(sidecar: Sidecar) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.otlp_grpc_port}")


async def test_runs_over_grpc(sidecar: Sidecar) -> None:
    failed, stuck = compensation_failed_run(), stuck_run()
    spans = failed.spans() + stuck.spans()
    assert await export_grpc(sidecar, spans[::-1] + spans[:4]) is SpanExportResult.SUCCESS
    assert sidecar.state.status(failed.run_id) == sc.STATUS_COMPENSATION_FAILED
    assert sidecar.state.status(stuck.run_id) == sc.STATUS_STUCK
    stack = sidecar.state.stack(failed.run_id)
    assert stack is not None and [(i["tool"], i["args"]) for i in stack] == [(CREDIT[0], CREDIT[1])]


async def test_grpc_partial_success_and_invalid_argument(sidecar: Sidecar) -> None:
    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.trace_id, span.span_id = b"\x01" * 16, b"\x02" * 8
    kv = span.attributes.add()
    kv.key, kv.value.string_value = sc.SAGA_PHASE, "unwind"
    async with channel(sidecar) as ch:
        call = ch.unary_unary(METHOD)
        raw = await call(req.SerializeToString())
        answer = ExportTraceServiceResponse.FromString(raw)
        assert answer.partial_success.rejected_spans == 1
        assert sc.SAGA_RUN_ID in answer.partial_success.error_message
        try:
            await call(b"\xff\xff\xff\xff")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "protobuf" in (exc.details() or "")
        else:
            raise AssertionError("garbage was accepted")


async def test_grpc_size_bound(tmp_path, clock) -> None:  # type: ignore[no-untyped-def]
    async with (
        Sidecar(settings_for(tmp_path, max_body=512), clock=clock) as sc_,
        channel(sc_) as ch,
    ):
        try:
            await ch.unary_unary(METHOD)(b"\x00" * 2048)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        else:
            raise AssertionError("an oversized message was accepted")


def retry_delay(exc: grpc.aio.AioRpcError) -> int | None:
    """The RetryInfo delay (seconds) in a refusal's status details, as exporters read it."""
    from google.rpc import error_details_pb2, status_pb2

    trailers = dict(exc.trailing_metadata() or ())
    status = status_pb2.Status.FromString(trailers.get("grpc-status-details-bin", b""))
    assert (status.code, status.message) == (exc.code().value[0], exc.details())
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return int(info.retry_delay.seconds)
    return None


async def test_grpc_overload_is_unavailable(sidecar: Sidecar) -> None:
    """UNAVAILABLE with a RetryInfo of 1 s (the HTTP port's 429 + Retry-After: 1), naming
    the bound: what the OTLP spec has a server signal back-pressure with."""
    sidecar.in_flight = sidecar.settings.max_in_flight  # as if that many requests were mid-way
    try:
        async with channel(sidecar) as ch:
            try:
                await ch.unary_unary(METHOD)(ExportTraceServiceRequest().SerializeToString())
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE
                assert "--max-in-flight" in (exc.details() or "")
                assert retry_delay(exc) == 1
            else:
                raise AssertionError("no back-pressure at the in-flight bound")
    finally:
        sidecar.in_flight = 0


async def test_logs_and_metrics_services_are_refused_naming_the_fix(sidecar: Sidecar) -> None:
    async with channel(sidecar) as ch:
        for service, var in (
            ("opentelemetry.proto.collector.logs.v1.LogsService", "LOGS"),
            ("opentelemetry.proto.collector.metrics.v1.MetricsService", "METRICS"),
        ):
            try:
                await ch.unary_unary(f"/{service}/Export")(b"")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.UNIMPLEMENTED  # never retried
                why = exc.details() or ""
                assert f"OTEL_EXPORTER_OTLP_{var}_ENDPOINT" in why, why
                assert f"OTEL_{var}_EXPORTER=none" in why, why
            else:
                raise AssertionError(f"{service} was answered")


async def test_grpc_calls_past_max_receiving_are_unavailable_with_retry_info(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Calls still receiving their message are bounded by --max-receiving, as HTTP bodies
    are: past it, UNAVAILABLE with a RetryInfo, which exporters retry. It was grpc's own
    cap, RESOURCE_EXHAUSTED without RetryInfo, which the OTLP spec has exporters drop."""
    settings = settings_for(tmp_path, max_receiving=1, max_in_flight=1, body_timeout=60.0)
    stall = asyncio.Event()

    async def nothing() -> AsyncIterator[bytes]:
        await stall.wait()
        yield b""  # pragma: no cover - the call is cancelled first

    async with Sidecar(settings, clock=clock) as sc_, channel(sc_) as ch:
        stalled = [ch.stream_unary(METHOD)(nothing()) for _ in range(2)]
        empty = ExportTraceServiceRequest().SerializeToString()
        try:
            for _ in range(1000):
                try:
                    await ch.unary_unary(METHOD)(empty, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
                    assert "--max-receiving" in (exc.details() or "")
                    assert retry_delay(exc) == 1
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("a stalled call never held the receiving place")
            assert sc_.in_flight == 0
        finally:
            for call in stalled:
                call.cancel()
