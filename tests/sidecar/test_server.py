"""The Sidecar service object: back-pressure, listeners, orphan ticks, background tasks, auth."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sidecar_testkit import BOTH_BACKENDS, FakeClock, export_http, open_run, settings_for, stuck_run

from saga_otel import semconv as sc
from sidecar import Sidecar

pytestmark = BOTH_BACKENDS


async def test_http_overload_answers_429_with_retry_after(tmp_path: Path, clock: FakeClock) -> None:
    async with Sidecar(settings_for(tmp_path, max_receiving=1), clock=clock) as sc_:
        host, port = "127.0.0.1", sc_.otlp_http_port
        url = f"http://{host}:{port}/v1/traces"
        empty = ExportTraceServiceRequest().SerializeToString()
        headers = {"Content-Type": "application/x-protobuf"}
        # One request stuck half-way through its body holds the only receiving place
        # (never an in-flight slot: those are taken once a body is whole).
        _reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
            b"Content-Length: 100\r\n\r\n\x0a"
        )
        await writer.drain()
        async with aiohttp.ClientSession() as s:
            for _ in range(1000):
                async with s.post(url, data=empty, headers=headers) as resp:
                    if resp.status == 429:
                        assert resp.headers["Retry-After"] == "1"
                        assert "--max-receiving" in await resp.text()
                        break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("a stalled body never held the receiving place")
            assert sc_.in_flight == 0
            writer.close()
            for _ in range(1000):
                async with s.post(url, data=empty, headers=headers) as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the receiving place was never given back")


async def test_tick_orphans_and_tells_listeners(tmp_path: Path, clock: FakeClock) -> None:
    events: list[tuple[Any, Any, float]] = []
    async with Sidecar(settings_for(tmp_path, idle_timeout=30.0), clock=clock) as sc_:
        sc_.add_listener(lambda b, a, now: events.append((b, a, now)))
        sc_.add_listener(lambda b, a, now: 1 / 0)  # a broken listener costs nothing
        run = open_run()
        await export_http(sc_, run.spans())
        events.clear()
        assert sc_.tick() == []
        clock.now += 31
        (transition,) = sc_.tick()
        assert transition.after == sc.STATE_ORPHANED
        ((before, after, now),) = events
        assert (before["status"], after["status"], now) == (
            sc.STATE_RUNNING,
            sc.STATE_ORPHANED,
            clock.now,
        )
        assert after["run_id"] == run.run_id
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{sc_.api_port}/runs?needs=person") as resp,
        ):
            assert [r["run_id"] for r in (await resp.json())["runs"]] == [run.run_id]


async def test_the_ticker_runs_in_the_background(tmp_path: Path) -> None:
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=0.01)
    async with Sidecar(settings, clock=clock) as sc_:
        run = open_run()
        await export_http(sc_, run.spans())
        clock.now += 6
        for _ in range(2000):
            if sc_.state.status(run.run_id) == sc.STATE_ORPHANED:
                break
            await asyncio.sleep(0.005)
        assert sc_.state.status(run.run_id) == sc.STATE_ORPHANED


async def test_background_tasks_start_and_are_cancelled(tmp_path: Path, clock: FakeClock) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def worker() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    sc_ = Sidecar(settings_for(tmp_path), clock=clock)
    sc_.add_background(worker)
    async with sc_:
        await asyncio.wait_for(started.wait(), 30)
        assert not cancelled.is_set()
        assert sc_.database == settings_for(tmp_path).database
    assert cancelled.is_set()


async def test_extra_api_routes(tmp_path: Path, clock: FakeClock) -> None:
    from aiohttp import web

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"hello": True})

    sc_ = Sidecar(settings_for(tmp_path), clock=clock)
    sc_.add_api_routes([web.get("/alerts", hello)])
    async with (
        sc_,
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{sc_.api_port}/alerts") as resp,
    ):
        assert await resp.json() == {"hello": True}


async def test_token_guards_every_endpoint(tmp_path: Path, clock: FakeClock) -> None:
    token = "s3cret-token"
    async with Sidecar(settings_for(tmp_path, token=token), clock=clock) as sc_:
        good = {"Authorization": f"Bearer {token}"}
        bad = {"Authorization": "Bearer wrong"}
        api = f"http://127.0.0.1:{sc_.api_port}"
        otlp = f"http://127.0.0.1:{sc_.otlp_http_port}/v1/traces"
        body = ExportTraceServiceRequest().SerializeToString()
        proto = {"Content-Type": "application/x-protobuf"}
        async with aiohttp.ClientSession() as s:
            for path in ("/healthz", "/metrics", "/runs", "/runs/x", "/runs/x/stack"):
                for headers in ({}, bad):
                    async with s.get(api + path, headers=headers) as resp:
                        assert resp.status == 401, path
                        assert "--token" in (await resp.json())["error"]
            async with s.post(api + "/runs/x/resolve", json={"note": "n"}) as resp:
                assert resp.status == 401
            async with s.get(api + "/healthz", headers=good) as resp:
                assert resp.status == 200
            async with s.post(otlp, data=body, headers=proto) as resp:
                assert resp.status == 401
            async with s.post(otlp, data=body, headers={**proto, **good}) as resp:
                assert resp.status == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc_.otlp_grpc_port}") as ch:
            call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            try:
                await call(body)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAUTHENTICATED
            else:
                raise AssertionError("gRPC accepted a request without the token")
            await call(body, metadata=(("authorization", f"Bearer {token}"),))
        run = stuck_run()
        from sidecar_testkit import export_grpc

        await export_grpc(sc_, run.spans(), headers={"authorization": f"Bearer {token}"})
        await export_http(sc_, open_run().spans(), headers={"Authorization": f"Bearer {token}"})
        assert sc_.state.status(run.run_id) == sc.STATUS_STUCK
        assert len(sc_.state) == 2
