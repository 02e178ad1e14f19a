"""Pass-through to an upstream OTLP/HTTP receiver (a local aiohttp app)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_testkit import FakeClock, completed_run, export_http, settings_for

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar._forward import Forwarder, cancel


class Upstream:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.status = 200

    async def handle(self, request: web.Request) -> web.Response:
        await self.gate.wait()
        self.bodies.append(await request.read())
        return web.Response(status=self.status)


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    up = Upstream()
    app = web.Application()
    app.router.add_post("/v1/traces", up.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield up, f"http://127.0.0.1:{port}/v1/traces"
    up.gate.set()
    await runner.cleanup()


async def wait_for(predicate: Any) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


async def test_every_request_is_forwarded(tmp_path: Path, upstream: Any) -> None:
    up, url = upstream
    async with Sidecar(settings_for(tmp_path, forward=url), clock=FakeClock()) as sc_:
        run = completed_run()
        plain = ExportTraceServiceRequest()
        plain.resource_spans.add().scope_spans.add().spans.add(
            name="GET /", trace_id=b"1" * 16, span_id=b"2" * 8
        )
        await export_http(sc_, run.spans())
        import aiohttp

        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"http://127.0.0.1:{sc_.otlp_http_port}/v1/traces",
                data=plain.SerializeToString(),
                headers={"Content-Type": "application/x-protobuf"},
            ) as resp,
        ):
            assert resp.status == 200
        await wait_for(lambda: len(up.bodies) == 2)
        first = ExportTraceServiceRequest.FromString(up.bodies[0])
        names = [s.name for rs in first.resource_spans for ss in rs.scope_spans for s in ss.spans]
        assert sc.run_span_name("refund") in names
        assert ExportTraceServiceRequest.FromString(up.bodies[1]) == plain


async def test_a_gzip_body_of_several_members_is_forwarded_whole(
    tmp_path: Path, upstream: Any
) -> None:
    """The upstream gets the whole inflated body of a gzip request of two members (RFC
    1952), not the first member's spans only."""
    up, url = upstream
    first, second = completed_run(instance="agent-a"), completed_run(instance="agent-b")
    parts = [encode_spans(r.spans()).SerializeToString() for r in (first, second)]
    async with (
        Sidecar(settings_for(tmp_path, forward=url), clock=FakeClock()) as sc_,
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{sc_.otlp_http_port}/v1/traces",
            data=b"".join(gzip.compress(p) for p in parts),
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
        ) as resp,
    ):
        assert resp.status == 200
        await wait_for(lambda: len(up.bodies) == 1)
    assert up.bodies == [b"".join(parts)]


async def test_slow_upstream_never_blocks_intake_and_drops_are_counted(
    tmp_path: Path, upstream: Any
) -> None:
    up, url = upstream
    up.gate.clear()  # the upstream hangs
    settings = settings_for(tmp_path, forward=url, forward_queue=2)
    async with Sidecar(settings, clock=FakeClock()) as sc_:
        runs = [completed_run() for _ in range(6)]
        assert sc_.forwarder is not None
        forwarder = sc_.forwarder
        assert await export_http(sc_, runs[0].spans()) is SpanExportResult.SUCCESS
        await wait_for(lambda: forwarder.pending == 0)  # the sender holds it, upstream hangs
        for run in runs[1:]:  # each export returns although nothing gets upstream
            assert await export_http(sc_, run.spans()) is SpanExportResult.SUCCESS
        assert all(sc_.state.status(r.run_id) == sc.STATUS_COMPLETED for r in runs)
        assert sc_.forwarder is not None
        # one request is in the sender, two wait in the queue, three were dropped: 5 spans each
        await wait_for(lambda: sc_.forwarder is not None and sc_.forwarder.dropped == 15)
        dropped = sc_.metrics.registry.get_sample_value("saga_sidecar_forward_dropped_spans_total")
        assert dropped == 15.0
        up.gate.set()
        await wait_for(lambda: len(up.bodies) == 3)


async def test_upstream_errors_count_as_drops(tmp_path: Path, upstream: Any) -> None:
    up, url = upstream
    up.status = 500
    async with Sidecar(settings_for(tmp_path, forward=url), clock=FakeClock()) as sc_:
        await export_http(sc_, completed_run().spans())
        await wait_for(lambda: sc_.forwarder is not None and sc_.forwarder.dropped == 5)


async def test_what_shutdown_cuts_is_counted(upstream: Any) -> None:
    """Stopping with the upstream hung: the request in the sender, those in the queue and
    any offered afterwards (a request answered while the ports close) are all counted
    as dropped, none silently lost."""
    up, url = upstream
    up.gate.clear()
    counted: list[int] = []
    fwd = Forwarder(url, queue_size=8, on_drop=counted.append)
    task = asyncio.create_task(fwd.run())
    assert fwd.offer(b"a", "application/x-protobuf", 3)
    await wait_for(lambda: fwd.pending == 0)  # the sender holds it; the upstream hangs
    assert fwd.offer(b"b", "application/x-protobuf", 4)
    assert fwd.offer(b"c", "application/x-protobuf", 5)
    await cancel(task)
    assert not fwd.offer(b"d", "application/x-protobuf", 6)
    assert sorted(counted) == [3, 4, 5, 6] and fwd.dropped == 18 and fwd.sent == 0
