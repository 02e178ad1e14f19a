"""The Sidecar service object: back-pressure, listeners, orphan ticks, background tasks, auth."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from sidecar_testkit import (
    BOTH_BACKENDS,
    FakeClock,
    RunScript,
    database_clock_passes,
    export_http,
    heartbeat_spans,
    open_run,
    rejoin,
    settings_for,
    stuck_run,
)

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar._leases import Lease

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
            b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-protobuf\r\nContent-Length: 100\r\n\r\n\x0a"
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


async def _stalled_body(port: int, declared: int, sent: int) -> asyncio.StreamWriter:
    """A raw OTLP/HTTP request that sends its headers and ``sent`` body bytes, then stalls."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
        + f"Content-Length: {declared}\r\n\r\n".encode()
        + b"\x0a" * sent
    )
    await writer.drain()
    return writer


async def test_bodies_arriving_together_are_bounded_in_bytes_too(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Under the count bound, bodies being received hold at most --max-in-flight x
    --max-body bytes together: two stalled bodies of 60 KB (of 64 KiB each, 2 x 64 KiB
    allowed) leave no room for a third of 16 KiB, which gets 429; room again once one
    of them goes."""
    settings = settings_for(tmp_path, max_body=65536, max_in_flight=2, max_receiving=10)
    async with Sidecar(settings, clock=clock) as sc_:
        port = sc_.otlp_http_port
        url = f"http://127.0.0.1:{port}/v1/traces"
        stalled = [await _stalled_body(port, 65536, 60_000) for _ in range(2)]
        third = b"\x0a" * 16384  # undecodable, but refused before decoding matters
        headers = {"Content-Type": "application/x-protobuf"}
        async with aiohttp.ClientSession() as s:
            for _ in range(1000):
                async with s.post(url, data=third, headers=headers) as resp:
                    if resp.status == 429:
                        assert resp.headers["Retry-After"] == "1"
                        assert "request bytes" in await resp.text()
                        break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("120 KB of stalled bodies never refused 16 KiB more")
            assert sc_.in_flight == 0  # receiving holds no in-flight slot
            stalled[0].close()
            for _ in range(1000):
                async with s.post(url, data=third, headers=headers) as resp:
                    if resp.status != 429:
                        assert resp.status == 400  # read whole, then found undecodable
                        break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the stalled body's bytes were never given back")
        stalled[1].close()


async def test_a_body_trickling_below_the_minimum_rate_is_cut(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A body that keeps arriving, but at 1 KiB/s against --body-min-rate 4 KiB/s, is cut
    with 503 + Retry-After and its connection closed, long before --body-timeout (10
    minutes here): the test's own 60 s bound would fail first if only the timeout
    applied. 503, not 408: OTLP exporters retry 429/502/503/504 only, and dropped the
    spans of a body cut with 408."""
    settings = settings_for(tmp_path, body_min_rate=4096, body_timeout=600.0)
    async with Sidecar(settings, clock=clock) as sc_:
        reader, writer = await asyncio.open_connection("127.0.0.1", sc_.otlp_http_port)
        writer.write(
            b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf"
            b"\r\nContent-Length: 1000000\r\n\r\n"
        )
        async with asyncio.timeout(60):
            answer = asyncio.ensure_future(reader.read())
            while not answer.done():
                with contextlib.suppress(ConnectionError):
                    writer.write(b"\x0a" * 256)
                    await writer.drain()
                await asyncio.wait({answer}, timeout=0.25)
            head = answer.result()
        assert head.startswith(b"HTTP/1.1 503"), head[:200]
        assert b"\r\nRetry-After: 1\r\n" in head and b"\r\nConnection: close\r\n" in head
        assert b"--body-min-rate" in head
        assert sc_.in_flight == 0
        writer.close()


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
            for path in ("/healthz", "/readyz", "/metrics", "/runs", "/runs/x", "/runs/x/stack"):
                for headers in ({}, bad):
                    async with s.get(api + path, headers=headers) as resp:
                        assert resp.status == 401, path
                        assert "--token" in (await resp.json())["error"]
            async with s.post(api + "/runs/x/resolve", json={"note": "n"}) as resp:
                assert resp.status == 401
            for path in ("/healthz", "/readyz"):
                async with s.get(api + path, headers=good) as resp:
                    assert resp.status == 200, path
            async with s.post(otlp, data=body, headers=proto) as resp:
                assert resp.status == 401
            # The token comes before routing: no path or method is told apart without it.
            port = sc_.otlp_http_port
            for method, path in (
                ("POST", "/nope"),
                ("GET", "/v1/traces"),
                ("POST", "/v1/saga/presence"),
            ):
                async with s.request(method, f"http://127.0.0.1:{port}{path}") as resp:
                    assert resp.status == 401, (method, path)
                    assert resp.headers["WWW-Authenticate"] == "Bearer"
            async with s.post(otlp, data=body, headers={**proto, **good}) as resp:
                assert resp.status == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc_.otlp_grpc_port}") as ch:
            call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            wrong = (
                (),
                (("authorization", "Bearer not-the-token"),),
                (("authorization", token),),  # the token without its scheme
                (("authorization", f"Basic {token}"),),
            )
            for metadata in wrong:
                try:
                    await call(body, metadata=metadata)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.UNAUTHENTICATED, metadata
                else:
                    raise AssertionError(f"gRPC accepted a request with {metadata!r}")
            await call(body, metadata=(("authorization", f"Bearer {token}"),))
        run = stuck_run()
        from sidecar_testkit import export_grpc

        await export_grpc(sc_, run.spans(), headers={"authorization": f"Bearer {token}"})
        await export_http(sc_, open_run().spans(), headers={"Authorization": f"Bearer {token}"})
        assert sc_.state.status(run.run_id) == sc.STATUS_STUCK
        assert len(sc_.state) == 2


# An agent as another SDK writes it: the OpenTelemetry SDK with a resource that has no
# service.instance.id (the JS SDK's default), host.name and process.pid as its detectors
# put them. Commands on stdin: "run" opens a run (prints its id), "hb" sends a heartbeat.
_NO_INSTANCE_AGENT = """
import os, socket, sys
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from saga_otel import semconv as sc

provider = TracerProvider(resource=Resource({
    sc.SERVICE_NAME: "refund-agent-js", sc.HOST_NAME: socket.gethostname(),
    sc.PROCESS_PID: os.getpid(), "telemetry.sdk.language": "nodejs",
}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1])))
tracer = provider.get_tracer("agent")
runs = []
for line in sys.stdin:
    if line.strip() == "run":
        run = tracer.start_span("saga.run refund")
        run_id = f"{run.get_span_context().trace_id:032x}"
        ident = {sc.SAGA_RUN_ID: run_id, sc.SAGA_NAME: "refund",
                 sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION}
        from opentelemetry import trace
        ctx = trace.set_span_in_context(run)
        tracer.start_span("saga.do get_order", context=ctx, attributes={
            **ident, sc.SAGA_PHASE: sc.PHASE_DO, sc.SAGA_STEP_NAME: "get_order",
            sc.SAGA_STEP_INDEX: 0, sc.SAGA_STEP_CLASS: "read", sc.SAGA_STEP_ATTEMPT: 1,
        }).end()
        runs.append(run_id)
        print(run_id, flush=True)
    tracer.start_span(sc.HEARTBEAT_SPAN_NAME, attributes={
        sc.SAGA_PHASE: sc.PHASE_HEARTBEAT, sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
        sc.SAGA_HEARTBEAT_OPEN_RUNS: runs, sc.SAGA_HEARTBEAT_INTERVAL_S: 1.0,
    }).end()
    if line.strip() == "hb":
        print("ok", flush=True)
"""


async def test_two_processes_without_instance_id_never_share_one(
    tmp_path: Path, clock: FakeClock
) -> None:
    script = tmp_path / "agent.py"
    script.write_text(_NO_INSTANCE_AGENT)
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        endpoint = f"http://127.0.0.1:{sc_.otlp_http_port}/v1/traces"
        agents = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                endpoint,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            for _ in range(2)
        ]
        try:
            run_ids = []
            for agent in agents:
                assert agent.stdin is not None and agent.stdout is not None
                agent.stdin.write(b"run\n")
                await agent.stdin.drain()
                run_ids.append((await agent.stdout.readline()).decode().strip())
            views = [sc_.state.view(r) for r in run_ids]
            instances = [v["instance"] if v else "" for v in views]
            assert all(i.startswith("derived:") for i in instances)
            assert instances[0] != instances[1]  # identical resources but for the pid
            assert str(agents[0].pid) in instances[0] and str(agents[1].pid) in instances[1]
            # One dies; the other lives on and keeps beating: only the dead one's run orphans.
            agents[0].kill()
            await agents[0].wait()
            # Past the window of an instance that has shown no delivery cadence yet
            # (an SDK's default batch delay + 2 intervals).
            clock.now += 8.0
            live = agents[1]
            assert live.stdin is not None and live.stdout is not None
            live.stdin.write(b"hb\n")
            await live.stdin.drain()
            assert (await live.stdout.readline()).strip() == b"ok"
            sc_.tick()
            assert sc_.state.status(run_ids[0]) == sc.STATE_ORPHANED
            assert sc_.state.status(run_ids[1]) == sc.STATE_RUNNING
        finally:
            for agent in agents:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()


async def test_derived_instance_is_warned_in_partial_success(
    tmp_path: Path, clock: FakeClock
) -> None:
    run = open_run(resource={sc.SERVICE_NAME: "js", sc.HOST_NAME: "h", sc.PROCESS_PID: 7})
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        body = encode_spans(run.spans()).SerializeToString()
        url = f"http://127.0.0.1:{sc_.otlp_http_port}/v1/traces"
        async with aiohttp.ClientSession() as s:
            headers = {"Content-Type": "application/x-protobuf"}
            async with s.post(url, data=body, headers=headers) as resp:
                assert resp.status == 200
                answer = ExportTraceServiceResponse.FromString(await resp.read())
        assert answer.partial_success.rejected_spans == 0
        assert "service.instance.id" in answer.partial_success.error_message
        view = sc_.state.view(run.run_id)
        assert view is not None and view["instance"].startswith("derived:h:7:")


def test_a_late_tick_defers_its_judgement_once_and_never_for_long() -> None:
    """TickGate: on time, judge; woken late (the loop was blocked), defer to the next
    tick; late at every tick, still judge once MAX_DEAF_DEFER_S has passed."""
    from sidecar._server import MAX_DEAF_DEFER_S, TickGate

    gate = TickGate(slack=0.2)
    assert gate.admit(asked=10.0, woke=10.15)  # jitter inside the slack
    assert not gate.admit(asked=10.4, woke=12.9)  # a 2.5 s stall
    assert gate.admit(asked=13.1, woke=13.1)  # the next tick, on time, judges
    t, admitted = 20.0, []
    while t < 20.0 + 2 * MAX_DEAF_DEFER_S:  # every tick 0.5 s late
        admitted.append((t, gate.admit(asked=t, woke=t + 0.5)))
        t += 0.7
    judged = [at for at, ok in admitted if ok]
    assert judged, "a loop late at every tick must still judge"
    assert judged[0] - 20.0 <= MAX_DEAF_DEFER_S + 0.7
    assert not admitted[0][1]


def test_a_tick_judges_up_to_the_oldest_request_still_waiting_for_its_commit() -> None:
    """judged_as_of: now when nothing waits; while a request waits for its commit (the
    database held the intake), its arrival, as its agent was heard then and waits for
    the answer; on replicas, no later than the last read of the others' writes began;
    never more than MAX_DEAF_DEFER_S back, so a database that never answers still
    orphans the dead."""
    from sidecar._server import MAX_DEAF_DEFER_S, judged_as_of

    assert judged_as_of(100.0, 100.0, 100.0) == 100.0
    assert judged_as_of(100.0, 98.5, 100.0) == 98.5
    assert judged_as_of(100.0, 99.0, 99.8) == 99.0
    assert judged_as_of(100.0, 100.0, 99.8) == 99.8
    assert judged_as_of(100.0, 60.0, 100.0) == 100.0 - MAX_DEAF_DEFER_S
    assert judged_as_of(100.0, 100.0, float("inf")) == 100.0


async def test_the_orphan_tick_never_judges_past_a_request_waiting_for_its_commit(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The tick loop's side of judged_as_of: while a request heard at T still waits for
    its commit (its agent waits for the answer), a silence that began before T is not
    judged past T; once it is answered, the silence counts."""
    settings = settings_for(tmp_path, tick_interval=0.02, idle_timeout=3600.0)
    async with Sidecar(settings, clock=clock) as sidecar:
        run = open_run(instance="agent-1")
        await export_http(sidecar, run.spans())
        for _ in range(4):  # beats 1 s apart: its window is learned (3 s)
            clock.now += 1.0
            await export_http(sidecar, heartbeat_spans("agent-1", [run.run_id], clock.now))
        waiting = asyncio.get_running_loop().create_future()
        sidecar._unfolded[waiting] = clock.now  # heard now, its COMMIT not done
        clock.now += 4.0  # past the 3 s window, inside the 5 s bound
        for _ in range(10):  # ticks run meanwhile
            await asyncio.sleep(0.05)
            assert sidecar.state.status(run.run_id) == sc.STATE_RUNNING
        del sidecar._unfolded[waiting]
        for _ in range(200):
            if sidecar.state.status(run.run_id) == sc.STATE_ORPHANED:
                break
            await asyncio.sleep(0.02)
        assert sidecar.state.status(run.run_id) == sc.STATE_ORPHANED


# --- a step of the sidecar's clock (NTP, a VM resumed) is no silence ----------------------


def test_a_step_of_the_clock_is_told_against_the_steady_clock() -> None:
    """ClockSteps: the wall clock moving with the steady one is time passing; moving
    apart by more than STEP_SLACK_S between two readings is a step, told once; a clock
    slewed a little at every reading never adds up to one."""
    from sidecar._server import STEP_SLACK_S, ClockSteps

    steps = ClockSteps()
    assert steps.read(wall=1000.0, steady=5.0) == 0.0  # the first reading: a reference
    assert steps.read(wall=1030.0, steady=35.0) == 0.0  # 30 s passed
    assert steps.read(wall=1150.25, steady=35.25) == 120.0  # stepped forward
    assert steps.read(wall=1150.5, steady=35.5) == 0.0  # told once
    assert steps.read(wall=-2449.5, steady=35.5) == -3600.0  # stepped back
    wall, steady = -2449.5, 35.5
    for _ in range(100):  # slewed 0.5 s a reading, 50 s in all: never a step
        wall, steady = wall + 1.5, steady + 1.0
        assert steps.read(wall, steady) == 0.0
    assert steps.read(wall + STEP_SLACK_S * 0.9, steady) == 0.0


async def _beating(sidecar: Sidecar, clock: FakeClock, instance: str) -> tuple[str, float]:
    """An open run whose agent sent its spans, then five heartbeats a second apart (its
    window is learned: 3 s); the run id and the agent's own clock at its last beat."""
    run = open_run(instance=instance)
    await export_http(sidecar, run.spans())
    beat_at = clock.now  # the agent's clock: the sidecar's host is the one stepped
    for _ in range(5):
        clock.now += 1.0
        beat_at += 1.0
        await export_http(sidecar, heartbeat_spans(instance, [run.run_id], beat_at))
    return run.run_id, beat_at


async def _stays(sidecar: Sidecar, run_id: str, status: str) -> None:
    for _ in range(10):  # ticks run meanwhile
        await asyncio.sleep(0.02)
        assert sidecar.state.status(run_id) == status


async def _becomes(sidecar: Sidecar, run_id: str, status: str) -> None:
    for _ in range(3000):  # a loaded machine's late ticks defer judging (TickGate)
        if sidecar.state.status(run_id) == status:
            return
        await asyncio.sleep(0.01)
    assert sidecar.state.status(run_id) == status


async def test_a_step_forward_of_the_clock_orphans_no_live_agent(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The sidecar host's clock is stepped 120 s forward while its agent beats every
    second: no time passed, so the agent is not silent (docs/semantic-conventions.md,
    "Orphaned": never while alive); it beats on, and once it dies it is orphaned past its
    window, as on a clock never stepped."""
    settings = settings_for(tmp_path, tick_interval=0.02)
    async with Sidecar(settings, clock=clock, steady=clock.steady) as sidecar:
        run_id, beat_at = await _beating(sidecar, clock, "agent-1")
        clock.step(120.0)
        await _stays(sidecar, run_id, sc.STATE_RUNNING)
        clock.now += 1.0
        await export_http(sidecar, heartbeat_spans("agent-1", [run_id], beat_at + 1.0))
        clock.now += 2.5  # then it dies: still inside its 3 s window
        await _stays(sidecar, run_id, sc.STATE_RUNNING)
        clock.now += 1.0
        await _becomes(sidecar, run_id, sc.STATE_ORPHANED)


async def test_a_step_back_of_the_clock_spares_no_dead_agent(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Stepped an hour back, then the agent dies: it is orphaned once silent past its
    window (the contract's bound: within 30 s + 2 intervals), not an hour later when the
    clock has caught up."""
    settings = settings_for(tmp_path, tick_interval=0.02)
    async with Sidecar(settings, clock=clock, steady=clock.steady) as sidecar:
        run_id, _ = await _beating(sidecar, clock, "agent-1")
        clock.step(-3600.0)
        await _stays(sidecar, run_id, sc.STATE_RUNNING)  # heard a moment ago
        clock.now += 2.5
        await _stays(sidecar, run_id, sc.STATE_RUNNING)
        clock.now += 1.0
        await _becomes(sidecar, run_id, sc.STATE_ORPHANED)


async def test_a_heartbeat_received_after_a_step_is_not_moved_by_it(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A step is told at the first reading of the clock after it, not at the next tick:
    a heartbeat received between the step and the tick is on the new clock already, and
    moving it by the step too would make its agent an hour silent (stepped back) at once."""
    settings = settings_for(tmp_path, tick_interval=3600.0)  # ticks by hand only
    async with Sidecar(settings, clock=clock, steady=clock.steady) as sidecar:
        run_id, beat_at = await _beating(sidecar, clock, "agent-1")
        assert sidecar.tick() == []  # a tick before the step
        clock.step(-3600.0)
        clock.now += 1.0
        await export_http(sidecar, heartbeat_spans("agent-1", [run_id], beat_at + 1.0))
        assert sidecar.tick() == []
        clock.now += 2.5
        assert sidecar.tick() == []
        clock.now += 1.0
        assert [t.after for t in sidecar.tick()] == [sc.STATE_ORPHANED]


async def _under_recovery(sidecar: Sidecar, clock: FakeClock, ttl_s: float) -> tuple[str, Lease]:
    """A run whose agent died, orphaned, then taken up by recoverer "rec:1" under a lease
    of ``ttl_s``: its id and the lease."""
    run = open_run(instance="agent-1", t0=clock.now)
    await export_http(sidecar, run.spans())
    clock.now += sidecar.settings.idle_timeout + 1.0
    assert [t.after for t in sidecar.tick()] == [sc.STATE_ORPHANED]
    lease = await sidecar.lease(run.run_id, "grant", {"holder": "rec:1", "ttl_s": ttl_s})
    assert isinstance(lease, Lease), lease
    undo = RunScript(instance="recoverer", run_id=run.run_id, t0=clock.now)
    undo.unwind("recovery", "issue_credit", [])
    spans = [rejoin(s, run, token=lease.token) for s in undo.spans() if s.name != undo.run.name]
    await export_http(sidecar, spans)
    assert sidecar.state.status(run.run_id) != sc.STATE_ORPHANED
    return run.run_id, lease


async def test_a_step_forward_of_the_clock_ends_no_recovery_lease(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Stepped two minutes forward, more than the lease's time to live, while a recoverer
    works: no time passed, so its lease is live. A second recoverer is refused, the
    first renews, and its run, quiet through a long undo, is not orphaned (the step
    ended every live lease at once: a second recovery ran beside the first)."""
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock, steady=clock.steady) as sidecar:
        run_id, lease = await _under_recovery(sidecar, clock, ttl_s=30.0)
        clock.now += 6.0  # a long undo: quiet past the idle timeout
        database_clock_passes(sidecar, 6.0)
        clock.step(120.0)
        second = await sidecar.lease(run_id, "grant", {"holder": "rec:2"})
        assert not isinstance(second, Lease), "a second recoverer got the lease"
        assert second.reason == "held" and second.holder == "rec:1", second
        assert sidecar.tick() == [], "a run under a live lease was orphaned"
        ask = {"holder": "rec:1", "token": lease.token, "ttl_s": 30}
        assert isinstance(await sidecar.lease(run_id, "renew", ask), Lease)


async def test_a_step_back_of_the_clock_lengthens_no_recovery_lease(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Stepped an hour back while a recoverer holds a one-second lease, then the recoverer
    dies: once its lease has ended the run is orphaned again (paged) and another
    recoverer may take it, not an hour later when the clock has caught up."""
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock, steady=clock.steady) as sidecar:
        run_id, _ = await _under_recovery(sidecar, clock, ttl_s=1.0)
        clock.step(-3600.0)
        clock.now += 6.0  # the recoverer died: its lease ended, the run is quiet
        database_clock_passes(sidecar, 6.0)
        assert [t.after for t in sidecar.tick()] == [sc.STATE_ORPHANED]
        second = await sidecar.lease(run_id, "grant", {"holder": "rec:2"})
        assert isinstance(second, Lease) and second.token == 2, second
