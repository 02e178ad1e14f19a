"""How fast an alert reaches a sink: from an unwind span leaving an agent, from an agent's death.

Setup, all on loopback, each part in its own process as in production:

- the real sidecar (``saga-sidecar serve``, SQLite in a temp dir) with one
  ``--webhook`` sink, the bench's own aiohttp server (in a thread), which stamps
  each alert on arrival;
- a background load process exporting complete runs over OTLP/HTTP (19 ``do``
  spans and the ``run`` span per request, paced at ~1,300 spans/s), so the sidecar
  is busy while it alerts; the achieved rate is in the notes;
- the measuring agent: for each run it exports one ``do`` span (untimed), then the
  ``unwind`` span with the OTLP/HTTP exporter; the clock starts when that export
  call starts and stops when the webhook receives SagaCompensationStarted.

Reference: the same export call's own duration (the OTLP request round trip), so
ratio = alert latency / export latency.

Orphan detection: an agent process using ``saga_otel.configure`` (1 s heartbeats)
opens a run and is SIGKILLed at a random moment 1.2-3.2 s later (after its second
heartbeat, so its cadence is known); the figure is the time from the kill to
SagaRunOrphaned at the webhook, p50 and worst of the trials, twice: with the
presence stream (the kernel closes its live connection at the kill; the sidecar
confirms over 0.5 s) and with heartbeats only (three missed 1 s heartbeats, so
between 2 and 3 s plus the sidecar's tick).
Then the same trials again, each while bench/_saturate.py sends complete runs
as fast as the sidecar answers (no pacing): how late a dead agent is paged when
the intake has a backlog. Its rows give the load's achieved rate and the
sidecar's CPU share over each trial.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import psutil
from aiohttp import web
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from bench import _saturate as saturate
from bench._figures import Figure
from bench.bench_sidecar import ROOT
from saga_otel import semconv as sc

AREA = "alerts"
SAMPLES = 200
WARMUP = 20
LOAD_SPANS_PER_REQUEST = 20
LOAD_TARGET_SPANS_PER_S = 1300
MIN_LOAD_SPANS_PER_S = 1000
ORPHAN_TRIALS = 20
GOAL_P99_MS = 50.0
GOAL_ORPHAN_PRESENCE_S = 1.5
GOAL_ORPHAN_HEARTBEATS_S = 3.5
KILL_AFTER_S = (1.2, 3.2)
SATURATED_TRIALS = 10  # per mode, each under its own unpaced load (bench/_saturate.py)
ALERT_PATH = (
    "Since issue 16's fifth pass the alert rows are written just after the unwind "
    "span's answer (two loop turns later on SQLite), so the export call returns "
    "before the alert is stored: the ratio's floor is above 1 by that write "
    "(~0.5-1 ms at p50). The same pass set the outbox connection's WAL autocheckpoint "
    "to the intake's (checkpoints run on the store's thread): at SQLite's default "
    "every alert COMMIT under load checkpointed the WAL itself; measured here with 200 "
    "unwinds each way, alert p99 24-26 -> 8-14 ms and export p99 24 -> 8-10 ms."
)


class _Hook:
    """The webhook sink: an aiohttp server on its own loop thread, stamping arrivals."""

    def __init__(self) -> None:
        self.arrivals: dict[tuple[str, str, str], float] = {}
        self.deliveries = 0  # every POST, duplicates included
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def handle(request: web.Request) -> web.Response:
            body = await request.json()
            now = time.time()
            with self._cond:
                key = (body["alertname"], body["status"], body["run_id"])
                self.arrivals.setdefault(key, now)
                self.deliveries += 1
                self._cond.notify_all()
            return web.Response(text="ok")

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/hook", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def __enter__(self) -> _Hook:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def wait(self, alertname: str, status: str, run_id: str, limit: float = 15.0) -> float:
        key = (alertname, status, run_id)
        with self._cond:
            if not self._cond.wait_for(lambda: key in self.arrivals, limit):
                raise RuntimeError(f"no {alertname} {status} for {run_id} within {limit} s")
            return self.arrivals[key]


class _SidecarProc:
    def __init__(self, db: Path, webhook: str) -> None:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from sidecar._cli import main; main()",
                "serve",
                "--otlp-http-port=0",
                "--otlp-grpc-port=0",
                "--api-port=0",
                f"--db={db}",
                f"--webhook={webhook}",
                "--no-alert-log",
                "--log-level=WARNING",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("saga-sidecar serve did not start")
        self.ports = json.loads(line)
        self.otlp = f"http://127.0.0.1:{self.ports['otlp_http']}"
        self.pid = self._proc.pid

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(15)


_LOAD = r"""
import json, sys, time, uuid
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry import trace
from saga_otel import semconv as sc

endpoint, per_request = sys.argv[1], int(sys.argv[2])
rate, duration = float(sys.argv[3]), float(sys.argv[4])
resource = Resource.create({"service.name": "load", "service.instance.id": "load-1"})
provider = TracerProvider(resource=resource)
tracer = provider.get_tracer("load")
exporter = OTLPSpanExporter(endpoint=endpoint + "/v1/traces", timeout=10)
sent, start = 0, time.monotonic()
interval = per_request / rate
next_at = start
while time.monotonic() - start < duration:
    run_id = uuid.uuid4().hex
    ident = {sc.SAGA_RUN_ID: run_id, sc.SAGA_NAME: "load", sc.SAGA_CONTRACT_VERSION: 1}
    root = tracer.start_span("saga.run load", attributes={**ident, sc.SAGA_PHASE: "run"})
    ctx = trace.set_span_in_context(root)
    spans = []
    for i in range(per_request - 1):
        s = tracer.start_span("saga.do step", context=ctx, attributes={**ident, sc.SAGA_PHASE: "do",
            sc.SAGA_STEP_NAME: f"s{i}", sc.SAGA_STEP_INDEX: i, sc.SAGA_STEP_CLASS: "read",
            sc.SAGA_STEP_ATTEMPT: 1, sc.SAGA_STEP_PIVOT: False})
        s.end()
        spans.append(s)
    root.set_attribute(sc.SAGA_RUN_STATUS, "completed")
    root.end()
    spans.append(root)
    exporter.export(spans)
    sent += len(spans)
    next_at += interval
    delay = next_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
print(json.dumps({"spans": sent, "seconds": time.monotonic() - start}), flush=True)
"""

_AGENT = r"""
import sys, time
from opentelemetry import trace
from saga_otel import semconv as sc
from saga_otel import configure
from saga_otel._heartbeat import register_open_run

endpoint, run_id, presence = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
configure(endpoint, heartbeat_interval=1.0, presence=presence)
tracer = trace.get_tracer("agent")
span = tracer.start_span("saga.do charge", attributes={
    sc.SAGA_RUN_ID: run_id, sc.SAGA_NAME: "refund", sc.SAGA_CONTRACT_VERSION: 1,
    sc.SAGA_PHASE: "do", sc.SAGA_STEP_NAME: "charge", sc.SAGA_STEP_INDEX: 0,
    sc.SAGA_STEP_CLASS: "compensable", sc.SAGA_STEP_ATTEMPT: 1, sc.SAGA_STEP_PIVOT: False,
    sc.SAGA_COMPENSATION_TOOL: "refund_charge", sc.SAGA_COMPENSATION_ARGS: '{"charge_id": "ch_1"}',
    sc.SAGA_COMPENSATION_DESCRIPTION: "refund the charge"})
span.end()
register_open_run(run_id)
print("ready", flush=True)
time.sleep(3600)
"""


def _identity(run_id: str, phase: str) -> dict[str, Any]:
    return {
        sc.SAGA_RUN_ID: run_id,
        sc.SAGA_NAME: "refund",
        sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
        sc.SAGA_PHASE: phase,
    }


class _Agent:
    """The measuring agent: builds one run's spans and exports them itself."""

    def __init__(self, otlp: str) -> None:
        self.provider = TracerProvider(
            resource=Resource.create(
                {sc.SERVICE_NAME: "bench-agent", sc.SERVICE_INSTANCE_ID: "bench-agent-1"}
            ),
            shutdown_on_exit=False,
        )
        self.tracer = self.provider.get_tracer("bench")
        self.exporter = OTLPSpanExporter(endpoint=f"{otlp}/v1/traces", timeout=10)

    def span(
        self, name: str, attrs: dict[str, Any], ok: bool = True, ctx: Context | None = None
    ) -> ReadableSpan:
        span = self.tracer.start_span(name, context=ctx, attributes=attrs)
        span.set_status(Status(StatusCode.OK if ok else StatusCode.ERROR))
        span.end()
        assert isinstance(span, ReadableSpan)
        return span

    def one(self, hook: _Hook) -> tuple[float, float]:
        """(alert latency, export latency) in ms for one fresh run."""
        run_id = uuid.uuid4().hex
        # One run, one trace (the sidecar refuses a run's span from another trace).
        parent = SpanContext(
            int(run_id, 16), random.getrandbits(64) | 1, is_remote=True, trace_flags=TraceFlags(1)
        )
        ctx = trace.set_span_in_context(NonRecordingSpan(parent))
        comp = {
            sc.SAGA_COMPENSATION_TOOL: "reverse_credit",
            sc.SAGA_COMPENSATION_ARGS: '{"credit_id": "cr_1"}',
            sc.SAGA_COMPENSATION_DESCRIPTION: "reverse the credit",
        }
        step = {sc.SAGA_STEP_NAME: "issue_credit", sc.SAGA_STEP_INDEX: 0, sc.SAGA_STEP_ATTEMPT: 1}
        self.exporter.export(
            [
                self.span(
                    "saga.do issue_credit",
                    {**_identity(run_id, sc.PHASE_DO), **step, **comp,
                     sc.SAGA_STEP_CLASS: "compensable", sc.SAGA_STEP_PIVOT: False},
                    ctx=ctx,
                )
            ]
        )  # fmt: skip
        unwind = self.span(
            "saga.unwind refund",
            {
                **_identity(run_id, sc.PHASE_UNWIND),
                sc.SAGA_UNWIND_REASON: "SMTPError: mail down",
                sc.SAGA_RUN_FAILED_STEP: "send_reply",
                sc.SAGA_STACK: json.dumps(
                    [{"step": "issue_credit", "index": 0, "tool": "reverse_credit",
                      "args": {"credit_id": "cr_1"}, "description": "reverse the credit"}]
                ),
            },
            ctx=ctx,
        )  # fmt: skip
        t0 = time.time()
        self.exporter.export([unwind])
        t1 = time.time()
        arrived = hook.wait(sc.ALERT_COMPENSATION_STARTED, "firing", run_id)
        # Close the run (untimed) so it never idles into an orphan during the bench.
        self.exporter.export(
            [
                self.span("saga.compensate issue_credit",
                          {**_identity(run_id, sc.PHASE_COMPENSATE), **step, **comp}, ctx=ctx),
                self.span("saga.run refund", {**_identity(run_id, sc.PHASE_RUN),
                          sc.SAGA_RUN_STATUS: sc.STATUS_COMPENSATED,
                          sc.SAGA_RUN_FAILED_STEP: "send_reply"}, ok=False, ctx=ctx),
            ]
        )  # fmt: skip
        return (arrived - t0) * 1000.0, (t1 - t0) * 1000.0

    def close(self) -> None:
        self.exporter.shutdown()  # type: ignore[no-untyped-call]
        self.provider.shutdown()


def _pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _orphan_trial(otlp: str, hook: _Hook, presence: bool, delay: float) -> float:
    run_id = uuid.uuid4().hex
    agent = subprocess.Popen(
        [sys.executable, "-c", _AGENT, otlp, run_id, "on" if presence else "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert agent.stdout is not None
        if agent.stdout.readline().strip() != "ready":
            raise RuntimeError("heartbeat agent did not start")
        time.sleep(delay)  # a random moment after the second heartbeat
        killed = time.time()
        os.kill(agent.pid, signal.SIGKILL)
        arrived = hook.wait(sc.ALERT_RUN_ORPHANED, "firing", run_id, limit=20.0)
        return arrived - killed
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(10)


class Saturated(NamedTuple):
    """One orphan trial under an unpaced load: the latency, and what the load did."""

    seconds: float
    spans_per_s: float  # the load's achieved rate over the trial
    sidecar_cpu: float  # the sidecar's CPU seconds / wall seconds over the trial (1.0: a core)


def _saturated_trial(
    sidecar: _SidecarProc, hook: _Hook, presence: bool, delay: float, seed: int
) -> Saturated:
    """An orphan trial while bench/_saturate.py keeps the intake as busy as it can
    (``seed``: distinct per trial, so no load repeats another's runs)."""
    load = subprocess.Popen(
        [sys.executable, "-m", "bench._saturate", str(sidecar.ports["otlp_http"]), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert load.stdout is not None
        if load.stdout.readline().strip() != "ready":
            raise RuntimeError("the saturating load did not start")
        time.sleep(0.5)  # let the backlog build
        proc = psutil.Process(sidecar.pid)
        before, t0 = proc.cpu_times(), time.monotonic()
        seconds = _orphan_trial(sidecar.otlp, hook, presence, delay)
        after, t1 = proc.cpu_times(), time.monotonic()
        load.terminate()
        out = load.communicate(timeout=30)[0].strip().splitlines()
        if load.returncode != 0 or not out:
            raise RuntimeError(
                f"the saturating load exited {load.returncode} without its totals: "
                "its traceback is above (a non-200 answer from the sidecar stops it)"
            )
        stats = json.loads(out[-1])
    finally:
        if load.poll() is None:
            load.kill()
            load.wait(10)
    busy = after.user + after.system - before.user - before.system
    return Saturated(seconds, stats["spans"] / stats["seconds"], busy / (t1 - t0))


def run(progress: Callable[[str], None]) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp, _Hook() as hook:
        sidecar = _SidecarProc(Path(tmp) / "sidecar.db", hook.url)
        try:
            agent = _Agent(sidecar.otlp)
            progress("alerts: warm-up")
            for _ in range(WARMUP):
                agent.one(hook)
            duration = SAMPLES * 0.05 + 5
            load = subprocess.Popen(
                [sys.executable, "-c", _LOAD, sidecar.otlp, str(LOAD_SPANS_PER_REQUEST),
                 str(LOAD_TARGET_SPANS_PER_S), str(duration)],
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            time.sleep(1.0)  # let the load settle
            progress(f"alerts: {SAMPLES} unwinds under background load")
            alert_ms: list[float] = []
            export_ms: list[float] = []
            for _ in range(SAMPLES):
                a, e = agent.one(hook)
                alert_ms.append(a)
                export_ms.append(e)
                time.sleep(0.02)
            out, _ = load.communicate(timeout=duration + 60)
            stats = json.loads(out.strip().splitlines()[-1])
            rate = stats["spans"] / stats["seconds"]
            agent.close()

            rng = random.Random(15)
            orphan: dict[bool, list[float]] = {True: [], False: []}
            progress(f"alerts: 2 x {ORPHAN_TRIALS} SIGKILLed agents (1 s heartbeats)")
            for _ in range(ORPHAN_TRIALS):
                for presence in (True, False):  # interleaved: the same machine state
                    delay = rng.uniform(*KILL_AFTER_S)
                    orphan[presence].append(_orphan_trial(sidecar.otlp, hook, presence, delay))
            saturated: dict[bool, list[Saturated]] = {True: [], False: []}
            progress(f"alerts: 2 x {SATURATED_TRIALS} SIGKILLed agents, intake saturated")
            for trial in range(SATURATED_TRIALS):
                for presence in (True, False):
                    delay = rng.uniform(*KILL_AFTER_S)
                    seed = 2 * trial + presence + 1
                    got = _saturated_trial(sidecar, hook, presence, delay, seed)
                    saturated[presence].append(got)
                    progress(
                        f"alerts: presence={presence} {got.seconds:.2f} s under "
                        f"{got.spans_per_s:,.0f} spans/s, sidecar CPU {got.sidecar_cpu:.0%}"
                    )
        finally:
            sidecar.close()

    load_note = (
        f"background load {rate:,.0f} spans/s achieved (target {LOAD_TARGET_SPANS_PER_S}, "
        f"{LOAD_SPANS_PER_REQUEST} spans per OTLP/HTTP request, complete runs) into the real "
        "sidecar (own process, SQLite); webhook sink in the bench process"
        + ("" if rate >= MIN_LOAD_SPANS_PER_S else "; LOAD BELOW 1,000 spans/s: machine busy")
    )
    figures = []
    for label, q in (("p50", 0.50), ("p99", 0.99)):
        value, ref = _pct(alert_ms, q), _pct(export_ms, q)
        figures.append(
            Figure(
                area=AREA,
                name=f"unwind span export start -> webhook alert, {label}",
                value=round(value, 3),
                unit="ms",
                reference_name=f"the same OTLP/HTTP export call's own duration, {label}",
                reference_value=round(ref, 3),
                ratio=round(value / ref, 2) if ref else float("inf"),
                goal=f"p99 <= {GOAL_P99_MS:g} ms under >= {MIN_LOAD_SPANS_PER_S} spans/s",
                # The goal only counts under the load it is stated for.
                met=_pct(alert_ms, 0.99) <= GOAL_P99_MS and rate >= MIN_LOAD_SPANS_PER_S,
                notes=f"{SAMPLES} runs after {WARMUP} warm-up; {load_note}. {ALERT_PATH}",
            )
        )
    figures += _orphan_figures(orphan, saturated)
    return figures


def _orphan_rows(
    title: str, xs: list[float], goal: float, reference: dict[str, tuple[str, float]], notes: str
) -> list[Figure]:
    """p50 (no goal) and worst (``goal``) of orphan trials ``xs``, each against its reference."""
    rows = []
    for label, value in (("p50", statistics.median(xs)), ("worst", max(xs))):
        ref_name, ref = reference[label]
        rows.append(
            Figure(
                area=AREA,
                name=f"agent SIGKILL -> SagaRunOrphaned{title}, {label}",
                value=round(value, 3),
                unit="s",
                reference_name=ref_name,
                reference_value=round(ref, 3),
                ratio=round(value / ref, 2),
                goal=f"worst <= {goal:g} s" if label == "worst" else "",
                met=max(xs) <= goal,
                notes=notes if label == "worst" else "",
            )
        )
    return rows


def _orphan_figures(
    orphan: dict[bool, list[float]], saturated: dict[bool, list[Saturated]]
) -> list[Figure]:
    """The orphan rows: light load against the contract's bound, saturated against light."""
    figures = []
    three = 3.0
    bound = "contract bound before presence: three missed 1 s heartbeats"
    for presence, goal in ((True, GOAL_ORPHAN_PRESENCE_S), (False, GOAL_ORPHAN_HEARTBEATS_S)):
        xs = orphan[presence]
        how = "live connection (presence)" if presence else "heartbeats only"
        figures += _orphan_rows(
            f" at webhook, {how}",
            xs,
            goal,
            {"p50": (bound, three), "worst": (bound, three)},
            f"{len(xs)} trials: "
            + ", ".join(f"{x:.2f}" for x in xs)
            + " s; agent uses saga_otel.configure(heartbeat_interval=1.0, "
            f"presence={presence}), killed at a random moment "
            f"{KILL_AFTER_S[0]:g}-{KILL_AFTER_S[1]:g} s after its run opened; "
            "sidecar ticks every 0.2 s",
        )
    for presence, goal in ((True, GOAL_ORPHAN_PRESENCE_S), (False, GOAL_ORPHAN_HEARTBEATS_S)):
        trials = saturated[presence]
        xs = [s.seconds for s in trials]
        light = orphan[presence]
        how = "live connection (presence)" if presence else "heartbeats only"
        figures += _orphan_rows(
            f", intake saturated, {how}",
            xs,
            goal,
            {
                "p50": ("the same with a light load, p50", statistics.median(light)),
                "worst": ("the same with a light load, worst", max(light)),
            },
            f"{len(xs)} trials, each under its own unpaced load (bench/_saturate.py: "
            f"complete runs, {saturate.SPANS_PER_REQUEST} spans a request, "
            f"{saturate.CONNECTIONS} raw-socket connections, as fast "
            "as the sidecar answers) started 0.5 s before the agent: "
            + ", ".join(f"{x:.2f}" for x in xs)
            + " s; load achieved "
            + ", ".join(f"{s.spans_per_s / 1000:.1f}k" for s in trials)
            + " spans/s; sidecar CPU "
            + ", ".join(f"{s.sidecar_cpu:.0%}" for s in trials)
            + " of a core (2 cores shared by the sidecar, the load, the agent and "
            "the webhook sink); otherwise as the light-load rows",
        )
    return figures
