"""How the sidecar's costs grow as work grows: each must be flat or linear, never quadratic.

- ingest per span and fold per span against run length (10, 100, 1,000, 3,000
  steps per run): ingest through ``saga-sidecar serve`` (alerting on, one span per
  request, as a durable agent sends them, raw-socket load generator); the fold
  in process (``RunState.apply`` with before-snapshots, as intake calls it), one
  span per call. Reference: the same figure at 10 steps.
- memory and full GC pause against open runs (10k, 100k, 1M), each in a fresh
  process on ``RunState`` with an injected clock (the runs never idle out): RSS per
  open run, and the pause of ``gc.collect()`` after ``_gcfreeze.freeze()`` and a
  further second's worth of traffic (10k spans), as ``saga-sidecar serve`` runs.
  Reference: the same pause without the freeze.
- alert latency p99 against paced background load (1k, 5k, 10k spans/s): unwind
  span export start to the webhook's SagaCompensationStarted, as in
  ``bench_alerts``; reference: the same export call's own duration, p99.
- the alert outbox's CPU per alert against the alert rows it holds (1k, 10k, 100k
  delivered rows: alerts stay until retention prunes their run), in a fresh
  process; reference: the same figure at 1k rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import bench_alerts as alerts
from bench import bench_sidecar as intake
from bench._figures import Figure
from bench._loadgen import drive
from bench._spans import do_span, new_request

AREA = "scale"
RUN_LENGTHS = (10, 100, 1000, 3000)
SPANS_PER_POINT = 6000
OPEN_RUNS = (10_000, 100_000, 1_000_000)
LOADS = (1000, 5000, 10000)
LOAD_SPANS_PER_REQUEST = 20
ALERT_SAMPLES = 100
ALERT_REPEATS = 3  # interleaved over the loads; the p99 of 100 unwinds alone is its 2nd worst
GOAL_PAUSE_MS = 10.0
PAUSE_ROUNDS = 5  # the pause is the median of this many (one is noisy: 5-10 ms here)
OUTBOX_ROWS = (1_000, 10_000, 100_000)
OUTBOX_ALERTS = 100
GOAL_FLAT = 2.0  # per-span cost at N steps within 2x of 10 steps: flat (linear in total)
STEP_NAMES = ("issue_credit", "send_reply", "charge", "reserve", "notify")


def _request(spans: list[tuple[int, int, int]]) -> bytes:
    req, out = new_request()
    for run, index, counter in spans:
        do_span(out, run, index, counter, STEP_NAMES[index % len(STEP_NAMES)])
    return req.SerializeToString()


def _run_bodies(steps: int, seed: int) -> list[bytes]:
    """SPANS_PER_POINT single-span requests: runs of ``steps`` do spans, step by step."""
    runs = max(1, SPANS_PER_POINT // steps)
    base = seed * 1_000_000_000
    bodies = []
    counter = base
    for index in range(steps):
        for r in range(runs):
            counter += 1
            bodies.append(_request([(base + r + 1, index, counter)]))
    return bodies


def _ingest_per_span(progress: Callable[[str], None]) -> dict[int, float]:
    out = {}
    for steps in RUN_LENGTHS:
        bodies = _run_bodies(steps, seed=steps)
        with tempfile.TemporaryDirectory() as tmp:
            proc, port = intake._start_sidecar(Path(tmp) / "sidecar.db")
            try:
                intake._drive(port, _run_bodies(10, seed=7)[:300])
                seconds = drive(port, bodies, intake.CONCURRENCY)
            finally:
                intake._stop(proc)
        out[steps] = seconds / len(bodies) * 1e6
        progress(f"scale: ingest at {steps} steps per run: {out[steps]:.1f} us per span")
    return out


_FOLD = r"""
import json, sys, time
from sidecar import RunState
from sidecar._otlp import extract, parse_protobuf
from bench.bench_scale import _run_bodies, SPANS_PER_POINT

steps = int(sys.argv[1])
records = [extract(parse_protobuf(b), b).spans[0] for b in _run_bodies(steps, seed=steps)]
state = RunState(idle_timeout=3600)
now = 1_700_000_000.0
t0 = time.perf_counter()
for r in records:
    state.apply((r,), now, keep_before=True)
total = time.perf_counter() - t0
print(json.dumps({"us": total / len(records) * 1e6}))
"""


def _child(script: str, arg: int) -> dict[str, float]:
    """Run a measuring script in a fresh process (its own heap); its one JSON line."""
    got = subprocess.run(
        [sys.executable, "-c", script, str(arg)],
        capture_output=True,
        text=True,
        check=True,
        cwd=intake.ROOT,
    )
    return json.loads(got.stdout)  # type: ignore[no-any-return]


def _fold_per_span(progress: Callable[[str], None]) -> dict[int, float]:
    out = {}
    for steps in RUN_LENGTHS:
        out[steps] = float(_child(_FOLD, steps)["us"])
        progress(f"scale: fold at {steps} steps per run: {out[steps]:.1f} us per span")
    return out


_OPEN = r"""
import gc, json, sys, time
import psutil
from sidecar import RunState
from sidecar._gcfreeze import freeze
from sidecar._leases import Owner
from sidecar._otlp import SpanRecord
from saga_otel import semconv as sc

runs = int(sys.argv[1])
now = 1_700_000_000.0  # the injected clock: nothing idles out, nothing is orphaned
resource = {sc.SERVICE_NAME: "bench-agent", sc.SERVICE_INSTANCE_ID: "i-1"}

def batch(first, count):
    spans, owners = [], {}
    for r in range(first, first + count):
        run_id = f"{r:032x}"
        owners[run_id] = Owner(run_id, "i-1", "bench-agent")
        for index in (0, 1):
            attrs = {sc.SAGA_RUN_ID: run_id, sc.SAGA_NAME: "refund", sc.SAGA_PHASE: sc.PHASE_DO,
                     sc.SAGA_STEP_NAME: "issue_credit", sc.SAGA_STEP_INDEX: index,
                     sc.SAGA_STEP_CLASS: "compensable", sc.SAGA_STEP_ATTEMPT: 1,
                     sc.SAGA_CONTRACT_VERSION: 1, sc.SAGA_COMPENSATION_TOOL: "reverse_credit",
                     sc.SAGA_COMPENSATION_ARGS: '{"credit_id": "cr_%d"}' % r,
                     sc.SAGA_COMPENSATION_DESCRIPTION: "reverse the credit"}
            start = now - 10 + index
            spans.append(SpanRecord(run_id, f"{r * 2 + index:016x}", "", "saga.do issue_credit",
                                    start, start + 0.001, "ok", "", attrs, resource))
    return spans, owners

state = RunState(idle_timeout=3600)
state.apply(*batch(10**12, 1)[:1], now)
gc.collect()
idle = psutil.Process().memory_info().rss
for first in range(0, runs, 256):
    spans, owners = batch(first, min(256, runs - first))
    state.apply(spans, now, keep_before=True, owners=owners)
gc.collect()
loaded = psutil.Process().memory_info().rss
t0 = time.perf_counter(); gc.collect(); unfrozen = time.perf_counter() - t0
gc.collect(); gc.freeze()  # as _gcfreeze.freeze_loop does at start
for first in range(runs, runs + 5000, 256):  # a second's traffic at 10k spans/s
    spans, owners = batch(first, 256)
    state.apply(spans, now, keep_before=True, owners=owners)
pauses = []
for round in range(ROUNDS):  # each: a freeze, a second's traffic, then the full collection
    freeze()
    base = runs + 5000 * (round + 1)
    for first in range(base, base + 5000, 256):
        spans, owners = batch(first, 256)
        state.apply(spans, now, keep_before=True, owners=owners)
    t0 = time.perf_counter(); gc.collect(); pauses.append((time.perf_counter() - t0) * 1e3)
print(json.dumps({"per_run": (loaded - idle) / runs, "unfrozen_ms": unfrozen * 1e3,
                  "frozen_ms": sorted(pauses)[len(pauses) // 2], "pauses_ms": pauses,
                  "rss": loaded}))
""".replace("ROUNDS", str(PAUSE_ROUNDS))


def _open_runs(progress: Callable[[str], None]) -> dict[int, dict[str, float]]:
    out = {}
    for runs in OPEN_RUNS:
        out[runs] = _child(_OPEN, runs)
        progress(
            f"scale: {runs:,} open runs: {out[runs]['per_run']:.0f} B per run, full GC "
            f"{out[runs]['unfrozen_ms']:.1f} ms, after freeze {out[runs]['frozen_ms']:.2f} ms"
        )
    return out


_OUTBOX = r"""
import asyncio, json, sqlite3, sys, tempfile, time
from pathlib import Path
from prometheus_client import CollectorRegistry
from sidecar._alerting import Action, AlertEvent
from sidecar._outbox import AlertMetrics, Outbox

rows, alerts, warm = int(sys.argv[1]), ALERTS, 20

class Alertmanager:  # re-sends what fires, as the real one: the resend check runs
    name, kind, resend_interval = "am", "alertmanager", 60.0
    async def send(self, event): return None
    async def close(self): return None

def event(action, run_id):
    labels = {"alertname": "SagaCompensationStarted", "run_id": run_id, "severity": "warning"}
    return AlertEvent(action, labels["alertname"], run_id, "warning", labels,
                      {"summary": "bench"}, 1.0, 1.0)

async def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sidecar.db"
        box = Outbox(path, [Alertmanager()], metrics=AlertMetrics.create(CollectorRegistry()))
        box.add([event(a, f"old-{i}") for i in range(rows // 2)
                 for a in (Action.FIRE, Action.RESOLVE)])
        db = sqlite3.connect(path)  # delivered, as a week of alerts is
        db.execute("UPDATE alert_outbox SET state = 'delivered'"); db.commit(); db.close()
        await box.start()
        try:
            async def alert(run_id):
                for action in (Action.FIRE, Action.RESOLVE):
                    box.add([event(action, run_id)])
                    assert await box.wait_idle()
            for i in range(warm):
                await alert(f"warm-{i}")
            t0 = time.process_time()
            for i in range(alerts):
                await alert(f"new-{i}")
            cpu = time.process_time() - t0
        finally:
            await box.stop()
        box.close()
    print(json.dumps({"us": cpu / alerts * 1e6}))

asyncio.run(main())
""".replace("ALERTS", str(OUTBOX_ALERTS))


def _outbox_per_alert(progress: Callable[[str], None]) -> dict[int, float]:
    out = {}
    for rows in OUTBOX_ROWS:
        out[rows] = float(_child(_OUTBOX, rows)["us"])
        progress(f"scale: alert outbox holding {rows:,} rows: {out[rows]:.0f} us CPU per alert")
    return out


def _load_bodies(rate: int, seconds: float) -> list[bytes]:
    """Paced background load: complete 20-span requests (19 do spans of one run + more)."""
    n = int(rate * seconds / LOAD_SPANS_PER_REQUEST) + 1
    bodies = []
    counter = 5_000_000_000
    for r in range(n):
        run = 7_000_000_000 + r
        spans = []
        for index in range(LOAD_SPANS_PER_REQUEST):
            counter += 1
            spans.append((run, index, counter))
        bodies.append(_request(spans))
    return bodies


_LOADER = r"""
import json, sys, time
from bench._loadgen import drive
from bench.bench_scale import _load_bodies, LOAD_SPANS_PER_REQUEST
port, rate, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
bodies = _load_bodies(rate, seconds)
print("ready", flush=True)
taken = drive(port, bodies, 8, rate=rate / LOAD_SPANS_PER_REQUEST)
print(json.dumps({"spans": len(bodies) * LOAD_SPANS_PER_REQUEST, "seconds": taken}), flush=True)
"""


def _alert_latency(progress: Callable[[str], None]) -> dict[int, list[tuple[float, float, float]]]:
    """Background load -> per repetition (alert p99 ms, export p99 ms, achieved spans/s)."""
    out: dict[int, list[tuple[float, float, float]]] = {rate: [] for rate in LOADS}
    for rate in [r for _ in range(ALERT_REPEATS) for r in LOADS]:
        with tempfile.TemporaryDirectory() as tmp, alerts._Hook() as hook:
            sidecar = alerts._SidecarProc(Path(tmp) / "sidecar.db", hook.url)
            try:
                agent = alerts._Agent(sidecar.otlp)
                for _ in range(10):
                    agent.one(hook)
                seconds = ALERT_SAMPLES * 0.03 + 3
                port = int(sidecar.ports["otlp_http"])
                load = subprocess.Popen(
                    [sys.executable, "-c", _LOADER, str(port), str(rate), str(seconds)],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=intake.ROOT,
                )
                assert load.stdout is not None
                load.stdout.readline()  # bodies built: the load starts now
                time.sleep(0.5)
                alert_ms, export_ms = [], []
                for _ in range(ALERT_SAMPLES):
                    a, e = agent.one(hook)
                    alert_ms.append(a)
                    export_ms.append(e)
                    time.sleep(0.01)
                stats = json.loads(load.communicate(timeout=seconds + 120)[0].splitlines()[-1])
                agent.close()
            finally:
                sidecar.close()
        achieved = stats["spans"] / stats["seconds"]
        got = (alerts._pct(alert_ms, 0.99), alerts._pct(export_ms, 0.99), achieved)
        out[rate].append(got)
        progress(
            f"scale: alert p99 {got[0]:.1f} ms at {achieved:,.0f} spans/s "
            f"(target {rate:,}); export p99 {got[1]:.1f} ms"
        )
    return out


def run(progress: Callable[[str], None]) -> list[Figure]:
    intake._pin_self()
    figures = []
    for label, measure, how in (
        ("ingest", _ingest_per_span, "`saga-sidecar serve` (alerting on, SQLite), one span "
         f"per request, {SPANS_PER_POINT:,} spans per point, raw-socket load generator"),
        ("fold", _fold_per_span, "RunState.apply(keep_before=True), one span per call, "
         f"{SPANS_PER_POINT:,} spans per point"),
    ):  # fmt: skip
        costs = measure(progress)
        base = costs[RUN_LENGTHS[0]]
        for steps in RUN_LENGTHS:
            ratio = costs[steps] / base
            figures.append(
                Figure(
                    area=AREA,
                    name=f"{label} per span, runs of {steps:,} steps",
                    value=costs[steps],
                    unit="us",
                    reference_name=f"{label} per span, runs of {RUN_LENGTHS[0]} steps",
                    reference_value=base,
                    ratio=ratio,
                    goal=f"<= {GOAL_FLAT:g} (flat)",
                    met=ratio <= GOAL_FLAT,
                    notes=how if steps == RUN_LENGTHS[-1] else "",
                )
            )
    for runs, got in _open_runs(progress).items():
        figures.append(
            Figure(
                area=AREA,
                name=f"RSS per open run, {runs:,} open runs (state only)",
                value=got["per_run"],
                unit="bytes",
                reference_name="goal",
                reference_value=2048.0,
                ratio=got["per_run"] / 2048,
                goal="<= 2048 bytes per run (flat)",
                met=got["per_run"] <= 2048,
                notes="" if runs != OPEN_RUNS[-1] else (
                    "RunState in a fresh process, runs of 2 do spans with a compensation, "
                    "an injected clock (nothing idles out); RSS before and after"
                ),
            )
        )  # fmt: skip
        figures.append(
            Figure(
                area=AREA,
                name=f"full GC pause, {runs:,} open runs",
                value=got["frozen_ms"],
                unit="ms",
                reference_name="the same gc.collect() without gc.freeze()",
                reference_value=got["unfrozen_ms"],
                ratio=got["frozen_ms"] / got["unfrozen_ms"] if got["unfrozen_ms"] else 0.0,
                goal=f"<= {GOAL_PAUSE_MS:g} ms",
                met=got["frozen_ms"] <= GOAL_PAUSE_MS,
                notes=(
                    f"median of {PAUSE_ROUNDS} rounds, each: the freeze saga-sidecar serve "
                    "does at start and every second (sidecar/_gcfreeze.py), 10k spans (a "
                    "second at 10k spans/s) folded, then a full gc.collect(); pauses "
                    + ", ".join(f"{p:.1f}" for p in got["pauses_ms"])  # type: ignore[attr-defined]
                    + " ms"
                ),
            )
        )  # fmt: skip
    outbox = _outbox_per_alert(progress)
    for rows, cpu in outbox.items():
        base = outbox[OUTBOX_ROWS[0]]
        figures.append(
            Figure(
                area=AREA,
                name=f"alert outbox CPU per alert, {rows:,} alert rows held",
                value=cpu,
                unit="us",
                reference_name=f"the same with {OUTBOX_ROWS[0]:,} rows held",
                reference_value=base,
                ratio=cpu / base,
                goal=f"<= {GOAL_FLAT:g} (flat)",
                met=cpu / base <= GOAL_FLAT,
                notes="" if rows != OUTBOX_ROWS[-1] else (
                    "sidecar._outbox.Outbox on SQLite in a fresh process, holding that many "
                    "delivered fire and resolve rows of other runs (alerts stay until "
                    "retention prunes their run); one alert: its fire written and "
                    "delivered, then its resolve, each delivery followed by the depth "
                    "gauge and the resend check of an Alertmanager sink; CPU time "
                    f"(process_time) of {OUTBOX_ALERTS} alerts after 20 warm-up. Before "
                    "the outbox's state index and resolved fire marks (schema 4), the "
                    "depth count and the resend check read every row held"
                ),
            )
        )  # fmt: skip
    for rate, reps in _alert_latency(progress).items():
        # The median repetition by alert p99 (its export p99 and rate beside it).
        alert_p99, export_p99, achieved = sorted(reps)[len(reps) // 2]
        figures.append(
            Figure(
                area=AREA,
                name=f"unwind -> webhook alert p99, background load {rate:,} spans/s",
                value=alert_p99,
                unit="ms",
                reference_name="the same OTLP/HTTP export call's own duration, p99",
                reference_value=export_p99,
                ratio=alert_p99 / export_p99 if export_p99 else float("inf"),
                goal=f"p99 <= {alerts.GOAL_P99_MS:g} ms",
                met=alert_p99 <= alerts.GOAL_P99_MS,
                notes=(
                    f"achieved {achieved:,.0f} spans/s ({LOAD_SPANS_PER_REQUEST} spans per "
                    "request, paced raw-socket load generator) into `saga-sidecar serve` "
                    f"with a webhook sink; {ALERT_SAMPLES} unwinds per repetition, the "
                    f"median of {ALERT_REPEATS} interleaved over the loads; alert p99 per "
                    "repetition "
                    + " / ".join(f"{r[0]:.1f}" for r in reps)
                    + " ms, export p99 "
                    + " / ".join(f"{r[1]:.1f}" for r in reps)
                    + " ms"
                ),
            )
        )
    return figures


if __name__ == "__main__":
    for figure in run(print):
        print(figure)
