"""No blocking call on the event loop: an async unwind against a slow sidecar.

A real OTLP/HTTP receiver on loopback answers every export only after DELAY
seconds, so each durable acknowledgement takes that long. While an async run
(``run.call``) and an ``observed()`` async runner unwind, a ticker task sleeps
1 ms at a time and records the longest gap between its wake-ups: a blocking
ack wait on the loop shows up as a gap of about DELAY.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from saga_otel import RunStatus, Saga, configure, observed, observed_run, tool
from saga_otel import semconv as sc

DELAY = 0.6  # the slow sidecar's answer time, under the ack bound below
ACK_TIMEOUT = 1.5
# A wait that blocked the loop blocks it for DELAY. A busy 2-core CI host has shown gaps
# of 158 ms with nothing blocking (DELAY was 0.3 s and this bound 150 ms): half of DELAY
# keeps the two apart.
MAX_LAG = DELAY / 2


class SlowSidecar:
    """Answers each OTLP export 200 after DELAY seconds; counts the spans' requests."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.requests = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                time.sleep(DELAY)
                with outer.lock:
                    outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def provider(port: int) -> Iterator[TracerProvider]:
    sidecar = SlowSidecar(port)
    tp = TracerProvider(shutdown_on_exit=False)
    export = configure(
        sidecar.url, tracer_provider=tp, ack_timeout=ACK_TIMEOUT, registry=CollectorRegistry()
    )
    yield tp
    export.shutdown(timeout=1.0)
    tp.shutdown()
    sidecar.stop()


async def _max_lag_while(work: Any) -> tuple[float, float]:
    """(longest gap between 1 ms ticks, seconds the work took)."""
    stop = asyncio.Event()
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    try:
        await work
    finally:
        took = time.perf_counter() - t0
        stop.set()
        await tick
    return max(gaps), took


async def test_async_unwind_of_a_run_never_blocks_the_loop(provider: TracerProvider) -> None:
    undone: list[str] = []

    @tool("compensable", compensate="release", compensate_args=lambda i: {"hold": i.result})
    def hold(n: int) -> int:
        return n

    @tool("convergent")
    async def release(hold: int) -> None:
        undone.append(f"hold {hold}")

    saga = Saga(
        "lag", tools=[hold, release], tracer_provider=provider, registry=CollectorRegistry()
    )
    run = saga.run()

    async def agent() -> None:
        try:
            async with run:
                await run.call("hold", n=1)  # waits for the push's ack (DELAY)
                await run.call("hold", n=2)
                raise RuntimeError("the agent failed")
        except RuntimeError:
            pass

    lag, took = await _max_lag_while(agent())
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert undone == ["hold 2", "hold 1"]
    # Five durable waits (two pushes, the unwind, two undos) really waited...
    assert took >= 4 * DELAY * 0.9, took
    # ...and the loop stayed free all along.
    assert lag < MAX_LAG, f"event loop blocked for {lag * 1000:.0f} ms"


class Hold:
    """A user's own async step."""

    name = "hold"

    def __init__(self) -> None:
        self.undone = False

    async def do(self, n: int) -> int:
        return n

    async def compensate(self) -> None:
        self.undone = True


async def test_async_unwind_of_observed_steps_never_blocks_the_loop(
    provider: TracerProvider,
) -> None:
    kw: dict[str, Any] = {"saga": "lag", "tracer_provider": provider}
    kw["registry"] = CollectorRegistry()
    target = Hold()
    step = observed(target, compensation=lambda i: {"hold": i.result}, **kw)

    async def runner() -> None:
        try:
            with observed_run(**kw) as run:
                await step.do(1)  # waits for the push's ack (DELAY)
                try:
                    raise RuntimeError("the runner failed")
                except RuntimeError:
                    await step.compensate()  # the unwind span's ack, then the undo
                    run.status = sc.STATUS_COMPENSATED
                    raise
        except RuntimeError:
            pass

    lag, took = await _max_lag_while(runner())
    assert target.undone
    assert took >= 2 * DELAY * 0.9, took
    assert lag < MAX_LAG, f"event loop blocked for {lag * 1000:.0f} ms"
