"""Sidecar replicas on PostgreSQL: ingest with 1 and 3 replicas, unwind -> alert through 3.

PostgreSQL is started the way the tests start it (``tests/pg_server.py``: initdb and
pg_ctl into a temporary folder, loopback, fsync off as in the tests; the figures
measure the sidecar's side, not a disk). Each sidecar is a ``saga-sidecar serve``
process with ``--db postgresql://...``.

Ingest: the same load generator and bodies as ``bench_sidecar`` (distinct saga do
spans, CONCURRENCY requests in flight); with 3 replicas the requests go round robin
over them, as a plain load balancer would. Reference: the same parse-only OTLP/HTTP
server as the SQLite rows, measured just before in the same run.

Alerts: as ``bench_alerts``, the measuring agent exports a run's do span to one
replica and its unwind span to the next; every replica has the webhook sink; the
clock runs from the unwind export's start to the webhook's receipt of
SagaCompensationStarted (delivered once across the replicas: counted). Background
load: one load process per replica.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult

from bench._figures import Figure
from bench._loadgen import drive
from bench.bench_alerts import _LOAD, _Agent, _Hook, _pct
from bench.bench_sidecar import BATCH, CONCURRENCY, _bodies, _start_reference, _stop

ROOT = Path(__file__).resolve().parent.parent
AREA = "replicas"
SAMPLES = 200
WARMUP = 20
LOAD_SPANS_PER_S = 1300  # in all, split over the replicas (as bench_alerts)


def _pg() -> Any:
    """tests/pg_server.py's PgServer (the tests' own way to start PostgreSQL)."""
    sys.path.insert(0, str(ROOT / "tests"))
    return importlib.import_module("pg_server").PgServer()


def _serve(url: str, *extra: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    proc = subprocess.Popen(
        [
            sys.executable, "-c", "from sidecar._cli import main; main()", "serve",
            "--otlp-http-port=0", "--otlp-grpc-port=0", "--api-port=0", f"--db={url}",
            "--idle-timeout=1h", "--log-level=WARNING", *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("saga-sidecar serve (PostgreSQL) did not start")
    info = json.loads(line)
    return proc, {k: int(info[k]) for k in ("otlp_http", "api")}


def _ingest(
    progress: Callable[[str], None], server: Any, replicas: int, per_request: int, n: int
) -> tuple[float, float]:
    """(sidecars, reference) requests/s for the same bodies."""
    warm = _bodies(max(4, n // 20), per_request, seed=9)
    bodies = _bodies(n, per_request, seed=1)
    proc, port = _start_reference()
    try:
        drive(port, warm, CONCURRENCY)
        ref = n / drive(port, bodies, CONCURRENCY)
    finally:
        _stop(proc)
    name = server.create()
    procs = []
    try:
        for _ in range(replicas):
            procs.append(_serve(server.url(name)))
        ports = [p["otlp_http"] for _, p in procs]
        drive(ports, warm, CONCURRENCY)
        side = n / drive(ports, bodies, CONCURRENCY)
    finally:
        for p, _ in procs:
            _stop(p)
        server.drop(name)
    progress(
        f"ingest {per_request}-span requests, {replicas} replica(s): {side:,.0f} req/s, "
        f"reference {ref:,.0f} req/s"
    )
    return side, ref


def _alerts(
    progress: Callable[[str], None], server: Any
) -> tuple[list[float], list[float], int, float]:
    name = server.create()
    procs = []
    with _Hook() as hook:
        try:
            for _ in range(3):
                procs.append(
                    _serve(
                        server.url(name),
                        f"--webhook={hook.url}",
                        "--no-alert-log",
                    )
                )
            otlps = [f"http://127.0.0.1:{p['otlp_http']}" for _, p in procs]
            agents = [_Agent(o) for o in otlps]
            for i, agent in enumerate(agents):
                # Each run's do span to one replica, its unwind (timed) and end to the next.
                agent.exporter = _Split(agent.exporter, agents[(i + 1) % 3].exporter)  # type: ignore[assignment]
            alert_ms: list[float] = []
            export_ms: list[float] = []

            def one(i: int) -> tuple[float, float]:
                return agents[i % 3].one(hook)

            for i in range(WARMUP):
                one(i)
            duration = SAMPLES * 0.05 + 5
            loads = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _LOAD,
                        o,
                        "20",
                        str(LOAD_SPANS_PER_S / 3),
                        str(duration),
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for o in otlps
            ]
            time.sleep(1.0)
            progress(f"alerts: {SAMPLES} unwinds through 3 replicas under background load")
            for i in range(SAMPLES):
                a, e = one(i)
                alert_ms.append(a)
                export_ms.append(e)
                time.sleep(0.02)
            rate = 0.0
            for load in loads:
                out, _ = load.communicate(timeout=duration + 60)
                stats = json.loads(out.strip().splitlines()[-1])
                rate += stats["spans"] / stats["seconds"]
            time.sleep(2.0)  # late duplicates, if any, would arrive by now
            deliveries, unique = hook.deliveries, len(hook.arrivals)
            for agent in agents:
                agent.close()
        finally:
            for p, _ in procs:
                _stop(p)
            server.drop(name)
    dupes = deliveries - unique
    return alert_ms, export_ms, dupes, rate


class _Split:
    """An exporter that sends a run's first export (its do span) to one replica and the
    next two (the timed unwind, then the run's end) to another."""

    def __init__(self, first: OTLPSpanExporter, rest: OTLPSpanExporter) -> None:
        self.first, self.rest, self.calls = first, rest, 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        target = self.first if self.calls % 3 == 0 else self.rest
        self.calls += 1
        return target.export(spans)

    def shutdown(self) -> None:
        self.first.shutdown()  # type: ignore[no-untyped-call]


def run(progress: Callable[[str], None]) -> list[Figure]:
    server = _pg()
    try:
        figures = []
        for replicas in (1, 3):
            side, ref = _ingest(progress, server, replicas, BATCH, 300)
            figures.append(
                Figure(
                    area=AREA,
                    name=f"ingest on PostgreSQL, {BATCH}-span batches, {replicas} "
                    f"replica{'s' if replicas > 1 else ''}",
                    value=side * BATCH,
                    unit="spans/s",
                    reference_name="parse-only aiohttp OTLP/HTTP server",
                    reference_value=ref * BATCH,
                    ratio=side / ref,
                    goal="",
                    met=True,
                    notes=_INGEST_NOTE,
                )
            )
            side, ref = _ingest(progress, server, replicas, 1, 2000)
            figures.append(
                Figure(
                    area=AREA,
                    name=f"ingest on PostgreSQL, single-span requests, {replicas} "
                    f"replica{'s' if replicas > 1 else ''}",
                    value=side,
                    unit="requests/s",
                    reference_name="parse-only aiohttp OTLP/HTTP server",
                    reference_value=ref,
                    ratio=side / ref,
                    goal="",
                    met=True,
                    notes=_INGEST_NOTE,
                )
            )
        alert_ms, export_ms, dupes, rate = _alerts(progress, server)
    finally:
        server.stop()
    value, ref = _pct(alert_ms, 0.99), _pct(export_ms, 0.99)
    figures.append(
        Figure(
            area=AREA,
            name="unwind span export start -> webhook alert through 3 replicas, p99",
            value=round(value, 3),
            unit="ms",
            reference_name="the same OTLP/HTTP export call's own duration, p99",
            reference_value=round(ref, 3),
            ratio=round(value / ref, 2) if ref else float("inf"),
            goal="ratio <= 1.5; each alert once",
            met=(value / ref if ref else float("inf")) <= 1.5 and dupes == 0,
            notes=(
                f"{SAMPLES} runs after {WARMUP} warm-up, each run's do span to one replica and "
                f"its unwind to the next (round robin); {dupes} duplicate deliveries across the "
                f"3 replicas; background load {rate:,.0f} spans/s achieved over the 3 "
                f"(target {LOAD_SPANS_PER_S}); PostgreSQL from tests/pg_server.py; p50 "
                f"{_pct(alert_ms, 0.5):.1f} ms (export p50 {_pct(export_ms, 0.5):.1f} ms)"
            ),
        )
    )
    return figures


_INGEST_NOTE = (
    "the same load generator and bodies as the SQLite ingest rows (bench_sidecar), requests "
    "round robin over the replicas; every span committed in PostgreSQL (tests/pg_server.py's "
    "server: loopback, fsync off) before the 200, and folded by every replica (each reads "
    "the others' spans every tick); replicas, PostgreSQL and the load generator share the "
    "machine's 2 cores (not pinned), so 3 replicas here add no CPU, only the work of folding "
    "every span 3 times. The limit moves to the database: the requests waiting while a "
    "transaction runs share the next one (group commit), serialized per replica; beyond it, "
    "a bigger instance, commit_delay and spans partitioned by time (docs/scaling.md)"
)


if __name__ == "__main__":
    for figure in run(print):
        print(figure)
