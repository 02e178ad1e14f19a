"""Several sidecar endpoints: requests take them in turn, and a replica that dies
(SIGKILL) costs no acknowledged span: its unacknowledged spans go to the next one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from pg_server import PgServer
from prometheus_client import CollectorRegistry
from support import start_sidecar

from saga_otel import ConfigurationError, Saga, ToolRegistry, configure, tool
from saga_otel import semconv as sc
from saga_otel._acks import wait_for_ack
from saga_otel._config import ENV_SIDECAR_ENDPOINT
from saga_otel._state import STATE


@pytest.fixture
def fresh() -> Iterator[None]:
    yield
    STATE.reset()


def test_a_list_or_commas_name_several_endpoints(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = TracerProvider(shutdown_on_exit=False)
    export = configure(
        ["http://127.0.0.1:1", "http://127.0.0.1:2/"],
        tracer_provider=provider,
        registry=CollectorRegistry(),
        presence=False,
    )
    assert export.processor is not None
    assert export.processor.endpoints == (
        "http://127.0.0.1:1/v1/traces",
        "http://127.0.0.1:2/v1/traces",
    )
    export.shutdown(timeout=0.5)
    monkeypatch.setenv(ENV_SIDECAR_ENDPOINT, " http://a:4318 , http://b:4318,")
    export = configure(tracer_provider=provider, registry=CollectorRegistry(), presence=False)
    assert export.processor is not None
    assert export.processor.endpoints == ("http://a:4318/v1/traces", "http://b:4318/v1/traces")
    export.shutdown(timeout=0.5)
    with pytest.raises(ConfigurationError, match=r"'ftp://b' is not an http\(s\) URL"):
        configure(["http://a:4318", "ftp://b"], tracer_provider=provider)
    with pytest.raises(ConfigurationError, match="names no URL"):
        configure(" , ", tracer_provider=provider)
    with pytest.raises(ConfigurationError, match="names no URL"):
        configure([], tracer_provider=provider, durable=False)


class _Answers:
    """A loopback OTLP receiver that answers every request with one status."""

    def __init__(self, status: int, retry_after: str | None = None) -> None:
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests += 1
                self.send_response(status)
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_replica_answering_503_is_skipped_and_its_spans_acknowledged_by_the_next(
    fresh: None,
) -> None:
    bad, good = _Answers(503, retry_after="30"), _Answers(200)
    registry = CollectorRegistry()
    provider = TracerProvider(shutdown_on_exit=False)
    export = configure(
        [bad.url, good.url],
        tracer_provider=provider,
        registry=registry,
        presence=False,
        ack_timeout=5.0,
        retry_max=0.2,
        logger=_Quiet(),
    )
    try:
        tracer = provider.get_tracer("test")
        for i in range(6):
            span = tracer.start_span(
                f"saga.do step{i}",
                attributes={
                    sc.SAGA_PHASE: sc.PHASE_DO,
                    sc.SAGA_RUN_ID: "run-1",
                    sc.SAGA_NAME: "refund",
                    sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
                },
            )
            span.end()
            assert wait_for_ack(span) is True  # at once from the next endpoint
        # The 503 said "not for 30 s": it was asked once, the other took every span.
        assert bad.requests == 1
        assert good.requests >= 6
        assert not registry.get_sample_value(sc.M_EXPORT_FAILURES, {"reason": "sidecar_down"})
    finally:
        export.shutdown(timeout=1.0)
        bad.stop()
        good.stop()


def _tools() -> ToolRegistry:
    def credit(ref: int) -> dict[str, Any]:
        return {"ref": ref}

    def undo(ref: int) -> None:
        return None

    return ToolRegistry(
        [
            tool(
                "compensable",
                name="credit",
                compensate="undo",
                compensate_args=lambda i: {"ref": i.result["ref"]},
            )(credit),
            tool("convergent", name="undo")(undo),
        ]
    )


def _received(api: str) -> float:
    text = httpx.get(f"{api}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(sc.M_SIDECAR_SPANS_RECEIVED) and 'outcome="accepted"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_killed_replica_costs_no_acknowledged_span(
    fresh: None, postgres: PgServer, tmp_path: Path
) -> None:
    name = postgres.create()
    try:
        url = postgres.url(name)
        a = start_sidecar(tmp_path, db=url)
        b = start_sidecar(tmp_path, db=url)
        registry = CollectorRegistry()
        provider = TracerProvider(shutdown_on_exit=False)
        export = configure(
            [a.otlp, b.otlp],
            tracer_provider=provider,
            registry=registry,
            retry_max=1.0,
            heartbeat_interval=0.2,
            logger=_Quiet(),
        )
        saga = Saga("failover", tools=_tools(), logger=_Quiet(), tracer_provider=provider)
        run_ids: list[str] = []

        async def one() -> None:
            async with saga.run() as run:
                run_ids.append(run.run_id)
                for i in range(3):
                    await run.call("credit", ref=i)

        try:
            for _ in range(8):
                asyncio.run(one())
            # Round robin: both replicas took spans.
            assert _received(a.api) > 0 and _received(b.api) > 0
            a.proc.kill()  # SIGKILL: its connections reset, its port refuses
            a.proc.wait()
            for _ in range(8):
                asyncio.run(one())
            assert export.force_flush(10_000)
            failures = {
                reason: registry.get_sample_value(sc.M_EXPORT_FAILURES, {"reason": reason})
                for reason in ("sidecar_down", "error", "rejected", "queue_full")
            }
            # Every step's wait was acknowledged (by one replica or the other).
            assert not any(failures.values()), failures
        finally:
            export.shutdown(timeout=2.0)
        # Every run, acknowledged before or after the kill, is whole at the survivor.
        for run_id in run_ids:
            view = httpx.get(f"{b.api}/runs/{run_id}", timeout=5).json()
            assert view["status"] == sc.STATUS_COMPLETED, view
            assert [s["ok"] for s in view["steps"]] == [True, True, True]
        b.stop()
    finally:
        postgres.drop(name)


class _Quiet:
    """A logger that drops everything (the failover warnings are expected here)."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *a, **k: None
