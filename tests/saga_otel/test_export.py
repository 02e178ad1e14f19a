"""saga_otel._export against a real OTLP/HTTP receiver on loopback.

The receiver stands in for the sidecar: it decodes each ExportTraceServiceRequest
before answering, so "received" is always true by the time the exporter sees
the answer. Statuses and a stall can be scripted per test.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from saga_otel import _export
from saga_otel import semconv as sc
from saga_otel._errors import ConfigurationError
from saga_otel._export import (
    configure,
    register_open_run,
    unregister_open_run,
    wait_for_ack,
    wait_for_ack_async,
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------
# the fake sidecar


@dataclass(frozen=True, slots=True)
class Got:
    name: str
    span_id: int
    attrs: dict[str, Any]
    resource: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.spans: list[Got] = []
        self.requests: list[dict[str, str]] = []  # headers of every request, answered or not
        self.statuses: list[int] = []  # scripted answers, consumed first; then 200
        self.answer = b""  # body of a 200 (e.g. an OTLP partial success)
        self.stall = threading.Event()  # set => requests wait for `release` first
        self.release = threading.Event()
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with rx.lock:
                    rx.requests.append({k.lower(): v for k, v in self.headers.items()})
                    status = rx.statuses.pop(0) if rx.statuses else 200
                if rx.stall.is_set():
                    rx.release.wait(2.0)
                if status == 200 and self.path == "/v1/traces":
                    req = ExportTraceServiceRequest.FromString(body)
                    with rx.lock:
                        for rs in req.resource_spans:
                            res = {a.key: _value(a.value) for a in rs.resource.attributes}
                            for ss in rs.scope_spans:
                                for s in ss.spans:
                                    rx.spans.append(
                                        Got(
                                            s.name,
                                            int.from_bytes(s.span_id, "big"),
                                            {a.key: _value(a.value) for a in s.attributes},
                                            res,
                                        )
                                    )
                elif status == 200:
                    status = 404
                answer = rx.answer if status == 200 else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def names(self) -> list[str]:
        with self.lock:
            return [g.name for g in self.spans]

    def by_id(self, span_id: int) -> list[Got]:
        with self.lock:
            return [g for g in self.spans if g.span_id == span_id]

    def heartbeats(self) -> list[Got]:
        with self.lock:
            return [g for g in self.spans if g.name == sc.HEARTBEAT_SPAN_NAME]


class RecordingLogger:
    """Stands in for a structlog logger; records (level, event, fields)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.fail = fail

    def _rec(self, level: str, event: str, **kw: Any) -> None:
        self.calls.append((level, event, kw))
        if self.fail:
            raise RuntimeError("logging is broken")

    def error(self, event: str, **kw: Any) -> None:
        self._rec("error", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._rec("warning", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._rec("info", event, **kw)

    def reasons(self) -> list[str]:
        return [kw["reason"] for _, ev, kw in self.calls if ev == sc.EV_EXPORT_FAILED]


def until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll until cond() holds; the bound only keeps a broken test from hanging."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


# --------------------------------------------------------------------------
# fixtures


@pytest.fixture
def receiver(port: int) -> Iterator[Receiver]:
    rx = Receiver(port).start()
    yield rx
    rx.stop()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def provider() -> Iterator[TracerProvider]:
    tp = TracerProvider(shutdown_on_exit=False)
    yield tp
    tp.shutdown()


@pytest.fixture
def log() -> RecordingLogger:
    return RecordingLogger()


@pytest.fixture
def setup(
    provider: TracerProvider, registry: CollectorRegistry, log: RecordingLogger
) -> Iterator[Callable[..., _export.SidecarExport]]:
    made: list[_export.SidecarExport] = []

    def make(endpoint: str | None, **kw: Any) -> _export.SidecarExport:
        kw.setdefault("tracer_provider", provider)
        kw.setdefault("registry", registry)
        kw.setdefault("logger", log)
        kw.setdefault("retry_initial", 0.02)
        kw.setdefault("retry_max", 0.1)
        export = configure(endpoint, **kw)
        made.append(export)
        return export

    yield make
    for export in made:
        export.shutdown(timeout=1.0)


def failures(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value(sc.M_EXPORT_FAILURES, {"reason": reason}) or 0.0


def saga_span(provider: TracerProvider, name: str = "saga.do charge", phase: str = sc.PHASE_DO):
    tracer = provider.get_tracer("test")
    span = tracer.start_span(
        name,
        attributes={
            sc.SAGA_PHASE: phase,
            sc.SAGA_RUN_ID: "run-1",
            sc.SAGA_NAME: "refund",
            sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
            sc.SAGA_COMPENSATION_TOOL: "refund_charge",
        },
    )
    return span


# --------------------------------------------------------------------------
# tests


def test_only_saga_spans_are_sent(receiver: Receiver, setup: Any, provider: TracerProvider) -> None:
    export = setup(receiver.url)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("http GET /users"):
        pass
    span = saga_span(provider)
    span.end()
    with tracer.start_as_current_span("db query", attributes={"db.system": "sqlite"}):
        pass
    assert export.force_flush(5.0)
    assert receiver.names() == ["saga.do charge"]


def test_span_is_received_before_ack_returns(
    receiver: Receiver, setup: Any, provider: TracerProvider, registry: CollectorRegistry
) -> None:
    export = setup(receiver.url, ack_timeout=5.0)
    assert export.durable and export.endpoint == receiver.url + "/v1/traces"
    for i in range(20):
        span = saga_span(provider, f"saga.do step{i}")
        span.end()
        assert wait_for_ack(span) is True
        got = receiver.by_id(span.get_span_context().span_id)
        assert [g.name for g in got] == [f"saga.do step{i}"]
        assert got[0].attrs[sc.SAGA_COMPENSATION_TOOL] == "refund_charge"
    assert failures(registry, "timeout") == 0
    # Acknowledged tickets do not linger.
    assert not _export._tickets


async def test_async_ack_does_not_block_the_loop(
    receiver: Receiver, setup: Any, provider: TracerProvider
) -> None:
    setup(receiver.url, ack_timeout=5.0)
    receiver.stall.set()  # the answer waits until we release it from the loop
    span = saga_span(provider)
    span.end()
    waiting = asyncio.create_task(wait_for_ack_async(span))
    # If the wait blocked the loop, this coroutine could not run to release it.
    assert await asyncio.to_thread(until, lambda: len(receiver.requests) == 1)
    await asyncio.sleep(0)
    assert not waiting.done()
    receiver.release.set()
    assert await waiting is True
    assert receiver.by_id(span.get_span_context().span_id)


async def test_async_ack_timeout_returns_false(
    provider: TracerProvider, setup: Any, registry: CollectorRegistry, log: RecordingLogger
) -> None:
    setup(f"http://127.0.0.1:{free_port()}", ack_timeout=0.1)  # nothing listens
    span = saga_span(provider)
    span.end()
    assert await wait_for_ack_async(span) is False
    assert failures(registry, "timeout") == 1
    assert "timeout" in log.reasons()


def test_receiver_down_then_back(
    port: int,
    setup: Any,
    provider: TracerProvider,
    registry: CollectorRegistry,
    log: RecordingLogger,
) -> None:
    export = setup(f"http://127.0.0.1:{port}", ack_timeout=0.2)
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is False  # bounded, never raised
    assert failures(registry, "timeout") == 1
    assert "timeout" in log.reasons() and "error" in log.reasons()  # outage logged
    # The sidecar comes back: the buffered span goes through.
    rx = Receiver(port).start()
    try:
        assert export.force_flush(10.0)
        assert rx.by_id(span.get_span_context().span_id)
        # And the next step's span is acknowledged normally.
        nxt = saga_span(provider, "saga.do next")
        nxt.end()
        assert wait_for_ack(nxt) is True
        assert any(ev == "saga.export.recovered" for _, ev, _ in log.calls)
    finally:
        rx.stop()


@pytest.mark.parametrize("first", [[500], [429], [503, 500, 429]])
def test_retryable_statuses_are_retried(
    receiver: Receiver,
    setup: Any,
    provider: TracerProvider,
    registry: CollectorRegistry,
    first: list[int],
) -> None:
    receiver.statuses = list(first)
    setup(receiver.url, ack_timeout=10.0)
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is True
    assert len(receiver.requests) == len(first) + 1
    assert len(receiver.by_id(span.get_span_context().span_id)) == 1
    assert all(failures(registry, r) == 0 for r in ("timeout", "rejected", "error"))


def test_4xx_is_dropped_and_counted(
    receiver: Receiver,
    setup: Any,
    provider: TracerProvider,
    registry: CollectorRegistry,
    log: RecordingLogger,
) -> None:
    receiver.statuses = [400]
    export = setup(receiver.url, ack_timeout=5.0)
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is False
    assert failures(registry, "rejected") == 1
    assert failures(registry, "timeout") == 0  # counted once, as lost, not again as late
    assert log.reasons().count("rejected") == 2  # the drop, and the step's view
    assert len(receiver.requests) == 1  # not resent
    after = saga_span(provider, "saga.do after")
    after.end()
    assert wait_for_ack(after) is True
    assert export.force_flush(1.0)
    assert not receiver.by_id(span.get_span_context().span_id)


def test_partial_success_rejections_are_counted(
    receiver: Receiver,
    setup: Any,
    provider: TracerProvider,
    registry: CollectorRegistry,
    log: RecordingLogger,
) -> None:
    receiver.answer = ExportTraceServiceResponse(
        partial_success=ExportTracePartialSuccess(rejected_spans=1, error_message="bad")
    ).SerializeToString()
    export = setup(receiver.url)
    saga_span(provider).end()
    assert export.force_flush(5.0)
    assert failures(registry, "rejected") == 1
    assert "rejected" in log.reasons()


def test_slow_receiver_bounded_wait(
    receiver: Receiver, setup: Any, provider: TracerProvider, registry: CollectorRegistry
) -> None:
    receiver.stall.set()  # each answer takes up to 2 s
    setup(receiver.url, ack_timeout=0.2)
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is False
    assert failures(registry, "timeout") == 1
    receiver.release.set()
    # The span still arrives: a late ack is a miss, not a loss.
    assert until(lambda: bool(receiver.by_id(span.get_span_context().span_id)))


def test_queue_full_is_counted(
    port: int,
    setup: Any,
    provider: TracerProvider,
    registry: CollectorRegistry,
    log: RecordingLogger,
) -> None:
    setup(f"http://127.0.0.1:{port}", ack_timeout=0.05, max_queue_size=2)  # nothing listens
    spans = [saga_span(provider, f"saga.do s{i}") for i in range(5)]
    for s in spans:
        s.end()
    assert failures(registry, "queue_full") == 3
    assert log.reasons().count("queue_full") == 1  # logged once per episode
    assert wait_for_ack(spans[4]) is False  # the dropped span is not "acknowledged"
    assert failures(registry, "queue_full") == 3  # and not counted twice


def test_never_raises_with_broken_logger(
    port: int, setup: Any, provider: TracerProvider, registry: CollectorRegistry
) -> None:
    setup(f"http://127.0.0.1:{port}", ack_timeout=0.05, logger=RecordingLogger(fail=True))
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is False
    assert failures(registry, "timeout") == 1
    assert wait_for_ack(object()) is True  # not a span at all: nothing to wait for


def test_no_durable_processor_returns_true(
    receiver: Receiver, setup: Any, provider: TracerProvider
) -> None:
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is True  # nothing configured
    export = setup(receiver.url, durable=False)
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is True
    assert export.force_flush(5.0)
    assert receiver.by_id(span.get_span_context().span_id)  # still exported, just not awaited
    no_endpoint = setup(None)
    assert no_endpoint.processor is None and not no_endpoint.durable


def test_heartbeats_while_runs_are_open(
    receiver: Receiver, setup: Any, provider: TracerProvider
) -> None:
    export = setup(receiver.url, heartbeat_interval=0.02)
    register_open_run("run-a")
    register_open_run("run-b")
    try:
        assert until(lambda: len(receiver.heartbeats()) >= 3)
    finally:
        unregister_open_run("run-a")
        unregister_open_run("run-b")
    hb = receiver.heartbeats()[-1]
    assert hb.attrs[sc.SAGA_PHASE] == sc.PHASE_HEARTBEAT
    assert hb.attrs[sc.SAGA_CONTRACT_VERSION] == 1
    assert hb.attrs[sc.SAGA_HEARTBEAT_OPEN_RUNS] == ["run-a", "run-b"]
    assert hb.attrs[sc.SAGA_HEARTBEAT_INTERVAL_S] == 0.02
    assert sc.SAGA_RUN_ID not in hb.attrs
    # Stopped: at most one beat that had already read the set, then none for many intervals.
    assert export.force_flush(5.0)
    settled = len(receiver.heartbeats())
    time.sleep(0.4)  # 20 intervals
    assert export.force_flush(5.0)
    assert len(receiver.heartbeats()) <= settled + 1
    assert all(h.attrs[sc.SAGA_HEARTBEAT_OPEN_RUNS] for h in receiver.heartbeats())


def test_otlp_headers_env_reaches_the_receiver(
    receiver: Receiver, setup: Any, provider: TracerProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Bearer%20s3cret,x-team=pay")
    export = setup(receiver.url, headers={"x-extra": "1"})
    saga_span(provider).end()
    assert export.force_flush(5.0)
    h = receiver.requests[0]
    assert h["authorization"] == "Bearer s3cret"
    assert h["x-team"] == "pay" and h["x-extra"] == "1"
    assert h["content-type"] == "application/x-protobuf"


def test_endpoint_from_env(
    receiver: Receiver, setup: Any, provider: TracerProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_export.ENV_SIDECAR_ENDPOINT, receiver.url + "/")
    export = setup(None)
    assert export.endpoint == receiver.url + "/v1/traces"
    assert export.durable
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is True
    # A URL that has a path is used as given.
    assert setup(receiver.url + "/custom/traces").endpoint == receiver.url + "/custom/traces"


@pytest.mark.parametrize(
    "bad", ["127.0.0.1:4318", "grpc://127.0.0.1:4317", "localhost", "http://", "file:///tmp/x"]
)
def test_bad_url_is_a_clear_configuration_error(setup: Any, bad: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        setup(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    assert "SAGA_OTEL_SIDECAR_ENDPOINT" in msg and "http://127.0.0.1:4318" in msg


def test_other_configuration_errors(setup: Any) -> None:
    with pytest.raises(ConfigurationError, match="durable=True needs a sidecar endpoint"):
        setup(None, durable=True)
    with pytest.raises(ConfigurationError, match="not an OpenTelemetry SDK TracerProvider"):
        setup("http://127.0.0.1:4318", tracer_provider=object())


def test_shutdown_stops_threads(receiver: Receiver, setup: Any, provider: TracerProvider) -> None:
    export = setup(receiver.url, heartbeat_interval=0.02)
    register_open_run("run-z")
    try:
        assert until(lambda: len(receiver.heartbeats()) >= 1)
        span = saga_span(provider)
        span.end()
        threads = [export.processor._thread, export._heartbeat._thread]
        assert all(t is not None and t in threading.enumerate() for t in threads)
        export.shutdown(timeout=2.0)
        assert receiver.by_id(span.get_span_context().span_id)  # flushed on the way out
        alive = threading.enumerate()
        assert all(t not in alive for t in threads)
        assert _export._active is None
        saga_span(provider).end()  # after shutdown: ignored, and no error
    finally:
        unregister_open_run("run-z")


def test_configure_again_replaces_previous(
    receiver: Receiver, setup: Any, provider: TracerProvider
) -> None:
    first = setup(receiver.url)
    second = setup(receiver.url)
    assert first.processor is not None
    assert not first.processor._thread.is_alive()
    assert _export._active is second
    span = saga_span(provider)
    span.end()
    assert wait_for_ack(span) is True
    assert second.force_flush(5.0)
    assert len(receiver.by_id(span.get_span_context().span_id)) == 1  # sent once, not twice


def test_global_provider_made_with_resource_and_flushed_at_exit(receiver: Receiver) -> None:
    # A fresh process: the global provider can be set only once per process.
    script = textwrap.dedent(
        f"""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from saga_otel import semconv as sc
        from saga_otel._export import configure
        export = configure({receiver.url!r})
        assert isinstance(trace.get_tracer_provider(), TracerProvider)
        assert export.tracer_provider is trace.get_tracer_provider()
        again = configure({receiver.url!r})  # attaches to the global SDK provider
        assert again.tracer_provider is export.tracer_provider
        span = trace.get_tracer("t").start_span("saga.run refund", attributes={{
            sc.SAGA_PHASE: sc.PHASE_RUN, sc.SAGA_RUN_ID: "r"}})
        span.end()  # not awaited: the atexit handler must flush it
        """
    )
    env = {**os.environ, "OTEL_SERVICE_NAME": "refund-agent"}
    env.pop("OTEL_RESOURCE_ATTRIBUTES", None)
    env.pop(_export.ENV_SIDECAR_ENDPOINT, None)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert until(lambda: "saga.run refund" in receiver.names())
    got = receiver.spans[0]
    assert got.resource[sc.SERVICE_NAME] == "refund-agent"
    assert len(got.resource[sc.SERVICE_INSTANCE_ID]) == 36  # a uuid4


# --------------------------------------------------------------------------
# the five kinds of run, over a real OTLP/HTTP export


class _Wire:
    """A received span in the shape contract_violations() reads."""

    def __init__(self, got: Got) -> None:
        self.name = got.name
        # Arrays arrive as lists; the SDK hands them over as tuples.
        self.attributes = {k: tuple(v) if isinstance(v, list) else v for k, v in got.attrs.items()}


async def _five_runs(provider: TracerProvider, registry: CollectorRegistry) -> list[str]:
    from examples.refund_agent import run_refund
    from examples.refund_tools import refund_tools
    from examples.release_saga import Release, release
    from examples.world import World
    from saga_otel import RetryPolicy, Saga
    from saga_otel.testing import FailureInjector

    kw: dict[str, Any] = {"tracer_provider": provider, "registry": registry}
    statuses = []
    for world, close_fails in ((World(), False), (World(mail_down=True), False), (World(), True)):
        saga = Saga("refund", tools=refund_tools(world, close_fails=close_fails), **kw)
        statuses.append((await run_refund(saga)).status.value)
    broken = FailureInjector().fail("reverse_credit", phase="compensate")
    saga = Saga(
        "refund",
        tools=broken.wrap(refund_tools(World(mail_down=True))),
        retry=RetryPolicy(attempts=2, initial=0, jitter=0),
        **kw,
    )
    statuses.append((await run_refund(saga)).status.value)
    bad = Release(World(), {}, "x" * 99)
    statuses.append((await release(Saga("release", **kw), bad)).status.value)
    return statuses


async def test_all_five_kinds_of_run_keep_the_contract_over_otlp_http(
    receiver: Receiver, setup: Any, provider: TracerProvider, registry: CollectorRegistry
) -> None:
    from saga_otel.testing import contract_violations

    export = setup(receiver.url)
    statuses = await _five_runs(provider, registry)
    assert statuses == ["completed", "compensated", "stuck", "compensation_failed", "rejected"]
    assert export.force_flush(5.0)
    run_spans = [g for g in receiver.spans if g.attrs.get(sc.SAGA_PHASE) == sc.PHASE_RUN]
    assert sorted(g.attrs[sc.SAGA_RUN_STATUS] for g in run_spans) == sorted(statuses)
    saga_spans = [_Wire(g) for g in receiver.spans if sc.SAGA_PHASE in g.attrs]
    assert contract_violations(saga_spans) == []  # type: ignore[arg-type]
    phases = {g.attrs[sc.SAGA_PHASE] for g in receiver.spans}
    assert phases >= {"run", "do", "validate", "unwind", "compensate", "escalate"}


async def test_a_slow_or_down_sidecar_changes_no_saga_outcome(
    receiver: Receiver, setup: Any, provider: TracerProvider, registry: CollectorRegistry
) -> None:
    setup(receiver.url, ack_timeout=0.05)
    receiver.stall.set()  # every request hangs well past the ack bound
    slow = await _five_runs(provider, registry)
    receiver.release.set()
    receiver.stop()  # and now nothing listens at all
    down = await _five_runs(provider, registry)
    expected = ["completed", "compensated", "stuck", "compensation_failed", "rejected"]
    assert slow == expected and down == expected
    assert failures(registry, "timeout") > 0
