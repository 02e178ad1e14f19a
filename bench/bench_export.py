"""The latency durable export adds to a step: end a saga span, wait for the sidecar's ack.

Receiver, in its own process on loopback as in production: ``saga-sidecar serve``
with its defaults (alerting on, SQLite), started as the ingest bench starts it.
Reference: the same span ended on a provider with no saga processor, so no wait.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from bench._figures import Figure
from bench.bench_sidecar import _start_sidecar, _stop
from saga_otel import semconv as sc
from saga_otel._acks import wait_for_ack, wait_for_ack_async
from saga_otel._config import configure

AREA = "export"
GOAL_P99_MS = 2.0
WARMUP = 200
REFUND_RUNS = 4
REFUND_ROUNDS = 5
GOAL_DOWN_RATIO = 2.0  # issue 15: a down sidecar costs at most 2x
SAMPLES = 3000  # per way, over REPEATS interleaved repetitions
REPEATS = 5
# What was tried and what is left, for the p99 goal (docs/benchmarks.md notes).
NOTES_P99 = (
    "Tried (issue 16): the ack path on the agent side is one kept-alive connection, "
    "request line, headers and body in one send (http.client joins them, so Nagle never "
    "holds the body), and the receiver answers with TCP_NODELAY (aiohttp's default); the "
    "async wait returns without a loop round trip when the ack came first; the request "
    "bytes are written by saga_otel._wire (byte-equal to the SDK encoder, a third of its "
    "time); the sidecar's WAL checkpoints run on a thread of their own, off the commit "
    "path. Tried and dropped: answering before the fold (the fold one loop turn later): "
    "no gain at the minimum in a live run (3.70 vs 3.73 ms a run, 5 interleaved pairs), "
    "and every reader of the state would first have to fold what is pending. Where the "
    "tail comes from: the same code's p99 ranged from 1.8 to 4.2 ms between runs on this "
    "VM, the slow samples come in clusters of 50-100 ms (not at the sidecar's 1 s "
    "ticks), the database on tmpfs did not remove them, and the parse-only receiver's own "
    "round-trip p99 was 1.6-2.1 ms in the live-run bench: the tail is mostly the "
    "machine. Left at p50: the sidecar's answer (per lone request, per-function timers in "
    "a live run: screening, SQLite COMMIT ~90 us, fold ~150 us when a run's facts change "
    "and the alert rules see two views, decode ~80 us; an idle core runs each slower than "
    "under load) and the hand-off to the sender thread and back (two thread wake-ups, "
    "compare the inline POST above)."
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Receiver:
    """``saga-sidecar serve`` (alerting on, SQLite) in its own process, as users run it."""

    def __init__(self) -> None:
        self.port = 0
        self.kind = "`saga-sidecar serve` (alerting on, SQLite in a temp dir)"
        self._proc: subprocess.Popen[str] | None = None
        self._tmp = tempfile.TemporaryDirectory()

    def __enter__(self) -> _Receiver:
        self._proc, self.port = _start_sidecar(Path(self._tmp.name) / "sidecar.db")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None
        self._tmp.cleanup()


def _attrs(i: int, run_id: str) -> dict[str, Any]:
    return {
        sc.SAGA_PHASE: sc.PHASE_DO,
        sc.SAGA_RUN_ID: run_id,
        sc.SAGA_NAME: "refund",
        sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
        sc.SAGA_STEP_NAME: "charge",
        sc.SAGA_STEP_INDEX: i,
        sc.SAGA_STEP_CLASS: "compensable",
        sc.SAGA_STEP_ATTEMPT: 1,
        sc.SAGA_STEP_PIVOT: False,
        sc.SAGA_COMPENSATION_TOOL: "refund_charge",
        sc.SAGA_COMPENSATION_ARGS: '{"charge_id": "ch_123"}',
        sc.SAGA_COMPENSATION_DESCRIPTION: "refund the charge",
    }


def _breakdown(port: int, n: int) -> tuple[list[float], list[float]]:
    """Milliseconds to encode one span, and to POST it inline (no sender thread, no ticket)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from saga_otel._transport import Poster, TransportSettings

    tracer = TracerProvider(shutdown_on_exit=False).get_tracer("bench")
    ctx, run_id = _run_context(tracer)
    poster = Poster(f"http://127.0.0.1:{port}/v1/traces", TransportSettings(headers={}))
    enc: list[float] = []
    post: list[float] = []
    try:
        for i in range(n):
            span = tracer.start_span("saga.do charge", context=ctx, attributes=_attrs(i, run_id))
            span.end()
            t0 = time.perf_counter()
            body = encode_spans([span]).SerializeToString()  # type: ignore[list-item]
            t1 = time.perf_counter()
            if not 200 <= poster.post(body).status < 300:
                raise RuntimeError("bench receiver refused a span")
            t2 = time.perf_counter()
            enc.append((t1 - t0) * 1000.0)
            post.append((t2 - t1) * 1000.0)
    finally:
        poster.abort()
        poster.close()
    return enc, post


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_RUNS = itertools.count(1)


def _run_context(tracer: Any) -> tuple[Any, str]:
    """One run per measurement: its spans share one trace, as a real run's do, so the
    sidecar stores every one (a span of the same run id from another trace is refused,
    and a refused span would cost the sidecar less than a stored one)."""
    parent = tracer.start_span("bench run")  # no saga attributes; never ended nor sent
    return trace.set_span_in_context(parent), f"bench-run-{next(_RUNS)}"


def _measure(provider: TracerProvider, wait: Callable[[Any], bool] | None, n: int) -> list[float]:
    """Milliseconds of (span.end() [+ wait]) per span; spans started outside the timing."""
    tracer = provider.get_tracer("bench")
    ctx, run_id = _run_context(tracer)
    out: list[float] = []
    misses = 0
    for i in range(n):
        span = tracer.start_span("saga.do charge", context=ctx, attributes=_attrs(i, run_id))
        t0 = time.perf_counter()
        span.end()
        if wait is not None and not wait(span):
            misses += 1
        out.append((time.perf_counter() - t0) * 1000.0)
    if misses:
        raise RuntimeError(f"{misses} of {n} durable waits missed their bound")
    return out


def _measure_async(provider: TracerProvider, n: int) -> list[float]:
    tracer = provider.get_tracer("bench")
    ctx, run_id = _run_context(tracer)

    async def go() -> list[float]:
        out: list[float] = []
        for i in range(n):
            span = tracer.start_span("saga.do charge", context=ctx, attributes=_attrs(i, run_id))
            t0 = time.perf_counter()
            span.end()
            if not await wait_for_ack_async(span):
                raise RuntimeError("durable wait missed its bound")
            out.append((time.perf_counter() - t0) * 1000.0)
        return out

    return asyncio.run(go())


def run(progress: Callable[[str], None]) -> list[Figure]:
    plain = TracerProvider(shutdown_on_exit=False)
    _measure(plain, None, WARMUP)
    ref: list[list[float]] = []
    sync: list[list[float]] = []
    asy: list[list[float]] = []

    durable = TracerProvider(shutdown_on_exit=False)
    with _Receiver() as rx:
        kind = rx.kind
        export = configure(
            f"http://127.0.0.1:{rx.port}",
            tracer_provider=durable,
            registry=CollectorRegistry(),
            ack_timeout=1.0,
        )
        try:
            _measure(durable, wait_for_ack, WARMUP)
            _measure_async(durable, WARMUP)
            per = SAMPLES // REPEATS
            for rep in range(REPEATS):
                # Interleaved: the reference, sync and async see the same machine moments.
                progress(f"export: repetition {rep + 1}/{REPEATS}: reference, sync, async")
                ref.append(_measure(plain, None, per))
                sync.append(_measure(durable, wait_for_ack, per))
                asy.append(_measure_async(durable, per))
            progress(f"export: the same spans encoded and posted inline, {SAMPLES} spans")
            _breakdown(rx.port, WARMUP)
            enc, post = _breakdown(rx.port, SAMPLES)
            progress(f"export: {REFUND_RUNS} refund runs, sidecar up")
            up = _refund_runs(durable)
        finally:
            export.shutdown()
        progress(f"export: {REFUND_RUNS} refund runs, sidecar down")
        down_export = configure(
            f"http://127.0.0.1:{_free_port()}",  # nothing listens there
            tracer_provider=durable,
            registry=CollectorRegistry(),
            ack_timeout=1.0,
        )
        try:
            down = _refund_runs(durable)
        finally:
            down_export.shutdown(timeout=0.5)
            durable.shutdown()
    plain.shutdown()

    note = (
        f"end span + wait_for_ack against {kind}, own process on loopback; "
        "reference: the same span ended with no processor; "
        f"{SAMPLES} spans each way after {WARMUP} warm-up, in {REPEATS} interleaved "
        f"repetitions of {SAMPLES // REPEATS} (reference, sync, async); the value is the "
        "median of the repetitions' percentiles"
    )
    where = (
        f"Where the time goes (same run): encoding one span (OTLP protobuf) p50/p99 "
        f"{_pct(enc, 0.5):.3f} / {_pct(enc, 0.99):.3f} ms; one POST of it on a kept-alive "
        f"connection from the calling thread, answered by the same receiver, p50/p99 "
        f"{_pct(post, 0.5):.3f} / {_pct(post, 0.99):.3f} ms; the rest is the hand-off to "
        "the sender thread and back. " + NOTES_P99
    )
    figures: list[Figure] = []
    for label, reps in (("sync", sync), ("async", asy)):
        for name, q in (("p50", 0.50), ("p99", 0.99)):
            each = sorted(_pct(xs, q) for xs in reps)
            value = statistics.median(each)
            reference = statistics.median(_pct(xs, q) for xs in ref)
            pooled = _pct([x for xs in reps for x in xs], q)
            is_p99 = name == "p99"
            figures.append(
                Figure(
                    area=AREA,
                    name=f"durable export added latency, {label}, {name}",
                    value=round(value, 4),
                    unit="ms",
                    reference_name=f"span.end() without saga processor, {name}",
                    reference_value=round(reference, 4),
                    ratio=round(value / reference, 1) if reference > 0 else float("inf"),
                    goal=f"<= {GOAL_P99_MS} ms" if is_p99 else "",
                    met=value <= GOAL_P99_MS if is_p99 else True,
                    notes=note + f"; {name} per repetition min/median/max {each[0]:.3f} / "
                    f"{value:.3f} / {each[-1]:.3f} ms, over all {SAMPLES} spans {pooled:.3f} ms"
                    + (
                        f"; mean {statistics.fmean(x for xs in reps for x in xs):.3f} ms"
                        if name == "p50"
                        else ""
                    )
                    + (f". {where}" if is_p99 else ""),
                )
            )
    figures.append(
        Figure(
            area=AREA,
            name=f"{REFUND_RUNS} refund runs with the sidecar down",
            value=round(down * 1000.0, 2),
            unit="ms",
            reference_name=f"the same {REFUND_RUNS} runs with the sidecar up",
            reference_value=round(up * 1000.0, 2),
            ratio=round(down / up, 2),
            goal=f"<= {GOAL_DOWN_RATIO}",
            met=down / up <= GOAL_DOWN_RATIO,
            notes=(
                f"examples/refund_agent.py runs (two completed, two compensated), ack_timeout=1 s; "
                f"up: against {kind}; down: nothing listens, the export circuit opens at the "
                f"first refused connection; median of {REFUND_ROUNDS} rounds"
            ),
        )
    )
    return figures


def _refund_runs(provider: TracerProvider) -> float:
    """Seconds for REFUND_RUNS refund runs (median of REFUND_ROUNDS rounds)."""
    from examples.refund_agent import run_refund
    from examples.refund_tools import refund_tools
    from examples.world import World
    from saga_otel import Saga

    async def one_round() -> float:
        t0 = time.perf_counter()
        for i in range(REFUND_RUNS):
            tools = refund_tools(World(mail_down=i % 2 == 1))
            saga = Saga(
                "refund", tools=tools, tracer_provider=provider, registry=CollectorRegistry()
            )
            await run_refund(saga)
        return time.perf_counter() - t0

    return statistics.median(asyncio.run(one_round()) for _ in range(REFUND_ROUNDS))


if __name__ == "__main__":
    for f in run(print):
        print(f)
