"""The outbox: once per dedup key per sink, at least once, in order, across restarts."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from sidecar_testkit import BOTH_BACKENDS, db_for, refuse_alert_writes

from saga_otel import semconv as sc
from sidecar import _outbox as outbox_module
from sidecar._alert_service import AlertService
from sidecar._alert_settings import AlertSettings
from sidecar._alerting import Action, AlertEvent, dedup_key, evaluate
from sidecar._backends import open_store
from sidecar._errors import ConfigError, StoreError
from sidecar._outbox import (
    DELIVERED,
    FAILED,
    HELD,
    PENDING,
    REHOMED,
    AlertMetrics,
    Backoff,
    Outbox,
    Routing,
    Unwritten,
    alert_history,
)
from sidecar._outbox_sql import COUNT_IN_STATE, FIRING, PRUNE_RUN_ALERTS
from sidecar._sinks import DeliveryRetry, PagerDutySink, WebhookSink
from sidecar._storage import DbTarget, PutAway

pytestmark = BOTH_BACKENDS


@pytest.fixture(autouse=True)
def close_outboxes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every outbox a test opens (on PostgreSQL each holds a connection pool)."""
    opened: list[Outbox] = []
    init = Outbox.__init__

    def tracked(self: Outbox, *args: Any, **kw: Any) -> None:
        init(self, *args, **kw)
        opened.append(self)

    monkeypatch.setattr(Outbox, "__init__", tracked)
    yield
    for box in opened:
        box.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Receiver:
    def __init__(self) -> None:
        self.bodies: list[Any] = []
        self.script: list[tuple[int, str, dict[str, str]]] = []
        self.runner: web.AppRunner | None = None
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        if self.script:
            status, text, headers = self.script.pop(0)
            return web.Response(status=status, text=text, headers=headers)
        return web.json_response({"status": "success"}, status=202)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def keys(self) -> list[tuple[str, str]]:
        return [(b["dedup_key"], b["action"]) for b in self.bodies]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()
    await rec.start()
    yield rec
    await rec.stop()


class FakeSink:
    """An in-memory sink: records what it got, fails while told to."""

    def __init__(self, kind: str = "webhook", name: str = "fake", resend: float | None = None):
        self._kind, self._name, self._resend = kind, name, resend
        self.got: list[AlertEvent] = []
        self.fail = 0

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def name(self) -> str:
        return self._name

    @property
    def resend_interval(self) -> float | None:
        return self._resend

    async def send(self, event: AlertEvent) -> None:
        if self.fail:
            self.fail -= 1
            raise DeliveryRetry("down")
        self.got.append(event)

    async def close(self) -> None:
        return None


def view(run_id: str, **over: Any) -> dict[str, Any]:
    base = {
        "run_id": run_id,
        "saga": "refund",
        "service": "agent",
        "instance": "i1",
        "status": "running",
        "updated_at": 1.0,
        "failed_step": None,
        "unwind_reason": None,
        "unwind_started_at": None,
        "steps": [],
        "stack": [],
        "escalation": None,
        "resolution": None,
    }
    base.update(over)
    return base


def unwinding(run_id: str) -> dict[str, Any]:
    return view(
        run_id, status="unwinding", failed_step="send", unwind_reason="E: x", unwind_started_at=1.0
    )


def fire(run_id: str) -> AlertEvent:
    (event,) = evaluate(view(run_id), unwinding(run_id), now=2.0)
    return event


def resolve(run_id: str) -> AlertEvent:
    (event,) = evaluate(unwinding(run_id), view(run_id, status="compensated"), now=3.0)
    return event


async def no_sleep(_: float) -> None:
    await asyncio.sleep(0)


async def wait_for(cond: Any, limit: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


# --- recording --------------------------------------------------------------------------


def test_one_row_per_dedup_key_action_and_sink(tmp_path: Path) -> None:
    a, b = FakeSink(name="a"), FakeSink(name="b")
    box = Outbox(db_for(tmp_path / "db"), [a, b])
    assert box.add([fire("r1")]) == 2
    # Re-evaluation and restarts raise the same events again: nothing new.
    assert box.add([fire("r1")]) == 0
    assert box.add([resolve("r1")]) == 2
    # A re-fire under the same dedup key after a resolve never pages again.
    assert box.add([fire("r1")]) == 0
    assert Outbox(db_for(tmp_path / "db"), [a, b]).add([fire("r1"), resolve("r1")]) == 0
    assert len(box.rows()) == 4


def test_a_resolve_follows_its_fire_only_and_repeats_its_labels(tmp_path: Path) -> None:
    pd, hook = FakeSink("pagerduty", "pd"), FakeSink("webhook", "hook")
    routing = Routing.parse(["warning=webhook", "critical=pagerduty,webhook"])
    box = Outbox(db_for(tmp_path / "db"), [pd, hook], routing)
    assert box.add([fire("r1")]) == 1  # warning: webhook only
    changed = resolve("r1")
    # The view changed since (say the failed step label); the resolve keeps the fire's.
    changed = AlertEvent.from_dict({**changed.to_dict(), "labels": {"step": "other"}})
    assert box.add([changed]) == 1
    rows = box.rows()
    assert [(r.sink, r.action) for r in rows] == [("hook", "fire"), ("hook", "resolve")]
    assert rows[1].event.labels == rows[0].event.labels
    assert rows[1].event.starts_at == rows[0].event.starts_at
    # A resolve for something never fired goes nowhere.
    assert box.add([resolve("never")]) == 0


def test_routing_parse_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="--route critical=pagerduty"):
        Routing.parse(["critical"])
    with pytest.raises(ConfigError, match=r"unknown sink.*'pager'"):
        Routing.parse(["critical=pager"])
    routing = Routing.parse(["critical=pagerduty", "critical=webhook"])
    assert routing.allows("critical", "webhook") and not routing.allows("warning", "webhook")
    assert Routing.parse([]).allows("warning", "pagerduty")


# --- delivering -------------------------------------------------------------------------


async def test_retries_503_and_429_with_backoff_then_delivers_once(
    tmp_path: Path, receiver: Receiver
) -> None:
    receiver.script += [
        (503, "busy", {}),
        (429, "slow", {"Retry-After": "7"}),
        (503, "", {"Retry-After": "0"}),  # must not retry at once: the backoff still holds
    ]
    sleeps: list[float] = []

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        await asyncio.sleep(0)

    registry = CollectorRegistry()
    box = Outbox(
        db_for(tmp_path / "db"),
        [PagerDutySink("rk", url=receiver.url)],
        metrics=AlertMetrics.create(registry),
        backoff=Backoff(initial=1.0, maximum=30.0, jitter=0.5),
        sleep=sleep,
        rng=random.Random(1),
    )
    box.add([fire("r1")])
    await box.start()
    try:
        assert await box.wait_idle()
    finally:
        await box.stop()
    assert len(receiver.bodies) == 4  # three refusals, one acceptance
    assert receiver.bodies[-1]["event_action"] == "trigger"
    assert [r.state for r in box.rows()] == [DELIVERED]
    # Exponential with jitter; the server's Retry-After lengthens a delay, never shortens it.
    assert 1.0 <= sleeps[0] <= 1.5
    assert sleeps[1] == 7.0
    assert 4.0 <= sleeps[2] <= 6.0
    labels = {"alertname": sc.ALERT_COMPENSATION_STARTED, "sink": "pagerduty"}
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS, {**labels, "outcome": "retried"}) == 3
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS, {**labels, "outcome": "delivered"}) == 1


async def test_a_send_that_never_answers_is_cut_and_retried(tmp_path: Path) -> None:
    """A sink that never answers (one without a timeout of its own) is cut at the sinks'
    timeout and retried: on PostgreSQL no send may outlive the hold that keeps other
    replicas off its row."""

    class Hangs(FakeSink):
        hung = False

        async def send(self, event: AlertEvent) -> None:
            if not self.hung:
                self.hung = True
                await asyncio.Event().wait()  # the first request is never answered
            await super().send(event)

    sink = Hangs()
    box = Outbox(db_for(tmp_path / "db"), [sink], sleep=no_sleep, send_timeout=0.05)
    box.add([fire("r1")])
    await box.start()
    try:
        assert await box.wait_idle()
    finally:
        await box.stop()
    assert [e.action for e in sink.got] == [Action.FIRE]
    assert [(r.state, r.attempts) for r in box.rows()] == [(DELIVERED, 2)]


async def test_a_webhook_urls_secret_stays_out_of_logs_and_the_run_page(
    tmp_path: Path, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    # Slack's and Teams' incoming webhooks carry their secret in the URL's path.
    url = f"http://127.0.0.1:{receiver.port}/services/T0/B0/XSECRETX?token=QSECRETQ"
    receiver.script += [(503, "busy", {}), (400, "no such hook", {})]
    db = db_for(tmp_path / "db")
    metrics = AlertMetrics.create(CollectorRegistry())
    box = Outbox(db, [WebhookSink(url)], metrics=metrics, sleep=no_sleep)
    box.add([fire("r1")])
    with caplog.at_level(logging.INFO, logger="sidecar.alerts"):
        await box.start()
        try:
            assert await box.wait_idle()
        finally:
            await box.stop()
    assert len(receiver.bodies) == 2  # the 503 retried, the 400 refused for good
    shown = f"webhook:http://127.0.0.1:{receiver.port}/…"
    (row,) = alert_history(db, "r1")
    assert row.sink == shown and row.last_error is not None and "no such hook" in row.last_error
    logged = [
        (r.getMessage(), r.__dict__.get("sink"), r.__dict__.get("error")) for r in caplog.records
    ]
    assert {m for m, _, _ in logged} >= {"sidecar.sink.down", "sidecar.alert.rejected"}
    assert all(sink == shown for _, sink, _ in logged if sink is not None)
    for text in [repr(row), *map(repr, logged)]:
        assert "SECRET" not in text, text


async def test_a_run_orphaned_again_after_its_agent_was_heard_pages_again(
    tmp_path: Path,
) -> None:
    """Late once (orphaned, then heard from: resolved), dead later: the second orphaning
    is a new page under its own key, and neither a re-evaluation of an open episode nor
    one of another alert pages twice."""
    orphaned = view("r1", status=sc.STATE_ORPHANED)
    (late,) = evaluate(view("r1"), orphaned, now=2.0)
    (heard,) = evaluate(orphaned, view("r1"), now=3.0)
    (dead,) = evaluate(view("r1"), orphaned, now=9.0)
    (recovered,) = evaluate(orphaned, view("r1", status=sc.STATE_RECOVERED), now=12.0)
    (replayed,) = evaluate(None, orphaned, now=10.0)  # a restart while it is open
    assert late.alertname == dead.alertname == sc.ALERT_RUN_ORPHANED
    sink = FakeSink()
    box = Outbox(db_for(tmp_path / "db"), [sink], sleep=no_sleep)
    assert box.add([late]) == 1 and box.add([late]) == 0
    assert box.add([heard]) == 1
    assert box.add([dead]) == 1  # fired anew: the agent died after it was heard from
    assert box.add([replayed, dead]) == 0  # the same episode, still open
    assert box.add([fire("r1")]) == 1 and box.add([resolve("r1"), fire("r1")]) == 1
    assert box.add([fire("r1")]) == 0  # every other alert pages a run once
    assert box.add([recovered]) == 1
    await box.start()
    try:
        assert await box.wait_idle()
    finally:
        await box.stop()
    got = [(e.alertname, e.action.value, e.dedup_key) for e in sink.got]
    first = f"saga-otel/{sc.ALERT_RUN_ORPHANED}/r1"
    second = f"saga-otel/{sc.ALERT_RUN_ORPHANED}#2/r1"
    orphan = [(a, k) for n, a, k in got if n == sc.ALERT_RUN_ORPHANED]
    assert orphan == [("fire", first), ("resolve", first), ("fire", second), ("resolve", second)]
    # A run id may hold "#": its key never collides with another run's episode.
    assert dedup_key(sc.ALERT_RUN_ORPHANED, "r1#2") != second


async def test_400_is_not_retried_and_is_logged_with_the_answer(
    tmp_path: Path, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.script.append((400, '{"message": "Invalid routing key"}', {}))
    registry = CollectorRegistry()
    box = Outbox(
        db_for(tmp_path / "db"),
        [PagerDutySink("bad", url=receiver.url)],
        metrics=AlertMetrics.create(registry),
        sleep=no_sleep,
    )
    box.add([fire("r1"), fire("r2")])
    with caplog.at_level(logging.ERROR, logger="sidecar.alerts"):
        await box.start()
        try:
            assert await box.wait_idle()
        finally:
            await box.stop()
    assert len(receiver.bodies) == 2  # one each: the refused one was not retried
    failed, delivered = box.rows()
    assert [failed.state, delivered.state] == [FAILED, DELIVERED]
    assert failed.last_error is not None and "Invalid routing key" in failed.last_error
    assert delivered.last_error is None
    (rejected,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rejected.getMessage() == "sidecar.alert.rejected"
    assert "Invalid routing key" in rejected.__dict__["error"]
    assert "not retried" in rejected.__dict__["fix"]
    failed = {"alertname": sc.ALERT_COMPENSATION_STARTED, "sink": "pagerduty", "outcome": "failed"}
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS, failed) == 1


async def test_a_redirect_is_refused_as_a_4xx_is_never_marked_delivered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A webhook answering 302 (a renamed path): followed, the POST became a body-less GET
    whose 200 marked the alert delivered. It is a refusal, counted as one."""
    seen: list[tuple[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.method, request.path))
        if request.path == "/hook":
            return web.Response(status=302, headers={"Location": "/moved"})
        return web.Response(status=200, text="landing page")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    registry = CollectorRegistry()
    box = Outbox(
        db_for(tmp_path / "db"),
        [WebhookSink(f"http://127.0.0.1:{port}/hook")],
        metrics=AlertMetrics.create(registry),
        sleep=no_sleep,
    )
    box.add([fire("r1")])
    try:
        with caplog.at_level(logging.ERROR, logger="sidecar.alerts"):
            await box.start()
            try:
                assert await box.wait_idle()
            finally:
                await box.stop()
    finally:
        await runner.cleanup()
    assert seen == [("POST", "/hook")]  # not retried, not followed
    (row,) = box.rows()
    assert row.state == FAILED and row.last_error is not None
    assert "answered 302 Found, redirecting to" in row.last_error
    (rejected,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rejected.getMessage() == "sidecar.alert.rejected"
    assert "final URL" in rejected.__dict__["error"]
    failed = {"alertname": sc.ALERT_COMPENSATION_STARTED, "sink": "webhook", "outcome": "failed"}
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS, failed) == 1


async def test_a_sink_down_for_a_while_gets_every_alert_exactly_once(tmp_path: Path) -> None:
    receiver = Receiver()  # not listening yet
    sink = WebhookSink(receiver.url, timeout=2.0)
    box = Outbox(db_for(tmp_path / "db"), [sink], backoff=Backoff(initial=0.01, maximum=0.05))
    runs = [f"r{i}" for i in range(5)]
    box.add([fire(r) for r in runs])
    await box.start()
    try:
        await wait_for(lambda: all(r.attempts >= 1 for r in box.rows()[:1]))
        box.add([resolve(r) for r in runs[:3]])
        await wait_for(lambda: box.rows()[0].attempts >= 3)  # it kept trying
        assert box.depth() == 8
        await receiver.start()
        assert await box.wait_idle()
        # Re-evaluation after the outage adds nothing.
        box.add([fire(r) for r in runs] + [resolve(r) for r in runs[:3]])
        assert await box.wait_idle()
    finally:
        await box.stop()
        await receiver.stop()
    expected = [(f"saga-otel/SagaCompensationStarted/{r}", "fire") for r in runs]
    expected += [(f"saga-otel/SagaCompensationStarted/{r}", "resolve") for r in runs[:3]]
    assert sorted(receiver.keys()) == sorted(expected)
    # Per run, the fire reached the sink before the resolve.
    order = receiver.keys()
    for r in runs[:3]:
        key = f"saga-otel/SagaCompensationStarted/{r}"
        assert order.index((key, "fire")) < order.index((key, "resolve"))


async def test_pending_rows_survive_a_restart(tmp_path: Path, receiver: Receiver) -> None:
    db = db_for(tmp_path / "sidecar.db")
    down = FakeSink(name=f"webhook:{receiver.url}")
    first = Outbox(db, [down])
    first.add([fire("r1")])
    down.fail = 10**6
    await first.start()
    await wait_for(lambda: first.rows()[0].attempts >= 1)
    first.add([fire("r2")])
    await first.stop()  # the process dies with both rows pending
    first.close()

    second = Outbox(db, [WebhookSink(receiver.url)])
    assert second.depth() == 2
    await second.start()
    try:
        assert await second.wait_idle()
    finally:
        await second.stop()
    assert sorted(receiver.keys()) == [
        ("saga-otel/SagaCompensationStarted/r1", "fire"),
        ("saga-otel/SagaCompensationStarted/r2", "fire"),
    ]
    # And a third start has nothing left to send.
    third = Outbox(db, [WebhookSink(receiver.url)])
    assert third.depth() == 0


async def test_alerts_waiting_for_a_corrected_url_go_to_it_and_the_backlog_clears(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Runbook SagaSidecarOutboxBacklog: fix the sink's URL, and the outbox drains. Rows
    are keyed by the sink's full name, so the alerts written for the mistyped URL waited
    for a worker no start runs, and counted in the depth gauge for good. A start hands
    them to the configured sinks that route them, each run's fire before its resolve;
    the old rows are retired (not delivered), saying where they went, and logged."""
    db = db_for(tmp_path / "db")
    typo = FakeSink(name="webhook:https://hooks.example:8443/T0/XSECRETX")
    first = Outbox(db, [typo])
    first.add([fire("r1"), fire("r2"), resolve("r2")])  # r2 paged and resolved meanwhile
    first.close()
    fixed = FakeSink(name="webhook:https://hooks.example/T0/XSECRETX")
    registry = CollectorRegistry()
    box = Outbox(db, [fixed], metrics=AlertMetrics.create(registry))
    # The start's re-evaluation resolves r1 before the workers start: the resolve goes
    # where its fire waits, and moves with it.
    assert box.add([resolve("r1")]) == 1
    with caplog.at_level(logging.INFO, logger="sidecar.alerts"):
        await box.start()
        try:
            assert await box.wait_idle()
        finally:
            await box.stop()
    got = [(e.run_id, e.action) for e in fixed.got]
    assert sorted(got) == sorted(
        (r, a) for r in ("r1", "r2") for a in (Action.FIRE, Action.RESOLVE)
    )
    for r in ("r1", "r2"):
        assert [a for run, a in got if run == r] == [Action.FIRE, Action.RESOLVE]
    assert box.depth() == 0
    assert registry.get_sample_value(sc.M_SIDECAR_OUTBOX_DEPTH) == 0
    old = [r for r in box.rows() if r.sink == typo.name]
    assert len(old) == 4 and {r.state for r in old} == {REHOMED}
    assert {r.last_error for r in old} == {
        "rehomed: its sink is no longer configured; handed to webhook:https://hooks.example/…"
    }
    (line,) = [r for r in caplog.records if r.getMessage() == "sidecar.outbox.rehomed"]
    assert line.__dict__["sink"] == "webhook:https://hooks.example:8443/…"
    assert line.__dict__["alerts"] == 4 and line.__dict__["held"] == 0
    assert line.__dict__["to"] == ["webhook:https://hooks.example/…"]
    assert "SECRET" not in repr(line.__dict__)
    # A later start has nothing left to move or send.
    again = Outbox(db, [fixed])
    await again.start()
    await again.stop()
    assert len(fixed.got) == 4 and again.depth() == 0


async def test_alerts_of_a_removed_sink_that_no_sink_routes_now_are_held_not_dropped(
    tmp_path: Path,
) -> None:
    """As an alert with no sink: a fire of a removed sink that no configured sink routes
    is held (even one held once before and handed to that sink), and goes to a later
    start's sink; a resolve whose fire reached none of the configured sinks has nothing
    to resolve there."""
    db = db_for(tmp_path / "db")
    old = FakeSink(name="webhook:http://old")
    first = Outbox(db, [old])
    first.add([fire("r2")])
    await first.start()
    assert await first.wait_idle()  # r2's fire reached the old sink
    await first.stop()
    first.add([fire("r1"), resolve("r2")])  # then it went down for good
    first.close()
    pd = FakeSink(kind="pagerduty", name="pagerduty:http://pd")
    second = Outbox(db, [pd], Routing.parse(["critical=pagerduty"]))  # warnings: nowhere
    await second.start()
    await second.stop()
    assert pd.got == [] and second.depth() == 0
    rows = {(r.event.run_id, r.action, r.sink): (r.state, r.last_error) for r in second.rows()}
    assert rows[("r1", "fire", "(none)")] == (HELD, None)
    assert rows[("r1", "fire", old.name)] == (
        REHOMED,
        "rehomed: its sink is no longer configured, and none configured now routes it: "
        "held for a later start's",
    )
    assert rows[("r2", "resolve", old.name)] == (
        REHOMED,
        "rehomed: its sink is no longer configured, and its fire reached none configured "
        "now: nothing to resolve",
    )
    # Handed to a sink that is gone by the next start: held again, then delivered.
    gone = FakeSink(name="webhook:http://gone")
    gone.fail = 10**6
    third = Outbox(db, [gone], sleep=no_sleep)
    await third.start()
    await wait_for(lambda: third.rows(gone.name) and third.rows(gone.name)[0].attempts >= 1)
    await third.stop()
    fourth = Outbox(db, [])
    await fourth.start()
    await fourth.stop()
    assert [r.state for r in fourth.rows("(none)")] == [HELD]
    last = FakeSink(name="webhook:http://last")
    fifth = Outbox(db, [last])
    await fifth.start()
    try:
        assert await fifth.wait_idle()
    finally:
        await fifth.stop()
    assert [(e.run_id, e.action) for e in last.got] == [("r1", Action.FIRE)]
    assert [r.state for r in fifth.rows("(none)")] == [REHOMED]


async def test_metrics_depth_and_delay_from_the_events_own_time(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    sink = FakeSink()
    box = Outbox(
        db_for(tmp_path / "db"), [sink], metrics=AlertMetrics.create(registry), clock=lambda: 11.0
    )
    box.add([fire("r1"), fire("r2")])
    assert registry.get_sample_value(sc.M_SIDECAR_OUTBOX_DEPTH) == 2
    await box.start()
    try:
        assert await box.wait_idle()
    finally:
        await box.stop()
    assert registry.get_sample_value(sc.M_SIDECAR_OUTBOX_DEPTH) == 0
    delay = sc.M_SIDECAR_ALERT_DELAY
    assert registry.get_sample_value(f"{delay}_count", {"sink": "webhook"}) == 2
    # The events report the unwind at t=1.0; accepted at t=11.0.
    assert registry.get_sample_value(f"{delay}_sum", {"sink": "webhook"}) == 20.0


async def test_firing_alerts_are_resent_to_alertmanager_until_resolved(tmp_path: Path) -> None:
    sink = FakeSink("alertmanager", "am", resend=0.02)
    box = Outbox(db_for(tmp_path / "db"), [sink])
    box.add([fire("r1")])
    await box.start()
    try:
        await wait_for(lambda: len(sink.got) >= 4)
        assert {e.action for e in sink.got} == {Action.FIRE}
        box.add([resolve("r1")])
        await wait_for(lambda: sink.got[-1].action is Action.RESOLVE)
        count = len(sink.got)
        await asyncio.sleep(0.15)  # several resend intervals
        assert len(sink.got) == count
    finally:
        await box.stop()
    assert [r.state for r in box.rows()] == [DELIVERED, DELIVERED]


async def test_firing_alerts_are_resent_after_the_clock_stepped_back(tmp_path: Path) -> None:
    """The host's clock is stepped back an hour (NTP) while an alert fires: its stored send
    time is then in the future. The re-sends stopped for the size of the step, and
    Alertmanager ended the page (resolve_timeout) while the run still needed a person."""
    offset = [0.0]

    def clock() -> float:
        return time.time() + offset[0]

    sink = FakeSink("alertmanager", "am", resend=0.05)
    box = Outbox(db_for(tmp_path / "db"), [sink], clock=clock)
    box.add([fire("r1")])
    await box.start()
    try:
        await wait_for(lambda: len(sink.got) >= 3)
        offset[0] -= 3600.0
        stepped = len(sink.got)
        await wait_for(lambda: len(sink.got) >= stepped + 4)  # every interval, as before
        assert {e.action for e in sink.got} == {Action.FIRE}
    finally:
        await box.stop()


async def test_writing_wakes_the_worker_without_polling(tmp_path: Path, backend: str) -> None:
    sink = FakeSink()
    box = Outbox(db_for(tmp_path / "db"), [sink])
    await box.start()
    try:
        await asyncio.sleep(0)  # the worker is now waiting on its event
        box.add([fire("r1")])
        # A handful of loop iterations, no timer: the insert itself woke it. (On PostgreSQL
        # the worker's reads are a round trip to the outbox's database thread each.)
        for _ in range(50 if backend == "sqlite" else 20_000):
            if sink.got:
                break
            await asyncio.sleep(0)
        assert len(sink.got) == 1
    finally:
        await box.stop()


def test_duplicate_sink_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="different URL"):
        Outbox(db_for(tmp_path / "db"), [FakeSink(name="x"), FakeSink(name="x")])


# --- the service: listener and startup re-evaluation ---------------------------------------


async def test_startup_reevaluation_raises_and_resolves_what_a_crash_missed(
    tmp_path: Path,
) -> None:
    db = db_for(tmp_path / "sidecar.db")
    sink = FakeSink()
    service = AlertService(db, AlertSettings(log_sink=False), sinks=[sink])
    # r1 fired before the crash; its resolving change was committed but never evaluated.
    service.on_change(view("r1"), unwinding("r1"), now=2.0)
    service.close()

    sink2 = FakeSink()
    restarted = AlertService(db, AlertSettings(log_sink=False), sinks=[sink2])
    stored = [
        view("r1", status="compensated"),  # resolved while down
        unwinding("r2"),  # its unwind span was acknowledged just before the crash
        view("r3", status="completed"),
    ]
    assert restarted.reevaluate(stored, now=5.0) == 2
    assert restarted.reevaluate(stored, now=6.0) == 0  # idempotent
    await restarted.start()
    try:
        assert await restarted.outbox.wait_idle()
    finally:
        await restarted.stop()
    got = sorted((e.run_id, e.action.value) for e in sink2.got)
    assert got == [("r1", "fire"), ("r1", "resolve"), ("r2", "fire")]


def test_listener_swallows_store_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    service = AlertService(
        db_for(tmp_path / "db"), AlertSettings(log_sink=False), sinks=[FakeSink()]
    )
    service.close()  # the connection is gone: writes fail
    with caplog.at_level(logging.ERROR, logger="sidecar.alerts"):
        assert service.on_change(view("r1"), unwinding("r1"), now=1.0) == []
    (record,) = [r for r in caplog.records if r.getMessage() == "sidecar.alerts.not_written"]
    assert record.__dict__["run_id"] == "r1"


def test_pending_state_names(tmp_path: Path) -> None:
    box = Outbox(db_for(tmp_path / "db"), [FakeSink()])
    box.add([fire("r1")])
    assert [r.state for r in box.rows()] == [PENDING]


def test_retry_policy_and_outbox_share_the_backoff_formula() -> None:
    import random

    from saga_otel.records import backoff_seconds

    box = Backoff(initial=0.5, maximum=60.0, jitter=0.5)
    for n in range(1, 12):
        a, b = random.Random(n), random.Random(n)
        assert box.delay(n, a) == backoff_seconds(
            n, initial=0.5, maximum=60.0, jitter_ratio=0.5, rng=b
        )
    from saga_otel import RetryPolicy

    policy = RetryPolicy(attempts=5, initial=0.1, maximum=5.0, jitter=0.1)
    a, b = random.Random(1), random.Random(1)
    assert policy.delay(4, a) == backoff_seconds(4, initial=0.1, maximum=5.0, jitter=0.1, rng=b)


async def test_a_delivery_is_recorded_even_when_the_outbox_stops_right_after_it(
    tmp_path: Path,
) -> None:
    """Stopping between a send and its "delivered" write must not leave the row pending:
    the next start would page the same alert again."""
    db = db_for(tmp_path / "sidecar.db")
    sent = asyncio.Event()

    class StopsTheWorld(FakeSink):
        async def send(self, event: AlertEvent) -> None:
            await super().send(event)
            sent.set()

    sink = StopsTheWorld()
    box = Outbox(db, [sink])
    box.add([fire("r1")])
    await box.start()
    await sent.wait()
    await box.stop()  # cancels the worker as it goes to record the delivery
    box.close()
    assert len(sink.got) == 1
    again = Outbox(db, [FakeSink()])
    try:
        assert again.depth() == 0
        assert [r.state for r in again.rows()] == [DELIVERED]
    finally:
        again.close()


# --- bounded by what is pending, not by what was ever held -----------------------------


def _old_rows(box: Outbox, n: int) -> None:
    """``n`` delivered fire/resolve pairs of other runs: a week of alerts, all done."""
    template_fire, template_resolve = fire("old"), resolve("old")
    events = []
    for i in range(n // 2):
        for e in (template_fire, template_resolve):
            events.append(replace(e, run_id=f"old-{i}"))  # the dedup key names the run
    box.add(events)
    _sql(box.target, "UPDATE alert_outbox SET state = ?", (DELIVERED,))


def _sql(target: DbTarget, query: str, args: tuple[object, ...] = ()) -> list[Any]:
    if target.url is not None:
        with psycopg.connect(target.url, autocommit=True) as conn:
            cur = conn.execute(query.replace("?", "%s"), args)
            return cur.fetchall() if cur.description else []
    db = sqlite3.connect(str(target.path))
    try:
        rows = db.execute(query, args).fetchall()
        db.commit()
        return rows
    finally:
        db.close()


@pytest.mark.parametrize("prune", ["delete_runs", "prune_put_away"])
async def test_pruning_a_run_takes_its_done_alerts_along_and_keeps_what_is_left_to_do(
    tmp_path: Path, prune: str
) -> None:
    """Retention prunes a run's alert rows with its spans once every alert of the run was
    resolved and every row sent; a run with an alert still waiting for its sink or still
    firing keeps them all (nothing of an alert is dropped)."""
    sink = FakeSink()
    box = Outbox(db_for(tmp_path / "db"), [sink])
    box.add([fire("done"), fire("firing")])
    await box.start()
    try:
        assert await box.wait_idle()
        box.add([resolve("done")])
        assert await box.wait_idle()
    finally:
        await box.stop()
    box.add([fire("waiting"), resolve("waiting")])  # not delivered: the worker stopped
    runs = ["done", "firing", "waiting"]
    store = open_store(box.target)
    try:
        if prune == "delete_runs":
            store.delete_runs(runs)
        else:
            store.put_away([PutAway(r, 1.0, sc.STATUS_COMPENSATED, "refund", 1.0) for r in runs])
            assert store.prune_put_away(before=2.0) == len(runs)
    finally:
        store.close()
    left = {(r.event.run_id, r.action, r.state) for r in box.rows()}
    assert left == {
        ("firing", "fire", DELIVERED),
        ("waiting", "fire", PENDING),
        ("waiting", "resolve", PENDING),
    }


async def test_a_run_whose_held_alert_was_handed_on_is_pruned_once_it_is_done(
    tmp_path: Path,
) -> None:
    """A held alert handed to a later start's sink: the held row no longer fires, so once
    the alert resolved there retention takes the run's rows (the held fire, marked
    delivered and never resolved, kept them for good)."""
    db = db_for(tmp_path / "db")
    Outbox(db, []).add([fire("r1")])  # no sink: held
    sink = FakeSink()
    box = Outbox(db, [sink])
    await box.start()
    try:
        assert await box.wait_idle()
        box.add([resolve("r1")])
        assert await box.wait_idle()
    finally:
        await box.stop()
    assert [(e.run_id, e.action) for e in sink.got] == [("r1", Action.FIRE), ("r1", Action.RESOLVE)]
    store = open_store(box.target)
    try:
        store.delete_runs(["r1"])
    finally:
        store.close()
    assert box.rows() == []


async def test_an_alerts_outbox_work_does_not_grow_with_the_rows_it_holds(
    tmp_path: Path, backend: str
) -> None:
    """Each alert's write, depth count and firing read (both after every write and
    delivery) and its run's prune touch what they need, not every row the outbox holds:
    a week of delivered alerts stays in the table until retention prunes it. Work is
    counted by the database itself (SQLite virtual machine steps; PostgreSQL buffers),
    never by a clock."""
    work = {n: _outbox_work(tmp_path / f"db{n}", n, backend) for n in (200, 20_000)}
    assert work[20_000] <= 2 * work[200] + 10, work


def _outbox_work(path: Path, old: int, backend: str) -> int:
    """The work of one alert's path through an outbox holding ``old`` done rows."""
    box = Outbox(db_for(path), [FakeSink()], metrics=AlertMetrics.create(CollectorRegistry()))
    try:
        _old_rows(box, old)
        if backend == "postgresql":
            _sql(box.target, "VACUUM ANALYZE alert_outbox")  # the mass UPDATE's dead rows
            return sum(_pg_buffers(box.target, q, a) for q, a in _PG_HOT)
        store = open_store(box.target)
        try:
            return _vm_steps(
                [box._store._db, store._db],  # type: ignore[attr-defined]
                lambda: (
                    box.add([fire("new")]),
                    box.depth(),
                    box._store.firing("fake", DELIVERED),  # type: ignore[attr-defined]
                    box.add([resolve("new")]),
                    store.delete_runs(["new"]),
                ),
            )
        finally:
            store.close()
    finally:
        box.close()


# The outbox's statements whose cost could grow with the table, as the stores run them.
_PG_HOT = [
    (COUNT_IN_STATE, (PENDING,)),
    (FIRING, ("fake", DELIVERED)),
    (PRUNE_RUN_ALERTS, ("old-7", "old-7")),
]


def _pg_buffers(target: DbTarget, query: str, args: tuple[object, ...]) -> int:
    """Shared buffers the statement touched (EXPLAIN ANALYZE, rolled back)."""
    assert target.url is not None
    with psycopg.connect(target.url) as conn:
        ((plan,),) = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query.replace("?", "%s"), args
        ).fetchall()
        conn.rollback()
    top = plan[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def _vm_steps(dbs: list[sqlite3.Connection], fn: Callable[[], object]) -> int:
    """Hundreds of SQLite virtual machine steps ``fn`` ran on these connections."""
    steps = [0]

    def tick() -> int:
        steps[0] += 1
        return 0  # go on

    for db in dbs:
        db.set_progress_handler(tick, 100)
    try:
        fn()
    finally:
        for db in dbs:
            db.set_progress_handler(None, 0)
    return steps[0]


@pytest.mark.parametrize("answer", [202, 400])
async def test_a_send_is_counted_before_its_row_stops_being_pending(
    tmp_path: Path, receiver: Receiver, answer: int
) -> None:
    """Once no row is pending, ``wait_idle`` returns and a caller may stop the outbox,
    cancelling its worker at its next await: the delivery (or refusal) must already be
    in ``saga_sidecar_alerts_total`` by the time its row is recorded."""
    if answer != 202:
        receiver.script.append((answer, '{"message": "Invalid routing key"}', {}))
    registry = CollectorRegistry()
    box = Outbox(
        db_for(tmp_path / "db"), [WebhookSink(receiver.url)], metrics=AlertMetrics.create(registry)
    )
    outcome = "delivered" if answer == 202 else "failed"
    labels = {"alertname": sc.ALERT_COMPENSATION_STARTED, "sink": "webhook", "outcome": outcome}
    counted_when_recorded: list[float | None] = []
    mark = box._store.mark  # type: ignore[attr-defined]

    def recording(*args: Any) -> Any:
        counted_when_recorded.append(registry.get_sample_value(sc.M_SIDECAR_ALERTS, labels))
        return mark(*args)

    box._store.mark = recording  # type: ignore[attr-defined]
    box.add([fire("r1")])
    await box.start()
    try:
        assert await box.wait_idle()
    finally:
        await box.stop()
    assert counted_when_recorded == [1.0]


async def test_add_soon_writes_after_the_answers_set_beside_it(
    tmp_path: Path, backend: str
) -> None:
    """Intake folds a request (the listener calls add_soon), then answers it, in one loop
    callback. On SQLite the outbox's COMMIT waits until the answered handlers have run, so
    the sender's ack never waits for it; the alert is in the outbox a turn later."""
    box = Outbox(db_for(tmp_path / "db"), [FakeSink()])
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[None] = loop.create_future()
    rows_at_answer: list[int] = []

    async def handler() -> None:
        await answer
        rows_at_answer.append(len(box.rows()))

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)  # the handler waits for its answer

    def commit_callback() -> None:
        box.add_soon([fire("r1")])  # the fold's listener
        answer.set_result(None)  # then the answer

    loop.call_soon(commit_callback)
    await task
    if backend == "sqlite":  # PostgreSQL writes on its own thread, in a race with this
        assert rows_at_answer == [0]
    await box.flush()
    assert [(r.dedup_key, r.action) for r in box.rows()] == [(fire("r1").dedup_key, "fire")]


async def test_alerts_held_by_add_soon_are_written_in_order_by_close(tmp_path: Path) -> None:
    box = Outbox(db_for(tmp_path / "db"), [FakeSink()])
    box.add_soon([fire("r1")])
    box.add_soon([resolve("r1")])  # needs its fire's row: same transaction, after it
    box.close()  # before the loop turned: nothing held is lost
    again = Outbox(db_for(tmp_path / "db"), [FakeSink()])
    assert [r.action for r in again.rows()] == ["fire", "resolve"]


async def test_a_failed_add_soon_is_logged_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    box = Outbox(db_for(tmp_path / "db"), [FakeSink()])

    def broken(events: Any) -> int:
        raise StoreError("disk full")

    box.add = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="sidecar.alerts"):
        box.add_soon([fire("r1")])
        for _ in range(3):
            await asyncio.sleep(0)
        await box.flush()
    failed = [r for r in caplog.records if r.getMessage() == "sidecar.alerts.write_failed"]
    assert failed and "disk full" in failed[0].__dict__["error"]
    assert failed[0].__dict__["alerts"] == 1  # how many alerts wait to be written


# --- a database that refuses the outbox's writes ----------------------------------------


def orphaned(run_id: str) -> AlertEvent:
    (event,) = evaluate(view(run_id), view(run_id, status=sc.STATE_ORPHANED), now=2.0)
    return event


def back(run_id: str) -> AlertEvent:
    (event,) = evaluate(view(run_id, status=sc.STATE_ORPHANED), view(run_id), now=3.0)
    return event


def test_unwritten_alerts_keep_their_order_drop_repeats_and_stay_bounded() -> None:
    plenty = 10**6
    held, dropped = Unwritten().keep([fire("r1"), fire("r1"), resolve("r1"), fire("r1")], 9, plenty)
    # A fire again after its resolve is the same row (one page per alert and run): dropped.
    assert [(e.run_id, e.action) for e in held.events] == [
        ("r1", Action.FIRE),
        ("r1", Action.RESOLVE),
    ]
    assert dropped == 0
    # SagaRunOrphaned pages again once resolved: that fire opens the next episode.
    held, _ = held.keep([orphaned("r2"), orphaned("r2"), back("r2"), back("r2")], 9, plenty)
    held, _ = held.keep([orphaned("r2")], 9, plenty)
    assert [e.action for e in held.events if e.run_id == "r2"] == [
        Action.FIRE,
        Action.RESOLVE,
        Action.FIRE,
    ]
    assert held.keep([orphaned("r2")], 9, plenty) == (held, 0)  # a repeat of the last
    # Bounded in alerts and in bytes: the newest go, the order of the rest stays.
    full, dropped = Unwritten().keep([fire(f"r{i}") for i in range(5)], 3, plenty)
    assert [e.run_id for e in full.events] == ["r0", "r1", "r2"] and dropped == 2
    one = full.size // 3
    full, dropped = Unwritten().keep([fire("r0"), fire("r1")], 9, one + 1)
    assert [e.run_id for e in full.events] == ["r0"] and dropped == 1


async def refused_outbox(tmp_path: Path) -> tuple[str, FakeSink, CollectorRegistry, Outbox]:
    """A started outbox with one sink, its own metrics, a quick backoff, and a database
    that refuses its writes until ``refuse_alert_writes(db, refuse=False)``."""
    db = db_for(tmp_path / "db")
    sink = FakeSink()
    registry = CollectorRegistry()
    box = Outbox(
        db,
        [sink],
        metrics=AlertMetrics.create(registry),
        backoff=Backoff(initial=0.01, maximum=0.05),
    )
    await box.start()
    refuse_alert_writes(db)
    return db, sink, registry, box


async def test_alerts_the_database_refused_are_written_and_sent_once_it_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Runbooks SagaSidecarStoreFailing and SagaSidecarIntakeStalled: free the database,
    no restart. Alerts raised while it refuses their rows (a full disk, a lock held past
    its timeout) wait in memory, counted, and are written and sent in order once it
    answers. They were dropped until a restart re-evaluated the runs."""
    db, sink, registry, box = await refused_outbox(tmp_path)
    with caplog.at_level(logging.ERROR, logger="sidecar.alerts"):
        box.add_soon([fire("r1")])
        await box.flush()
        box.add_soon([fire("r1"), resolve("r1"), orphaned("r2")])  # r1's fire again: a repeat
        await box.flush()
        await asyncio.sleep(0.2)  # tried again meanwhile, refused again

    def unwritten() -> float | None:
        return registry.get_sample_value(sc.M_SIDECAR_ALERTS_UNWRITTEN)

    assert unwritten() == 3
    assert sink.got == [] and box.rows() == []
    # Once, when the refusals began, saying what to do.
    (failed,) = [r for r in caplog.records if r.getMessage() == "sidecar.alerts.write_failed"]
    assert "free the database" in failed.__dict__["fix"]
    refuse_alert_writes(db, refuse=False)
    await wait_for(lambda: len(sink.got) == 3)
    assert [(e.run_id, e.action) for e in sink.got] == [
        ("r1", Action.FIRE),
        ("r1", Action.RESOLVE),
        ("r2", Action.FIRE),
    ]
    assert unwritten() == 0
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS_DROPPED) == 0
    await box.stop()


async def test_past_the_bound_the_newest_unwritten_alerts_are_dropped_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outbox_module, "MAX_UNWRITTEN", 2)
    db, sink, registry, box = await refused_outbox(tmp_path)
    with caplog.at_level(logging.ERROR, logger="sidecar.alerts"):
        for run_id in ("r1", "r2", "r3", "r4"):
            box.add_soon([fire(run_id)])
            await box.flush()
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS_UNWRITTEN) == 2
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS_DROPPED) == 2
    (dropped,) = [r for r in caplog.records if r.getMessage() == "sidecar.alerts.dropped"]
    assert "restart" in dropped.__dict__["fix"]  # its start raises those still open
    refuse_alert_writes(db, refuse=False)
    await wait_for(lambda: len(sink.got) == 2)
    assert [e.run_id for e in sink.got] == ["r1", "r2"]
    await box.stop()


async def test_alerts_held_at_close_are_written_if_the_database_answers_then(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop asks the database once more; what it still refuses is logged and counted
    (the next start raises again what is still open)."""
    db = db_for(tmp_path / "db")
    box = Outbox(db, [FakeSink()])
    refuse_alert_writes(db)
    box.add_soon([fire("r1")])
    await box.flush()
    refuse_alert_writes(db, refuse=False)
    box.add_soon([resolve("r1")])  # behind it
    box.close()
    assert [(r.dedup_key, r.action) for r in Outbox(db, [FakeSink()]).rows()] == [
        (fire("r1").dedup_key, "fire"),
        (fire("r1").dedup_key, "resolve"),
    ]
    registry = CollectorRegistry()
    last = Outbox(db, [FakeSink()], metrics=AlertMetrics.create(registry))
    refuse_alert_writes(db)
    with caplog.at_level(logging.ERROR, logger="sidecar.alerts"):
        last.add_soon([fire("r2")])
        await last.flush()
        last.close()
    assert registry.get_sample_value(sc.M_SIDECAR_ALERTS_DROPPED) == 1
    assert any(r.getMessage() == "sidecar.alerts.dropped" for r in caplog.records)
