"""Alerting inside a running sidecar: OTLP spans in, alerts out at a local webhook."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from aiohttp import web
from psycopg import sql
from sidecar_testkit import (
    BOTH_BACKENDS,
    CREDIT,
    FakeClock,
    RunScript,
    compensated_run,
    compensation_failed_run,
    db_for,
    export_http,
    heartbeat_spans,
    open_run,
    refuse_alert_writes,
    settings_for,
    stuck_run,
)

from saga_otel import semconv as sc
from saga_otel.testing import AlertReceiver
from sidecar import Sidecar
from sidecar._alert_service import AlertService, install_alerting
from sidecar._alert_settings import AlertSettings

pytestmark = BOTH_BACKENDS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Hook:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> None:
        async def handle(request: web.Request) -> web.Response:
            self.got.append(await request.json())
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/hook", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def seen(self) -> list[tuple[str, str]]:
        return [(g["alertname"], g["status"]) for g in self.got]

    async def wait(self, alertname: str, status: str, limit: float = 15.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            for g in self.got:
                if (g["alertname"], g["status"]) == (alertname, status):
                    return g
            assert loop.time() < deadline, f"no {alertname} {status}; got {self.seen()}"
            await asyncio.sleep(0.005)


@pytest.fixture
async def hook() -> AsyncIterator[Hook]:
    h = Hook()
    await h.start()
    yield h
    await h.stop()


def alert_settings(hook: Hook, **kw: Any) -> AlertSettings:
    return AlertSettings(webhook_urls=(hook.url,), log_sink=False, **kw)


@pytest.fixture
async def alerted(
    tmp_path: Path, clock: FakeClock, hook: Hook
) -> AsyncIterator[tuple[Sidecar, AlertService]]:
    sidecar = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(sidecar, alert_settings(hook, redact_keys=("credit_id",)))
    async with sidecar:
        yield sidecar, service


def split_at_unwind(run: RunScript) -> tuple[list[Any], list[Any]]:
    spans = run.spans()
    cut = next(i for i, s in enumerate(spans) if s.attributes.get(sc.SAGA_PHASE) == sc.PHASE_UNWIND)
    return spans[: cut + 1], spans[cut + 1 :]


async def api(sidecar: Sidecar, method: str, path: str, **kw: Any) -> Any:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, f"http://127.0.0.1:{sidecar.api_port}{path}", **kw) as resp,
    ):
        return await resp.json() if "json" in resp.content_type else await resp.text()


async def test_the_unwind_span_pages_and_the_compensated_end_resolves(
    alerted: tuple[Sidecar, AlertService], hook: Hook
) -> None:
    sidecar, _ = alerted
    run = compensated_run()
    head, tail = split_at_unwind(run)
    await export_http(sidecar, head)
    fired = await hook.wait(sc.ALERT_COMPENSATION_STARTED, "firing")
    assert fired["labels"]["run_id"] == run.run_id
    assert fired["labels"]["step"] == "notify_billing"
    assert fired["annotations"]["description"] == (
        f"refund run {run.run_id[:8]}… unwinding after notify_billing failed: "
        "TimeoutError: upstream timed out; 2 compensations pending"
    )
    # The API's bound port (0 = any), not the default one: the link must open.
    assert fired["annotations"]["run_url"] == (
        f"http://127.0.0.1:{sidecar.api_port}/runs/{run.run_id}"
    )
    await export_http(sidecar, tail)
    await hook.wait(sc.ALERT_COMPENSATION_STARTED, "resolved")
    assert hook.seen() == [
        (sc.ALERT_COMPENSATION_STARTED, "firing"),
        (sc.ALERT_COMPENSATION_STARTED, "resolved"),
    ]


async def test_a_failed_compensation_pages_with_the_agents_card(
    alerted: tuple[Sidecar, AlertService], hook: Hook
) -> None:
    sidecar, _ = alerted
    await export_http(sidecar, compensation_failed_run().spans())
    failed = await hook.wait(sc.ALERT_COMPENSATION_FAILED, "firing")
    assert failed["severity"] == "critical"
    # The agent's own card, with the redacted credit id masked even inside its text.
    assert json.loads(failed["annotations"]["escalation_card"]) == {
        "not_undone": ["reverse the credit ***"]
    }


async def test_redaction_applies_to_alerts_and_api_views_unless_recovery_reveals(
    alerted: tuple[Sidecar, AlertService], hook: Hook
) -> None:
    sidecar, _ = alerted
    run = compensated_run()
    await export_http(sidecar, split_at_unwind(run)[0])
    fired = await hook.wait(sc.ALERT_COMPENSATION_STARTED, "firing")
    assert CREDIT[1]["credit_id"] not in json.dumps(fired)
    stack = await api(sidecar, "GET", f"/runs/{run.run_id}/stack")
    assert CREDIT[1]["credit_id"] not in json.dumps(stack)
    # ?reveal=args (what saga_otel.recover() asks for) gives the real arguments.
    stack = await api(sidecar, "GET", f"/runs/{run.run_id}/stack?reveal=args")
    assert CREDIT[1]["credit_id"] in json.dumps(stack)


async def test_stuck_pages_and_a_person_resolving_it_resolves(
    alerted: tuple[Sidecar, AlertService], hook: Hook
) -> None:
    sidecar, _ = alerted
    run = stuck_run()
    await export_http(sidecar, run.spans())
    stuck = await hook.wait(sc.ALERT_RUN_STUCK, "firing")
    assert stuck["labels"]["step"] == "close_ticket"
    await api(sidecar, "POST", f"/runs/{run.run_id}/resolve", json={"note": "closed by hand"})
    resolved = await hook.wait(sc.ALERT_RUN_STUCK, "resolved")
    assert "closed by hand" in resolved["annotations"]["resolution"]


async def test_a_dead_agent_pages_orphaned_with_its_stack(
    alerted: tuple[Sidecar, AlertService], hook: Hook, clock: FakeClock
) -> None:
    sidecar, _ = alerted
    run = open_run(instance="agent-7")
    await export_http(sidecar, [*run.spans(), *heartbeat_spans("agent-7", [run.run_id], clock.now)])
    clock.now += 1.0  # a second delivery a second later: the agent sends at once
    await export_http(sidecar, heartbeat_spans("agent-7", [run.run_id], clock.now))
    clock.now += 3.5  # three 1 s heartbeats missed
    sidecar.tick()
    orphaned = await hook.wait(sc.ALERT_RUN_ORPHANED, "firing")
    stack = json.loads(orphaned["annotations"]["stack"])
    assert [item["tool"] for item in stack] == ["reverse_credit"]
    assert orphaned["labels"]["step"] == "issue_credit"
    await api(sidecar, "POST", f"/runs/{run.run_id}/resolve", json={"note": "undone by hand"})
    await hook.wait(sc.ALERT_RUN_ORPHANED, "resolved")


async def test_an_agent_late_once_then_dead_is_paged_both_times(
    alerted: tuple[Sidecar, AlertService], hook: Hook, clock: FakeClock
) -> None:
    """Late (a long pause: orphaned, then heard from again, resolved), dead later: the
    second orphaning pages anew, under its own key, and resolves on its own."""
    sidecar, _ = alerted
    run = open_run(instance="agent-8")
    beat = functools.partial(heartbeat_spans, "agent-8", [run.run_id])
    await export_http(sidecar, [*run.spans(), *beat(clock.now)])
    clock.now += 1.0
    await export_http(sidecar, beat(clock.now))
    clock.now += 3.5  # a pause: three beats missed
    sidecar.tick()
    first = await hook.wait(sc.ALERT_RUN_ORPHANED, "firing")
    await export_http(sidecar, beat(clock.now))  # it was only late
    back = await hook.wait(sc.ALERT_RUN_ORPHANED, "resolved")
    assert back["dedup_key"] == first["dedup_key"]
    for _ in range(3):  # beating steadily again
        clock.now += 1.0
        await export_http(sidecar, beat(clock.now))
        sidecar.tick()
    clock.now += 3.5  # then it dies
    sidecar.tick()
    deadline = asyncio.get_running_loop().time() + 15.0
    while len([g for g in hook.got if g["status"] == "firing"]) < 2:
        assert asyncio.get_running_loop().time() < deadline, hook.seen()
        await asyncio.sleep(0.005)
    second = [g for g in hook.got if g["status"] == "firing"][1]
    assert second["alertname"] == sc.ALERT_RUN_ORPHANED
    assert second["dedup_key"] != first["dedup_key"] and run.run_id in second["dedup_key"]
    await api(sidecar, "POST", f"/runs/{run.run_id}/resolve", json={"note": "undone by hand"})
    while len([g for g in hook.got if g["status"] == "resolved"]) < 2:
        assert asyncio.get_running_loop().time() < deadline, hook.seen()
        await asyncio.sleep(0.005)
    assert [g["dedup_key"] for g in hook.got if g["status"] == "resolved"][1] == second["dedup_key"]


async def test_alert_metrics_are_on_the_sidecars_metrics_page(
    alerted: tuple[Sidecar, AlertService], hook: Hook
) -> None:
    sidecar, service = alerted
    await export_http(sidecar, split_at_unwind(compensated_run())[0])
    await hook.wait(sc.ALERT_COMPENSATION_STARTED, "firing")
    assert await service.outbox.wait_idle()
    text = await api(sidecar, "GET", "/metrics")
    assert (
        'saga_sidecar_alerts_total{alertname="SagaCompensationStarted",outcome="delivered",'
        'sink="webhook"} 1.0' in text
    )
    assert 'saga_sidecar_alert_delay_seconds_count{sink="webhook"} 1.0' in text
    assert "saga_sidecar_outbox_depth 0.0" in text
    assert "saga_sidecar_alerts_unwritten 0.0" in text
    assert "saga_sidecar_alerts_dropped_total 0.0" in text


@pytest.mark.parametrize("first_alerts", [False, True], ids=["no-alerting", "write-lost"])
async def test_an_unwind_acknowledged_just_before_a_crash_still_pages(
    tmp_path: Path, clock: FakeClock, hook: Hook, first_alerts: bool
) -> None:
    run = compensated_run()
    # The first sidecar stores the unwind span and dies before any alert is written:
    # with no alerting, or (write-lost) in the gap between the span's 200 and the
    # outbox write that add_soon holds for after it.
    first = Sidecar(settings_for(tmp_path), clock=clock)
    if first_alerts:
        held = install_alerting(first, alert_settings(hook)).outbox
        held.add_soon = lambda events: None  # type: ignore[method-assign]
    async with first:
        await export_http(first, split_at_unwind(run)[0])
    assert hook.got == []
    second = Sidecar(settings_for(tmp_path), clock=clock)
    install_alerting(second, alert_settings(hook))
    async with second:
        fired = await hook.wait(sc.ALERT_COMPENSATION_STARTED, "firing")
        assert fired["labels"]["run_id"] == run.run_id
    # A third start re-evaluates the same views and pages nobody again.
    third = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(third, alert_settings(hook))
    async with third:
        await asyncio.wait_for(service.reevaluated.wait(), 15)
        assert service.outbox.depth() == 0
        assert await service.outbox.wait_idle()
    assert len(hook.got) == 1


async def test_alerts_that_waited_for_a_mistyped_url_reach_the_corrected_one(
    tmp_path: Path, clock: FakeClock, hook: Hook
) -> None:
    """Runbook SagaSidecarOutboxBacklog: "fix the sink (URL, ...). The outbox is durable
    and drains on its own once the sink accepts." Started with a mistyped webhook URL
    (nothing listens there), a run pages and another pages and resolves; restarted with
    the URL corrected, every one of those alerts reaches it and the backlog clears."""
    typo = f"http://127.0.0.1:{free_port()}/hook"
    failed, resolved = compensation_failed_run(), compensated_run(t0=clock.now - 6.0)
    first = Sidecar(settings_for(tmp_path), clock=clock)
    outbox = install_alerting(first, AlertSettings(webhook_urls=(typo,), log_sink=False)).outbox
    async with first:
        await export_http(first, failed.spans())
        await export_http(first, resolved.spans())  # paged and resolved during the outage
        for _ in range(3000):
            await outbox.flush()
            if await outbox.call(outbox.depth) == 4:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError(f"not every alert written: {outbox.rows()}")
    second = Sidecar(settings_for(tmp_path), clock=clock)
    outbox = install_alerting(second, alert_settings(hook)).outbox
    async with second:
        for _ in range(3000):
            if len(hook.got) >= 4 and await outbox.call(outbox.depth) == 0:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError(f"got {hook.seen()}, depth {outbox.depth()}")
        metrics = await api(second, "GET", "/metrics")
    assert "saga_sidecar_outbox_depth 0.0" in metrics
    got = [(g["alertname"], g["run_id"], g["status"]) for g in hook.got]
    started, failing = sc.ALERT_COMPENSATION_STARTED, sc.ALERT_COMPENSATION_FAILED
    assert sorted(got) == sorted(
        [
            (started, failed.run_id, "firing"),
            (failing, failed.run_id, "firing"),
            (started, resolved.run_id, "firing"),
            (started, resolved.run_id, "resolved"),
        ]
    )
    assert [s for _, r, s in got if r == resolved.run_id] == ["firing", "resolved"]


async def test_saga_sidecar_serve_wires_the_alert_flags(tmp_path: Path, hook: Hook) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    proc = serve(
        [
            sys.executable,
            "-c",
            "from sidecar._cli import main; main()",
            "serve",
            "--otlp-http-port=0",
            "--otlp-grpc-port=0",
            "--api-port=0",
            f"--db={tmp_path / 'cli.db'}",
            f"--webhook={hook.url}",
            "--route=warning=webhook",
            "--route=critical=log",
            "--redact-key=credit_id",
            "--public-url=https://sidecar.example",
            "--no-alert-log",
        ]
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        ports = json.loads(line)
        run = compensated_run()
        exporter = OTLPSpanExporter(
            endpoint=f"http://127.0.0.1:{ports['otlp_http']}/v1/traces", timeout=10
        )
        try:
            await asyncio.to_thread(exporter.export, split_at_unwind(run)[0])
        finally:
            exporter.shutdown()
        fired = await hook.wait(sc.ALERT_COMPENSATION_STARTED, "firing", limit=30)
        assert fired["annotations"]["run_url"] == f"https://sidecar.example/runs/{run.run_id}"
        assert CREDIT[1]["credit_id"] not in json.dumps(fired)
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def serve(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


@pytest.mark.parametrize("late", [True, False], ids=["late-alerts", "no-late-alerts"])
async def test_a_whole_run_in_one_request_still_pages_its_compensation(
    tmp_path: Path, clock: FakeClock, late: bool
) -> None:
    # A BatchSpanProcessor sends a short run in one request: the unwind with the end.
    receiver = AlertReceiver()
    sidecar = Sidecar(settings_for(tmp_path), clock=clock)
    settings = AlertSettings(webhook_urls=(receiver.url,), log_sink=False, late_compensation=late)
    install_alerting(sidecar, settings)
    run = compensated_run(t0=clock.now - 6.0)
    blocker = compensation_failed_run(t0=clock.now)  # delivered after: the queue is drained
    try:
        async with sidecar:
            await export_http(sidecar, run.spans())
            await export_http(sidecar, blocker.spans())
            for _ in range(3000):
                if receiver.find(sc.ALERT_COMPENSATION_FAILED, blocker.run_id):
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError(f"no alert delivered: {receiver.alerts}")
            mine = [a for a in receiver.alerts if a["run_id"] == run.run_id]
            if not late:
                assert mine == []
                return
            assert [(a["alertname"], a["status"]) for a in mine] == [
                (sc.ALERT_COMPENSATION_STARTED, "firing"),
                (sc.ALERT_COMPENSATION_STARTED, "resolved"),
            ]
            unwind_at = next(
                s.start_time for s in run.spans() if s.attributes[sc.SAGA_PHASE] == "unwind"
            )
            late_by = clock.now - (unwind_at or 0) / 1e9
            for alert in mine:
                assert alert["annotations"]["late_by_s"] == f"{late_by:.3f}"
                assert "arrived batched" in alert["annotations"]["description"]
    finally:
        receiver.stop()


# An agent on the OpenTelemetry SDK's defaults: a BatchSpanProcessor (5 s schedule delay)
# and the stock OTLP/HTTP exporter. It opens a run, then beats every second until killed.
_BATCHING_AGENT = """
import sys, time
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from saga_otel import semconv as sc

provider = TracerProvider(resource=Resource.create({sc.SERVICE_NAME: "batching-agent"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1])))
tracer = provider.get_tracer("agent")
run = tracer.start_span("saga.run refund")
run_id = f"{run.get_span_context().trace_id:032x}"
tracer.start_span("saga.do issue_credit", context=trace.set_span_in_context(run), attributes={
    sc.SAGA_RUN_ID: run_id, sc.SAGA_NAME: "refund", sc.SAGA_CONTRACT_VERSION: 1,
    sc.SAGA_PHASE: sc.PHASE_DO, sc.SAGA_STEP_NAME: "issue_credit", sc.SAGA_STEP_INDEX: 0,
    sc.SAGA_STEP_CLASS: "compensable", sc.SAGA_STEP_ATTEMPT: 1,
    sc.SAGA_COMPENSATION_TOOL: "reverse_credit", sc.SAGA_COMPENSATION_ARGS: '{"id": 1}',
}).end()
print(run_id, flush=True)
while True:
    tracer.start_span(sc.HEARTBEAT_SPAN_NAME, attributes={
        sc.SAGA_PHASE: sc.PHASE_HEARTBEAT, sc.SAGA_CONTRACT_VERSION: 1,
        sc.SAGA_HEARTBEAT_OPEN_RUNS: [run_id], sc.SAGA_HEARTBEAT_INTERVAL_S: 1.0,
    }).end()
    time.sleep(1.0)
"""


async def _watch_an_agent(
    tmp_path: Path, script_text: str, alive: Callable[[Sidecar, str], Awaitable[None]]
) -> None:
    """A real sidecar (alerting to a receiver) and a real agent process that opens a run
    and heart-beats; ``alive(sidecar, run_id)`` checks the agent is not paged while it
    lives; then the agent is SIGKILLed (nothing flushed) and must be paged orphaned."""
    script = tmp_path / "agent.py"
    script.write_text(script_text)
    receiver = AlertReceiver()
    sidecar = Sidecar(settings_for(tmp_path, tick_interval=0.1))  # the real clock
    install_alerting(sidecar, AlertSettings(webhook_urls=(receiver.url,), log_sink=False))
    try:
        async with sidecar:
            agent = await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces",
                stdout=asyncio.subprocess.PIPE,
            )
            try:
                assert agent.stdout is not None
                run_id = (await agent.stdout.readline()).decode().strip()
                await alive(sidecar, run_id)
                assert receiver.find(sc.ALERT_RUN_ORPHANED, run_id) is None
                agent.kill()  # SIGKILL: nothing is flushed
                await agent.wait()
                for _ in range(300):  # bounded by the learned window: well inside 30 s
                    if receiver.find(sc.ALERT_RUN_ORPHANED, run_id):
                        break
                    await asyncio.sleep(0.1)
                assert sidecar.state.status(run_id) == sc.STATE_ORPHANED
                assert receiver.find(sc.ALERT_RUN_ORPHANED, run_id) is not None
            finally:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()
    finally:
        receiver.stop()


async def _statuses_for(sidecar: Sidecar, run_id: str, seconds: float) -> set[str | None]:
    """The run's statuses seen every 50 ms for ``seconds``."""
    loop = asyncio.get_running_loop()
    until, seen = loop.time() + seconds, set()
    while loop.time() < until:
        seen.add(sidecar.state.status(run_id))
        await asyncio.sleep(0.05)
    return seen


async def test_a_batching_agent_is_not_orphaned_while_alive_and_is_when_killed(
    tmp_path: Path,
) -> None:
    async def alive(sidecar: Sidecar, run_id: str) -> None:
        # Three batches and more: deliveries 5 s apart, beats 1 s apart.
        assert await _statuses_for(sidecar, run_id, 16.0) - {None} == {sc.STATE_RUNNING}

    await _watch_an_agent(tmp_path, _BATCHING_AGENT, alive)


# An agent that exports each span at once (SimpleSpanProcessor) and beats every 0.5 s:
# the sidecar orphans it after 1.5 s of silence.
_PROMPT_AGENT = _BATCHING_AGENT.replace("BatchSpanProcessor", "SimpleSpanProcessor").replace(
    "1.0", "0.5"
)


async def test_a_stalled_sidecar_does_not_orphan_the_agents_it_did_not_hear(
    tmp_path: Path,
) -> None:
    """The sidecar's own loop blocked for longer than an agent's orphan window (a GC
    pause, a slow commit, a stopped process): the agent's heartbeats wait unread in the
    socket. The first tick after the stall must not page the agent it failed to hear;
    a real death after the stall is still paged. (Seen in CI: a live Node.js agent paged
    orphaned, "heard from 0.2 s after the orphan mark".)"""

    async def alive(sidecar: Sidecar, run_id: str) -> None:
        await asyncio.sleep(2.0)  # a few beats: its window is learned
        assert sidecar.state.status(run_id) == sc.STATE_RUNNING
        # The sidecar's loop stalls (the blocking call is the point): 5 beats' worth.
        time.sleep(2.5)  # noqa: ASYNC251
        assert await _statuses_for(sidecar, run_id, 3.0) == {sc.STATE_RUNNING}

    await _watch_an_agent(tmp_path, _PROMPT_AGENT, alive)


async def test_a_stalled_database_does_not_orphan_the_agents_it_heard(tmp_path: Path) -> None:
    """The store stops answering for longer than an agent's orphan window (another
    session holds a lock the intake needs: a migration, a backup, a vacuum): the
    agent's heartbeats arrive but cannot be committed, so they are not folded yet. When
    the database answers again, the first tick must not page the agent whose beats were
    waiting on it; a real death afterwards is still paged."""

    async def alive(sidecar: Sidecar, run_id: str) -> None:
        await asyncio.sleep(2.0)  # a few beats: its window is learned
        assert sidecar.state.status(run_id) == sc.STATE_RUNNING
        held = threading.Event()
        holder = asyncio.create_task(asyncio.to_thread(_hold_the_intake_lock, sidecar, held, 2.5))
        assert await asyncio.to_thread(held.wait, 10)
        seen = await _statuses_for(sidecar, run_id, 5.5)  # the stall and 3 s after it
        await holder
        assert seen == {sc.STATE_RUNNING}

    await _watch_an_agent(tmp_path, _PROMPT_AGENT, alive)


def _hold_the_intake_lock(sidecar: Sidecar, held: threading.Event, seconds: float) -> None:
    """Hold, from another session, the lock the intake's next COMMIT needs, for
    ``seconds``: SQLite's write lock (BEGIN IMMEDIATE), PostgreSQL's spans table."""
    settings = sidecar.settings
    if settings.db_url:
        with psycopg.connect(settings.db_url, autocommit=False) as conn:
            conn.execute("LOCK TABLE spans IN ACCESS EXCLUSIVE MODE")
            held.set()
            time.sleep(seconds)
            conn.commit()
        return
    conn = sqlite3.connect(settings.db_path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
    finally:
        conn.close()


async def test_the_start_line_lists_the_sinks_that_are_on_without_their_secrets(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A sink its flags left off (an empty routing key, once) showed nowhere: the start
    line names each sink that is on, as the outbox shows it, no path, no key."""
    caplog.set_level(logging.INFO, logger="sidecar")
    settings = AlertSettings(
        webhook_urls=("https://hooks.example/services/T0/XSECRETX",),
        alertmanager_urls=("http://127.0.0.1:9093",),
        pagerduty_routing_key="RKEYSECRET0123456789abcdef012345",
    )
    sidecar = Sidecar(settings_for(tmp_path), clock=clock)
    install_alerting(sidecar, settings)
    async with sidecar:
        pass
    (started,) = [r.__dict__ for r in caplog.records if r.getMessage() == "sidecar.started"]
    assert started["alert_sinks"] == [
        "alertmanager:http://127.0.0.1:9093",
        "pagerduty:https://events.pagerduty.com/…",
        "webhook:https://hooks.example/…",
        "log",
    ]
    assert "SECRET" not in repr(started)


async def _paged(hook: Hook, run_id: str, alertname: str = sc.ALERT_COMPENSATION_FAILED) -> None:
    deadline = asyncio.get_running_loop().time() + 15.0
    while not any(
        (g["alertname"], g["status"], g["labels"].get("run_id")) == (alertname, "firing", run_id)
        for g in hook.got
    ):
        assert asyncio.get_running_loop().time() < deadline, f"{run_id}: {hook.seen()}"
        await asyncio.sleep(0.005)


async def test_an_agents_card_of_any_shape_pages_shows_and_survives_a_restart(
    tmp_path: Path, clock: FakeClock, hook: Hook
) -> None:
    """Go writes an empty list as null; an agent may write a number where a list was
    meant. Each such run pages SagaCompensationFailed, `runs show` draws it, its page
    answers; and after a restart (which re-evaluates their views) an ordinary run still
    pages: one card once stopped every run's alerts for good."""
    from click.testing import CliRunner

    from sidecar._cli import main

    hostile = [
        compensation_failed_run({"done": None, "decide": ["look"]}),
        compensation_failed_run({"done": 5, "decide": ["look"]}),
    ]
    first = Sidecar(settings_for(tmp_path), clock=clock)
    install_alerting(first, alert_settings(hook))
    async with first:
        base = f"http://127.0.0.1:{first.api_port}"
        for run in hostile:
            await export_http(first, run.spans())
            await _paged(hook, run.run_id)
            shown = await asyncio.to_thread(
                CliRunner().invoke, main, ["runs", "show", run.run_id, "--api", base]
            )
            assert shown.exit_code == 0, shown.output
            assert "You must decide:\n  - look" in shown.output
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"{base}/ui/runs/{run.run_id}", headers={"Accept": "text/html"}) as page,
            ):
                assert page.status == 200, await page.text()
    second = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(second, alert_settings(hook))
    async with second:
        await asyncio.wait_for(service.reevaluated.wait(), 15)
        plain = compensation_failed_run()
        await export_http(second, plain.spans())
        await _paged(hook, plain.run_id)
        assert second.failed_tasks == [] and service.evaluation_failures == 0


def _failing_for(run_id: str) -> Callable[..., Any]:
    """The alert rules, raising on ``run_id``'s view: a fault no test foresaw."""
    from sidecar import _alerting

    def evaluate(before: Any, after: Any, *args: Any, **kw: Any) -> Any:
        if after.get("run_id") == run_id:
            raise KeyError("a fault in the rules")
        return _alerting.evaluate(before, after, *args, **kw)

    return evaluate


def _evaluation_failures(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.__dict__ for r in caplog.records if r.getMessage() == "sidecar.alerts.evaluation_failed"
    ]


async def test_rules_failing_on_one_runs_view_cost_only_that_runs_alerts(
    alerted: tuple[Sidecar, AlertService],
    hook: Hook,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="sidecar")
    sidecar, service = alerted
    bad, good = compensation_failed_run(), compensation_failed_run()
    monkeypatch.setattr("sidecar._alert_service.evaluate", _failing_for(bad.run_id))
    await export_http(sidecar, bad.spans() + good.spans())
    await _paged(hook, good.run_id)
    assert not [g for g in hook.got if g["labels"].get("run_id") == bad.run_id]
    assert service.evaluation_failures >= 1
    (logged, *_) = _evaluation_failures(caplog)
    assert logged["run_id"] == bad.run_id and logged["error"] == "KeyError: 'a fault in the rules'"
    metrics = await api(sidecar, "GET", "/metrics")
    assert f"saga_sidecar_alert_evaluation_failures_total {service.evaluation_failures:.1f}" in (
        metrics
    )


async def test_a_view_the_rules_fail_on_at_start_costs_no_other_runs_alerts(
    tmp_path: Path,
    clock: FakeClock,
    hook: Hook,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The start-up re-evaluation runs before delivery begins: one view it raised on
    killed the delivery task, and no alert of any run went out until the next start."""
    caplog.set_level(logging.ERROR, logger="sidecar")
    bad, good = compensation_failed_run(), compensation_failed_run()
    async with Sidecar(settings_for(tmp_path), clock=clock) as first:  # no alerting yet
        await export_http(first, bad.spans() + good.spans())
    monkeypatch.setattr("sidecar._alert_service.evaluate", _failing_for(bad.run_id))
    second = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(second, alert_settings(hook))
    async with second:
        await _paged(hook, good.run_id)
        later = compensation_failed_run()
        await export_http(second, later.spans())
        await _paged(hook, later.run_id)
        assert service.evaluation_failures == 1 and second.failed_tasks == []
        (logged,) = _evaluation_failures(caplog)
        assert logged["run_id"] == bad.run_id
        assert "saga_sidecar_alert_evaluation_failures_total 1.0" in (
            await api(second, "GET", "/metrics")
        )
    assert not [g for g in hook.got if g["labels"].get("run_id") == bad.run_id]


async def test_a_dead_delivery_task_fails_healthz_and_shows_on_metrics(
    tmp_path: Path, clock: FakeClock, hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    """Alerts a dead delivery task leaves unsent are not silent: /healthz answers 503
    naming it (a liveness probe restarts the sidecar, whose start raises every alert
    owed), saga_sidecar_tasks_failed is 1 (rule SagaSidecarTaskFailed), the log says why."""
    caplog.set_level(logging.ERROR, logger="sidecar")
    sidecar = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(sidecar, alert_settings(hook))

    async def broken(views_of: Any) -> int:
        raise RuntimeError("the outbox went away")

    service.remask = broken  # type: ignore[method-assign]
    async with sidecar:
        deadline = asyncio.get_running_loop().time() + 15.0
        while not sidecar.failed_tasks:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{sidecar.api_port}/healthz") as resp,
        ):
            health = await resp.json()
            assert resp.status == 503, health
        assert health["status"] == "failing"
        assert health["failed_tasks"] == ["install_alerting.deliver"]
        assert "restart" in health["fix"] and "install_alerting.deliver" in health["fix"]
        assert "saga_sidecar_tasks_failed 1.0" in await api(sidecar, "GET", "/metrics")
    (logged,) = [r.__dict__ for r in caplog.records if r.getMessage() == "sidecar.task.failed"]
    assert logged["task"] == "install_alerting.deliver"
    assert logged["error"] == "RuntimeError: the outbox went away"


async def test_a_start_whose_alerts_the_database_refuses_writes_and_delivers_them_later(
    tmp_path: Path, clock: FakeClock, hook: Hook
) -> None:
    """The start's re-evaluation raises what a crash left unsaid; if the database refuses
    its write, the alerts wait and are written once it answers, and delivery runs
    meanwhile. The refusal ended the delivery task: nothing was sent until the next
    restart."""
    run = compensated_run()
    first = Sidecar(settings_for(tmp_path), clock=clock)
    install_alerting(first, alert_settings(hook)).outbox.add_soon = lambda events: None  # type: ignore[method-assign]
    async with first:
        await export_http(first, split_at_unwind(run)[0])  # its alert lost to a crash
    db = db_for(tmp_path / "sidecar.db")
    refuse_alert_writes(db)
    second = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(second, alert_settings(hook))
    async with second:
        await asyncio.wait_for(service.reevaluated.wait(), 15)
        assert hook.got == [] and service.outbox.rows() == []
        refuse_alert_writes(db, refuse=False)
        fired = await hook.wait(sc.ALERT_COMPENSATION_STARTED, "firing")
        assert fired["labels"]["run_id"] == run.run_id


async def test_an_agent_dead_while_the_database_refuses_writes_pages_once_it_answers(
    tmp_path: Path, clock: FakeClock, hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    """Runbooks SagaSidecarStoreFailing and SagaSidecarIntakeStalled: free the database,
    no restart. An agent dies while another session holds the lock the sidecar's writes
    need (SQLite's write lock; PostgreSQL's marks and outbox tables) past the busy or lock
    timeout: the run's orphan mark and its alert are refused. Once the lock is gone, the
    sidecar still running, the alert is written and delivered and the mark stored. Both
    were dropped: no page until a restart, and the restart, missing the mark, folded the
    run back as running, resolving the page, then paged it again once quiet."""
    settings = settings_for(tmp_path)
    if settings.db_url:
        with psycopg.connect(settings.db_url, autocommit=True) as conn:
            (name,) = conn.execute("SELECT current_database()").fetchone() or ("",)
            # Each session of the sidecar's gives up a lock wait after 0.2 s (the default
            # waits for ever: a delay, never a refusal).
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET lock_timeout = '200ms'").format(sql.Identifier(name))
            )
    caplog.set_level(logging.ERROR, logger="sidecar")
    sidecar = Sidecar(settings, clock=clock)
    service = install_alerting(sidecar, alert_settings(hook))
    async with sidecar:
        if not settings.db_url:
            # Its busy timeouts (5 s and 10 s) only make the test slow: refused sooner.
            store, outbox = sidecar.store, service.outbox._store
            for db in (store._db, outbox._db):  # type: ignore[union-attr, attr-defined]
                db.execute("PRAGMA busy_timeout = 200")
        run = open_run(instance="agent-9")
        beat = functools.partial(heartbeat_spans, "agent-9", [run.run_id])
        await export_http(sidecar, [*run.spans(), *beat(clock.now)])
        clock.now += 1.0
        await export_http(sidecar, beat(clock.now))
        held, release = threading.Event(), threading.Event()
        holder = asyncio.create_task(asyncio.to_thread(_hold_the_writes, settings, held, release))
        assert await asyncio.to_thread(held.wait, 10)
        clock.now += 3.5  # three 1 s heartbeats missed: dead
        sidecar.tick()
        await _until(lambda: any(_alert_refused(r) for r in caplog.records))
        await _until(lambda: any(_mark_refused(r) for r in caplog.records))
        registry = sidecar.metrics.registry
        assert registry.get_sample_value(sc.M_SIDECAR_ALERTS_UNWRITTEN) == 1
        assert hook.got == [] and _stored_mark(settings, run.run_id) is None
        release.set()
        await holder
        await hook.wait(sc.ALERT_RUN_ORPHANED, "firing")
        await _until(lambda: _stored_mark(settings, run.run_id) is not None)
        assert registry.get_sample_value(sc.M_SIDECAR_ALERTS_UNWRITTEN) == 0
    # Restarted, it folds the run back orphaned: nothing resolves, nothing pages again.
    again = Sidecar(settings, clock=clock)
    service = install_alerting(again, alert_settings(hook))
    async with again:
        await asyncio.wait_for(service.reevaluated.wait(), 15)
        assert await service.outbox.wait_idle()
        assert again.state.status(run.run_id) == sc.STATE_ORPHANED
    assert hook.seen() == [(sc.ALERT_RUN_ORPHANED, "firing")]


async def _until(cond: Callable[[], bool], limit: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _alert_refused(record: logging.LogRecord) -> bool:
    return record.getMessage() == "sidecar.alerts.write_failed"


def _mark_refused(record: logging.LogRecord) -> bool:
    """The log line of a refused orphan mark: at once on SQLite, from the database
    thread on PostgreSQL."""
    message = record.getMessage()
    return message == "sidecar.orphan_marks.not_stored" or (
        message == "sidecar.db.write_failed" and record.__dict__.get("what") == "store orphan marks"
    )


def _stored_mark(settings: Any, run_id: str) -> float | None:
    """The run's orphan mark as the database holds it, read on a session of its own."""
    if settings.db_url:
        with psycopg.connect(settings.db_url) as conn:
            row = conn.execute(
                "SELECT orphaned_at FROM run_marks WHERE run_id = %s", (run_id,)
            ).fetchone()
    else:
        db = sqlite3.connect(settings.db_path)
        try:
            row = db.execute(
                "SELECT orphaned_at FROM run_marks WHERE run_id = ?", (run_id,)
            ).fetchone()
        finally:
            db.close()
    return None if row is None or row[0] is None else float(row[0])


def _hold_the_writes(settings: Any, held: threading.Event, release: threading.Event) -> None:
    """Hold, from another session, what the sidecar's writes of orphan marks and alerts
    need, until ``release``: SQLite's write lock; PostgreSQL's two tables (reads pass)."""
    if settings.db_url:
        with psycopg.connect(settings.db_url, autocommit=False) as conn:
            conn.execute("SET lock_timeout = 0")
            conn.execute("LOCK TABLE run_marks, alert_outbox IN EXCLUSIVE MODE")
            held.set()
            release.wait(60)
            conn.commit()
        return
    db = sqlite3.connect(settings.db_path, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        held.set()
        release.wait(60)
        db.execute("COMMIT")
    finally:
        db.close()
