"""Two sidecars on one PostgreSQL database behave as one: alerts once, no false orphans."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from prometheus_client import CollectorRegistry
from sidecar_testkit import (
    CREDIT,
    FakeClock,
    RunScript,
    compensated_run,
    compensation_failed_run,
    completed_run,
    database_clock_passes,
    db_for,
    export_http,
    heartbeat_spans,
    open_run,
    rejoin,
    settings_for,
    stuck_run,
)
from support import sql_on

from saga_otel import semconv as sc
from sidecar import Settings, Sidecar
from sidecar._alert_service import install_alerting
from sidecar._alert_settings import AlertSettings
from sidecar._alerting import Action, AlertEvent, evaluate
from sidecar._errors import StoreError
from sidecar._groups import Groups
from sidecar._leases import Lease
from sidecar._otlp import Decoded, extract, parse_protobuf
from sidecar._outbox import DELIVERED, PENDING, AlertMetrics, Backoff, Outbox
from sidecar._pgstore import CLAIM_TTL_S, PgAlertStore, PgStore, check_version
from sidecar._sinks import DeliveryRetry
from sidecar._storage import heartbeat_row, parse_db

pytestmark = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)


class SharedSink:
    """One receiver seen through two replicas: every delivery lands in one list, in order."""

    def __init__(self, got: list[tuple[str, AlertEvent]], replica: str, flaky: int = 0) -> None:
        self.got, self.replica, self.fail = got, replica, flaky

    kind = "webhook"
    name = "webhook:http://receiver"
    resend_interval = None

    async def send(self, event: AlertEvent) -> None:
        if self.fail:
            self.fail -= 1
            raise DeliveryRetry("down")
        await asyncio.sleep(0)  # let the other replica's worker run in between
        self.got.append((self.replica, event))

    async def close(self) -> None:
        return None


def _view(run_id: str, status: str) -> dict[str, object]:
    unwinding = status == "unwinding"
    return {
        "run_id": run_id, "saga": "refund", "service": "agent", "instance": "i1",
        "status": status, "updated_at": 1.0, "failed_step": "send" if unwinding else None,
        "unwind_reason": "E: x" if unwinding else None,
        "unwind_started_at": 1.0 if unwinding else None, "steps": [], "stack": [],
        "escalation": None, "pivot": None, "resolution": None,
    }  # fmt: skip


def _events(run_ids: list[str]) -> list[AlertEvent]:
    events = []
    for r in run_ids:
        events += evaluate(_view(r, "running"), _view(r, "unwinding"), now=2.0)  # type: ignore[arg-type]
        events += evaluate(_view(r, "unwinding"), _view(r, "compensated"), now=3.0)  # type: ignore[arg-type]
    return events


async def _until(probe: Callable[[], bool], what: str, tries: int = 3000) -> None:
    for _ in range(tries):
        if probe():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_two_outboxes_deliver_each_alert_once_and_in_order(tmp_path: Path) -> None:
    where = db_for(tmp_path / "sidecar.db")
    got: list[tuple[str, AlertEvent]] = []
    fast = Backoff(initial=0.01, maximum=0.02)
    a = Outbox(where, [SharedSink(got, "a", flaky=3)], backoff=fast)
    b = Outbox(where, [SharedSink(got, "b", flaky=3)], backoff=fast)
    try:
        await a.start()
        await b.start()
        run_ids = [f"r{i}" for i in range(40)]
        events = _events(run_ids)
        # Each replica inserts half (a run's fire through one, its resolve through the
        # other), then both evaluate everything again (each saw the spans): duplicates.
        await asyncio.gather(a.call(a.add, events[::2]), b.call(b.add, events[1::2]))
        await asyncio.gather(a.call(a.add, events), b.call(b.add, events))
        await _until(lambda: len(got) >= len(events), "every alert delivered")
        assert await a.wait_idle() and await b.wait_idle()
        await asyncio.sleep(0.05)  # nothing more arrives
    finally:
        await a.stop()
        await b.stop()
        a.close()
        b.close()
    keys = [(e.dedup_key, e.action.value) for _, e in got]
    assert sorted(keys) == sorted({(e.dedup_key, e.action.value) for e in events})
    for r in run_ids:  # a resolve never overtakes its fire, whichever replica sent them
        mine = [e.action for _, e in got if e.run_id == r]
        assert mine == [Action.FIRE, Action.RESOLVE]


class GatedSink(SharedSink):
    """A receiver that holds the send of a gated run until its gate opens, whichever
    replica sends it (``gates``, shared: run id -> (send entered, release))."""

    def __init__(
        self,
        got: list[tuple[str, AlertEvent]],
        replica: str,
        gates: dict[str, tuple[asyncio.Event, asyncio.Event]],
    ) -> None:
        super().__init__(got, replica)
        self.gates = gates

    async def send(self, event: AlertEvent) -> None:
        if event.run_id in self.gates:
            entered, release = self.gates[event.run_id]
            entered.set()
            await release.wait()
        await super().send(event)


async def test_each_replicas_outbox_depth_counts_what_the_others_delivered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each replica's saga_sidecar_outbox_depth is the shared outbox's: a replica learns
    of a row another replica delivered by counting again (DEPTH_REFRESH_S, shortened
    here), not only when it writes or delivers one itself. It kept the count of its own
    last write or delivery: a backlog the database no longer had, which paged
    SagaSidecarOutboxBacklog. Each replica here is busy sending a held alert while the
    other delivers one it wrote, so the order of events is fixed."""
    monkeypatch.setattr("sidecar._outbox.DEPTH_REFRESH_S", 0.05)
    url = db_for(tmp_path / "sidecar.db")
    got: list[tuple[str, AlertEvent]] = []
    gates = {run: (asyncio.Event(), asyncio.Event()) for run in ("b-held", "a-held")}
    registries = {"a": CollectorRegistry(), "b": CollectorRegistry()}
    a, b = (
        Outbox(url, [GatedSink(got, name, gates)], metrics=AlertMetrics.create(registries[name]))
        for name in ("a", "b")
    )
    fires = {
        e.run_id: e
        for e in _events(["b-held", "a-held", "to-a", "to-b"])
        if e.action is Action.FIRE
    }

    def gauges() -> list[float | None]:
        return [r.get_sample_value(sc.M_SIDECAR_OUTBOX_DEPTH) for r in registries.values()]

    def delivered(who: str, run_id: str) -> bool:
        return any(w == who and e.run_id == run_id for w, e in got)

    async def agree(pending: int) -> None:
        """Both gauges at what the database holds, within a bound (polled)."""
        assert await a.call(a.depth) == pending
        for _ in range(1000):
            if gauges() == [pending, pending]:
                break
            await asyncio.sleep(0.01)
        assert gauges() == [pending, pending]

    try:
        await b.start()  # alone: b claims the held alert
        await b.call(b.add, [fires["b-held"]])
        await asyncio.wait_for(gates["b-held"][0].wait(), 10)
        await a.start()
        await b.call(b.add, [fires["to-a"]])  # b is busy: a delivers it
        await _until(lambda: delivered("a", "to-a"), "a delivered b's alert")
        await a.call(a.add, [fires["a-held"]])  # b is still busy: a claims it
        await asyncio.wait_for(gates["a-held"][0].wait(), 10)
        gates["b-held"][1].set()
        await _until(lambda: delivered("b", "b-held"), "b delivered its held alert")
        await agree(1)  # a counted 2 when it wrote a-held, and delivered nothing since
        await a.call(a.add, [fires["to-b"]])  # a is busy: b delivers it
        await _until(lambda: delivered("b", "to-b"), "b delivered a's alert")
        gates["a-held"][1].set()
        await _until(lambda: delivered("a", "a-held"), "a delivered its held alert")
        await agree(0)  # b counted 1 (a-held) when it delivered to-b
    finally:
        for _, release in gates.values():
            release.set()
        for box in (a, b):
            await box.stop()
            box.close()


async def test_replicas_starting_at_once_hand_a_removed_sinks_alerts_on_once(
    tmp_path: Path,
) -> None:
    """Both replicas restart with a corrected sink URL at once: each moves the alerts
    that waited for the old one (the same rows; the unique key keeps one of each), and
    the sink gets each alert once, each run's fire before its resolve."""
    where = db_for(tmp_path / "sidecar.db")

    class Typo(SharedSink):
        name = "webhook:http://receivr"

    run_ids = [f"r{i}" for i in range(40)]
    events = _events(run_ids)
    writer = Outbox(where, [Typo([], "w")])
    try:
        assert writer.add(events) == len(events)
    finally:
        writer.close()
    got: list[tuple[str, AlertEvent]] = []
    a = Outbox(where, [SharedSink(got, "a")])
    b = Outbox(where, [SharedSink(got, "b")])
    try:
        await asyncio.gather(a.start(), b.start())
        await _until(lambda: len(got) >= len(events), "every alert delivered")
        assert await a.wait_idle() and await b.wait_idle()
        await asyncio.sleep(0.05)  # nothing more arrives
        assert a.depth() == 0
    finally:
        for box in (a, b):
            await box.stop()
            box.close()
    keys = [(e.dedup_key, e.action.value) for _, e in got]
    assert sorted(keys) == sorted((e.dedup_key, e.action.value) for e in events)
    for r in run_ids:
        assert [e.action for _, e in got if e.run_id == r] == [Action.FIRE, Action.RESOLVE]


def _alerting_replicas(
    settings: Settings, clock: FakeClock, got: list[tuple[str, AlertEvent]]
) -> tuple[Sidecar, Sidecar]:
    """Two replicas on one database and one clock, alerting into ``got`` (by name)."""
    a, b = Sidecar(settings, clock=clock), Sidecar(settings, clock=clock)
    for name, replica in (("a", a), ("b", b)):
        install_alerting(replica, AlertSettings(log_sink=False), sinks=[SharedSink(got, name)])
    return a, b


async def test_spans_at_one_replica_heartbeats_at_the_other(tmp_path: Path) -> None:
    """No live agent is paged; a dead one is orphaned once, paged once, and recovered
    through the replica that never saw its spans."""
    clock = FakeClock()
    got: list[tuple[str, AlertEvent]] = []
    a, b = _alerting_replicas(
        settings_for(tmp_path, idle_timeout=5.0, tick_interval=0.02), clock, got
    )
    async with a, b:
        await _until(lambda: a.leading != b.leading, "one leader")
        run = open_run(instance="agent-1")
        await export_http(a, run.spans())
        for _ in range(20):  # 20 s of a live agent beating at the other replica only
            clock.now += 1.0
            await export_http(b, heartbeat_spans("agent-1", [run.run_id], clock.now))
            await asyncio.sleep(0.03)  # a few ticks of the leader
        await b.sync()
        await a.sync()
        for replica in (a, b):
            assert replica.state.status(run.run_id) == sc.STATE_RUNNING
        view_a, view_b = a.state.view(run.run_id), b.state.view(run.run_id)
        assert view_a is not None and view_b is not None
        for key in ("status", "steps", "stack", "instance"):
            assert view_a[key] == view_b[key]
        assert not [e for _, e in got if e.alertname == sc.ALERT_RUN_ORPHANED]

        clock.now += 10.0  # the agent died: no more heartbeats
        await _until(
            lambda: all(r.state.status(run.run_id) == sc.STATE_ORPHANED for r in (a, b)),
            "orphaned on both replicas",
        )
        await _until(lambda: any(e.alertname == sc.ALERT_RUN_ORPHANED for _, e in got), "paged")
        leader = a if a.leading else b
        other = b if leader is a else a
        lease = await other.lease(run.run_id, "grant", {"holder": "recoverer:1"})
        assert isinstance(lease, Lease) and lease.token == 1
        await leader.sync()
        assert await leader.lease(run.run_id, "grant", {"holder": "second"}) is not None
        current = leader.state.lease(run.run_id)
        assert current is not None and current.holder == "recoverer:1"
        await asyncio.sleep(0.1)  # any duplicate page would be out by now
    orphaned = [e for _, e in got if e.alertname == sc.ALERT_RUN_ORPHANED]
    assert [e.action for e in orphaned] == [Action.FIRE]


async def test_a_replica_that_folds_an_orphan_mark_raises_its_alert(tmp_path: Path) -> None:
    """The leader stores its orphan mark, then its alert in another transaction; killed in
    between (here: a leader with no outbox at all), the alert must still be raised. The
    other replica folds the mark and raises it: the run is paged once."""
    clock = FakeClock()
    got: list[tuple[str, AlertEvent]] = []
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    leader, follower = Sidecar(settings, clock=clock), Sidecar(settings, clock=clock)
    install_alerting(follower, AlertSettings(log_sink=False), sinks=[SharedSink(got, "b")])
    async with leader, follower:
        run = open_run(instance="agent-1")
        await export_http(follower, run.spans())
        await leader.sync()
        clock.now += 10.0  # the agent is gone
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()  # the mark is stored; its alert never is
        await follower.sync()
        assert follower.state.status(run.run_id) == sc.STATE_ORPHANED
        await _until(lambda: bool(got), "paged")
        await follower.sync()
        await asyncio.sleep(0.1)  # nothing more arrives
    assert [(e.alertname, e.action) for _, e in got] == [(sc.ALERT_RUN_ORPHANED, Action.FIRE)]


async def test_a_resolution_older_than_the_orphan_mark_lapses_on_every_replica(
    tmp_path: Path,
) -> None:
    """A person resolves a run through B while the leader A, which has not read that yet,
    orphans it: as on one sidecar (resolved, then orphaned), the resolution lapses on
    both replicas and after a restart, and the run waits for a person again; resolving it
    again through either replica then settles it everywhere."""
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        run = open_run(instance="agent-1")
        await export_http(a, run.spans())
        await b.sync()
        clock.now += 10.0  # the agent is gone
        assert await b.resolve(run.run_id, "agent redeployed") is not None
        clock.now += 0.5
        assert [t.after for t in a.tick()] == [sc.STATE_ORPHANED]
        for _ in range(2):
            await a.flush()
            await b.flush()
            await a.sync()
            await b.sync()
        for replica in (a, b):
            view = replica.state.view(run.run_id)
            assert view is not None and view["status"] == sc.STATE_ORPHANED
            assert view["resolution"] is None, view["resolution"]
            assert [s["run_id"] for s in replica.state.summaries(needs_person=True)] == [run.run_id]
        async with Sidecar(settings, clock=clock) as restarted:
            view = restarted.state.view(run.run_id)
            assert view is not None and view["resolution"] is None
        clock.now += 1.0
        assert await b.resolve(run.run_id, "rerun by hand") is not None
        await a.sync()
        for replica in (a, b):
            view = replica.state.view(run.run_id)
            assert view is not None and view["resolution"] is not None


async def test_a_resolution_of_an_orphan_stands_whatever_the_resolving_clock_says(
    tmp_path: Path,
) -> None:
    """A person resolving an orphaned run resolves the mark they were shown. Stamped at
    the mark's own moment (the same clock reading) or before it (a replica whose clock is
    behind the leader's), every replica's read of the row took it for a resolution the
    mark had lapsed and cleared it: the person's note vanished at the next sync, and the
    run paged again. It is stamped just after the mark."""
    clock, behind = FakeClock(), FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=behind) as b:
        runs = [open_run(instance=f"agent-{i}", run_id=f"run-{i}") for i in (1, 2)]
        await export_http(a, [s for r in runs for s in r.spans()])
        clock.now += 10.0  # the agents are gone
        assert [t.after for t in a.tick()] == [sc.STATE_ORPHANED] * 2
        await a.flush()
        behind.now = clock.now - 60.0
        await b.sync()
        assert await a.resolve("run-1", "redeployed", by="alice") is not None  # same moment
        assert await b.resolve("run-2", "reversed by hand", by="bob") is not None  # behind
        for _ in range(2):
            await a.flush()
            await b.flush()
            await a.sync()
            await b.sync()
        for replica in (a, b):
            for run_id, by in (("run-1", "alice"), ("run-2", "bob")):
                view = replica.state.view(run_id)
                assert view is not None and view["resolution"] is not None, run_id
                assert view["resolution"]["by"] == by
            assert replica.state.summaries(needs_person=True) == []


async def test_who_resolved_a_run_reaches_every_replica(tmp_path: Path) -> None:
    """A resolution made through one replica reaches the others with its by (the mark
    row's resolution_by, read by change number like the note), and one made without a
    name reaches them without one."""
    clock = FakeClock()
    settings = settings_for(tmp_path, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        named, nameless = stuck_run(run_id="run-named"), stuck_run(run_id="run-nameless")
        await export_http(a, named.spans() + nameless.spans())
        await b.sync()
        assert await b.resolve("run-named", "settled by hand", by="alice") is not None
        assert await b.resolve("run-nameless", "settled too") is not None
        await a.sync()
        for run_id, by in (("run-named", "alice"), ("run-nameless", None)):
            view = a.state.view(run_id)
            assert view is not None and view["resolution"] is not None
            assert view["resolution"]["by"] == by, run_id


def _stored_resolution(tmp_path: Path, run_id: str) -> list[tuple[Any, ...]]:
    with sql_on(db_for(tmp_path / "sidecar.db")) as run:
        rows = run("SELECT run_id, resolution_note, resolution_at, resolution_by FROM run_marks")
    return [tuple(row[1:]) for row in rows if row[0] == run_id]


async def _resolve_at(replica: Sidecar, run_id: str, body: dict[str, object]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(
            f"http://127.0.0.1:{replica.api_port}/runs/{run_id}/resolve", json=body
        )


async def _resolved_at_a_unread_at_b(a: Sidecar, b: Sidecar, clock: FakeClock) -> dict[str, Any]:
    """A stuck run both replicas hold, resolved by alice through A; B has not read that
    (its tick is an hour: its memory is stale, as for up to a tick between real ones)."""
    await export_http(a, stuck_run(run_id="run-1").spans())
    await b.sync()
    first = await _resolve_at(a, "run-1", {"note": "reversed by hand", "by": "alice"})
    assert first.status_code == 200, first.text
    clock.now += 5.0
    view = b.state.view("run-1")
    assert view is not None and view["resolution"] is None
    return dict(first.json()["resolution"])


async def test_another_note_through_a_replica_that_has_not_read_the_first_is_refused(
    tmp_path: Path,
) -> None:
    """The first resolution stands in the database, not in one replica's memory: bob's
    note through B is a 409 naming alice's note and name, the database keeps hers, and B
    shows hers from then on."""
    clock = FakeClock()
    settings = settings_for(tmp_path, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        alice = await _resolved_at_a_unread_at_b(a, b, clock)
        second = await _resolve_at(b, "run-1", {"note": "retried close_ticket", "by": "bob"})
        assert second.status_code == 409, second.text
        assert second.json()["resolution"] == alice
        assert "'alice'" in second.json()["error"]
        assert "'reversed by hand'" in second.json()["error"]
        assert _stored_resolution(tmp_path, "run-1") == [("reversed by hand", alice["at"], "alice")]
        view = b.state.view("run-1")
        assert view is not None and view["resolution"] == alice


async def test_the_same_note_through_a_replica_that_has_not_read_the_first_is_unchanged(
    tmp_path: Path,
) -> None:
    """The same note again through B (a retry, or a second person agreeing) is a 200 with
    the resolution as it stands: alice's time and name, not re-stamped as bob's."""
    clock = FakeClock()
    settings = settings_for(tmp_path, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        alice = await _resolved_at_a_unread_at_b(a, b, clock)
        same = await _resolve_at(b, "run-1", {"note": "reversed by hand", "by": "bob"})
        assert same.status_code == 200, same.text
        assert same.json()["resolution"] == alice
        assert _stored_resolution(tmp_path, "run-1") == [("reversed by hand", alice["at"], "alice")]


async def test_a_replacement_through_one_replica_reaches_the_others(tmp_path: Path) -> None:
    """bob replaces alice's note through B ("replace": true): A shows bob's note, time and
    name after one sync, and answers the same note again with 200 and another with 409
    naming bob, as B does: every replica reaches the same view."""
    clock = FakeClock()
    settings = settings_for(tmp_path, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        alice = await _resolved_at_a_unread_at_b(a, b, clock)
        await b.sync()
        body = {"note": "retried close_ticket", "by": "bob", "replace": True}
        replaced = await _resolve_at(b, "run-1", body)
        assert replaced.status_code == 200, replaced.text
        bob = replaced.json()["resolution"]
        assert bob != alice and (bob["note"], bob["by"]) == ("retried close_ticket", "bob")
        await a.sync()
        view = a.state.view("run-1")
        assert view is not None and view["resolution"] == bob
        same = await _resolve_at(a, "run-1", {"note": "retried close_ticket"})
        assert same.status_code == 200 and same.json()["resolution"] == bob
        other = await _resolve_at(a, "run-1", {"note": "reversed by hand", "by": "alice"})
        assert other.status_code == 409 and other.json()["resolution"] == bob
        assert _stored_resolution(tmp_path, "run-1") == [("retried close_ticket", bob["at"], "bob")]


async def test_a_resolution_another_replica_lapsed_goes_at_every_replica(
    tmp_path: Path,
) -> None:
    """alice resolves a run through A while it unwinds; its undo fails at A, which lapses
    the resolution and clears it. B reads the failed undo and alice's resolution in one
    sync, before A's clear lands (in that order it has nothing to lapse): once it reads the
    clear, the resolution goes at B too, and the run waits for a person at both."""
    clock = FakeClock()
    settings = settings_for(tmp_path, tick_interval=3600.0)
    run = compensation_failed_run()
    spans = run.spans()
    cut = next(i for i, s in enumerate(spans) if s.attributes[sc.SAGA_PHASE] == sc.PHASE_UNWIND)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        await export_http(a, spans[: cut + 1])
        await b.sync()
        assert await a.resolve(run.run_id, "watching it", by="alice") is not None
        assert a.store is not None
        clear, landed = a.store.clear_resolutions, threading.Event()

        def late_clear(lapsed: Any) -> None:  # on A's database thread
            landed.wait(30)
            clear(lapsed)

        a.store.clear_resolutions = late_clear  # type: ignore[method-assign]
        await export_http(a, spans[cut + 1 :])
        await b.sync()  # the failed undo, then alice's resolution
        landed.set()
        await a.flush()
        await b.sync()  # the clear
        for replica in (a, b):
            view = replica.state.view(run.run_id)
            assert view is not None and view["status"] == sc.STATUS_COMPENSATION_FAILED
            assert view["resolution"] is None, view["resolution"]
            assert [s["run_id"] for s in replica.state.summaries(needs_person=True)] == [run.run_id]


async def test_an_agent_back_with_heartbeats_at_the_follower_is_back_at_the_leader(
    tmp_path: Path,
) -> None:
    """Orphaned, then heard from again with heartbeats only, at the follower: the leader
    sees it back (it refuses an unforced lease while the agent beats), and the agent's
    real death afterwards is paged again, as on one sidecar."""
    clock = FakeClock()
    got: list[tuple[str, AlertEvent]] = []
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    leader, follower = _alerting_replicas(settings, clock, got)
    async with leader, follower:
        run = open_run(instance="agent-1")
        await export_http(follower, run.spans())
        await export_http(follower, heartbeat_spans("agent-1", [run.run_id], clock.now))
        await leader.sync()
        clock.now += 10.0  # silent past its window
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()
        await follower.sync()
        assert follower.state.status(run.run_id) == sc.STATE_ORPHANED
        for _ in range(3):  # it was only late: it beats again, at the follower only
            clock.now += 1.0
            await export_http(follower, heartbeat_spans("agent-1", [run.run_id], clock.now))
            await leader.sync()
            assert leader.tick() == []
        for replica in (leader, follower):
            assert replica.state.status(run.run_id) == sc.STATE_RUNNING
        refused = await leader.lease(run.run_id, "grant", {"holder": "recoverer:1"})
        assert not isinstance(refused, Lease) and refused.reason == "agent_alive", refused
        clock.now += 10.0  # now it dies
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()
        await follower.sync()
        assert follower.state.status(run.run_id) == sc.STATE_ORPHANED
        await _until(lambda: len(got) >= 3, "paged, resolved, paged again")
        await asyncio.sleep(0.1)  # nothing more arrives
    orphaned = [(e.action, e.dedup_key) for _, e in got if e.alertname == sc.ALERT_RUN_ORPHANED]
    assert [a for a, _ in orphaned] == [Action.FIRE, Action.RESOLVE, Action.FIRE]
    assert orphaned[0][1] == orphaned[1][1] != orphaned[2][1]  # a second episode


async def test_a_follower_that_heard_the_agent_after_the_mark_does_not_restore_it(
    tmp_path: Path,
) -> None:
    """The leader orphans the run; before the follower reads that mark, the agent beats
    at the follower: the follower never goes back to orphaned (no second page for one
    death), and the leader, reading the heartbeat, ends the mark in the store, so a
    replica started later does not restore it either."""
    clock = FakeClock()
    got: list[tuple[str, AlertEvent]] = []
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    leader, follower = _alerting_replicas(settings, clock, got)
    async with leader, follower:
        run = open_run(instance="agent-1")
        await export_http(follower, run.spans())
        await leader.sync()
        clock.now += 10.0
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()
        clock.now += 1.0
        await export_http(follower, heartbeat_spans("agent-1", [run.run_id], clock.now))
        await follower.sync()  # reads the mark, older than the heartbeat it took
        assert follower.state.status(run.run_id) == sc.STATE_RUNNING
        await leader.sync()
        assert leader.state.status(run.run_id) == sc.STATE_RUNNING
        await leader.flush()
        await follower.sync()
        assert follower.state.status(run.run_id) == sc.STATE_RUNNING
        await _until(lambda: len(got) >= 2, "paged, then resolved")
        await asyncio.sleep(0.1)  # nothing more arrives
        async with Sidecar(settings, clock=clock) as started:
            assert started.state.status(run.run_id) == sc.STATE_RUNNING
    orphaned = [e.action for _, e in got if e.alertname == sc.ALERT_RUN_ORPHANED]
    assert orphaned == [Action.FIRE, Action.RESOLVE]


async def test_the_parts_of_one_beat_at_the_follower_bring_every_run_back_at_the_leader(
    tmp_path: Path,
) -> None:
    """A beat too large for one span comes as parts, in requests of their own: here both
    at the follower, after the leader's orphan marks and before the follower read them (so
    the follower keeps the runs and clears no mark). The leader reads the instance's row:
    it names the runs of every part of the beat, not only the last part's, or the runs of
    the others would stay orphaned at the leader while the follower has them running."""
    clock = FakeClock()
    got: list[tuple[str, AlertEvent]] = []
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    leader, follower = _alerting_replicas(settings, clock, got)
    async with leader, follower:
        runs = [open_run(instance="agent-1") for _ in range(2)]
        await export_http(follower, [s for run in runs for s in run.spans()])
        await leader.sync()
        clock.now += 10.0
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED] * 2
        await leader.flush()
        clock.now += 1.0
        for run in runs:  # beat 1 in two parts, a request each
            beat = heartbeat_spans("agent-1", [run.run_id], clock.now, beat=1, parts=2)
            await export_http(follower, beat)
        await follower.sync()  # reads the marks, older than the heartbeats it took
        await leader.sync()
        for replica in (leader, follower):
            assert [replica.state.status(r.run_id) for r in runs] == [sc.STATE_RUNNING] * 2
        await leader.flush()
        await follower.sync()
        async with Sidecar(settings, clock=clock) as started:  # the marks were ended
            assert [started.state.status(r.run_id) for r in runs] == [sc.STATE_RUNNING] * 2


async def test_a_mark_cleared_through_one_replica_is_cleared_at_the_others(
    tmp_path: Path,
) -> None:
    """A clear (the orphan mark ended by a replica that heard from the run) is read by the
    others as a mark is, with the mark it ended: a replica holding that mark ends it, a
    later mark stands, and a clear is read once."""
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    assert settings.db_url is not None
    other = PgStore(parse_db(settings.db_url))  # a replica that heard from the run
    try:
        async with Sidecar(settings, clock=clock) as replica:
            run = open_run(instance="agent-1")
            await export_http(replica, run.spans())
            clock.now += 10.0
            other.mark_orphaned([(run.run_id, clock.now)])
            await replica.sync()
            assert replica.state.status(run.run_id) == sc.STATE_ORPHANED
            other.clear_orphaned([(run.run_id, clock.now - 1.0)])  # not this mark
            await replica.sync()
            assert replica.state.status(run.run_id) == sc.STATE_ORPHANED
            other.clear_orphaned([(run.run_id, clock.now)])
            await replica.sync()
            assert replica.state.status(run.run_id) == sc.STATE_RUNNING
            view = replica.state.view(run.run_id)
            assert view is not None and view["revived"] is not None
            assert view["revived"]["orphaned_at"] == clock.now
            assert replica.store is not None
            assert await replica._call(replica.store.changes, clock.now) == ([], [], [], [], [])
    finally:
        other.close()


async def _post(sidecar: Sidecar, spans: list[Any]) -> ExportTraceServiceResponse:
    body = encode_spans(spans).SerializeToString()
    async with httpx.AsyncClient() as client:
        resp = await client.post(
            f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces",
            content=body,
            headers={"Content-Type": "application/x-protobuf"},
        )
    assert resp.status_code == 200, resp.text
    return ExportTraceServiceResponse.FromString(resp.content)


async def test_a_replica_screens_by_the_store_not_only_what_it_folded(tmp_path: Path) -> None:
    """Before B folds in A's run (no tick here), B refuses a stranger on it, as A would,
    and takes the spans of the recoverer A leased it to."""
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        run = open_run(instance="agent-1")
        assert not (await _post(a, run.spans())).partial_success.rejected_spans
        stranger = RunScript(instance="intruder", run_id=run.run_id, t0=1_500_000_000.0)
        stranger.do(0, "wipe", "compensable", comp=("delete_account", {}, "x"))
        refused = await _post(b, stranger.spans())
        assert refused.partial_success.rejected_spans == len(stranger.spans())
        assert "belongs to trace" in refused.partial_success.error_message
        clock.now += 10.0
        a.tick()  # the agent is gone: A may lease the run
        lease = await a.lease(run.run_id, "grant", {"holder": "recoverer:1"})
        assert isinstance(lease, Lease)
        # The recoverer's spans go to B, which never saw the grant: B reads the lease.
        undo = RunScript(instance="recoverer", run_id=run.run_id)
        undo.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
        spans = [rejoin(s, run, token=lease.token) for s in undo.spans() if s.name != undo.run.name]
        assert not (await _post(b, spans)).partial_success.rejected_spans
        read = b.state.lease(run.run_id)  # its times on B's clock (_pgstore._to_replica)
        assert read is not None and (read.holder, read.token) == (lease.holder, lease.token)
        view = b.state.view(run.run_id)
        assert view is not None and view["stack"] == []


async def test_an_agent_back_at_one_replica_stops_the_recoverer_renewing_at_the_other(
    tmp_path: Path,
) -> None:
    """A granted the lease on a run whose agent looked dead; the agent comes back with a
    heartbeat, then a span, each at B only. Once A has read them, A refuses the
    recoverer's renewal: the agent goes on, the recoverer stops before its next undo."""
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        runs = [open_run(instance="agent-1") for _ in range(2)]
        leases = []
        for run in runs:
            assert not (await _post(a, run.spans())).partial_success.rejected_spans
        clock.now += 10.0
        a.tick()
        for run in runs:
            lease = await a.lease(run.run_id, "grant", {"holder": "recoverer:1"})
            assert isinstance(lease, Lease)
            leases.append(lease)
        clock.now += 1.0
        await _post(b, heartbeat_spans("agent-1", [runs[0].run_id], clock.now))
        runs[1].do(2, "note_ticket", "read")
        await b.sync()  # B folds the run in from the store, then takes the agent's span
        assert not (await _post(b, runs[1].spans())).partial_success.rejected_spans
        await a.sync()
        for run, lease in zip(runs, leases, strict=True):
            ask = {"holder": "recoverer:1", "token": lease.token, "ttl_s": 30}
            answer = await a.lease(run.run_id, "renew", ask)
            assert not isinstance(answer, Lease), (run.run_id, answer)
            assert answer.reason == "agent_alive", answer


async def test_a_lease_released_through_one_replica_is_released_at_the_other(
    tmp_path: Path,
) -> None:
    """A grants the lease, the recoverer gives up and releases it through B: once A has
    read the release (which lowers the expiry), A's lease is released too: the leader
    judges the run as nobody's, not as taken until the grant's expiry ten minutes on."""
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        run = open_run(instance="agent-1")
        assert not (await _post(a, run.spans())).partial_success.rejected_spans
        clock.now += 10.0
        a.tick()
        lease = await a.lease(run.run_id, "grant", {"holder": "rec:1", "ttl_s": 600})
        assert isinstance(lease, Lease)
        undo = RunScript(instance="recoverer", run_id=run.run_id)
        undo.unwind("recovery", "issue_credit", [])
        spans = [rejoin(s, run, token=lease.token) for s in undo.spans() if s.name != undo.run.name]
        assert not (await _post(b, spans)).partial_success.rejected_spans  # it began
        await a.sync()
        released = await b.lease(run.run_id, "release", {"holder": "rec:1", "token": 1})
        assert isinstance(released, Lease) and released.released
        await a.sync()
        read = a.state.lease(run.run_id)  # its times on A's clock (_pgstore._to_replica)
        assert read is not None and read.released and read.token == released.token
        view = await _run_json(a, run.run_id)
        assert view["recovery"]["released"] is True


async def test_a_replica_whose_clock_is_ahead_grants_no_second_lease(tmp_path: Path) -> None:
    """B's clock runs two minutes ahead of A's, more than the lease's time to live. The
    lease a recoverer took through A is still live at B: B refuses a second recoverer and
    renews the first's (B saw it expired and granted it again: both recoverers undid).
    Leases are judged on the database's clock, which every replica shares."""
    mine, ahead = FakeClock(), FakeClock()
    ahead.now = mine.now + 120.0
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=mine) as a, Sidecar(settings, clock=ahead) as b:
        run = open_run(instance="agent-1", t0=mine.now)
        assert not (await _post(a, run.spans())).partial_success.rejected_spans
        mine.now += 10.0  # the agent died
        ahead.now += 10.0
        a.tick()
        await a.flush()  # its orphan mark, which B reads
        await b.sync()
        lease = await a.lease(run.run_id, "grant", {"holder": "rec:1", "ttl_s": 30})
        assert isinstance(lease, Lease)
        second = await b.lease(run.run_id, "grant", {"holder": "rec:2", "ttl_s": 30})
        assert not isinstance(second, Lease), "a second recoverer got the lease"
        assert second.reason == "held" and second.holder == "rec:1", second
        ask = {"holder": "rec:1", "token": lease.token, "ttl_s": 30}
        assert isinstance(await b.lease(run.run_id, "renew", ask), Lease)


async def test_a_leader_whose_clock_is_ahead_orphans_no_run_under_recovery(
    tmp_path: Path,
) -> None:
    """The leader's clock runs two minutes ahead of the replica that granted the lease: a
    run its recoverer took up and works on quietly (a long undo) is not orphaned, and not
    paged, while the lease lives; once the lease has ended it is."""
    mine, ahead = FakeClock(), FakeClock()
    ahead.now = mine.now + 120.0
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=ahead) as leader, Sidecar(settings, clock=mine) as b:
        run = open_run(instance="agent-1", t0=mine.now)
        assert not (await _post(b, run.spans())).partial_success.rejected_spans
        await leader.sync()
        mine.now += 10.0  # the agent died
        ahead.now += 10.0
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()  # its orphan mark, which B reads
        await b.sync()
        lease = await b.lease(run.run_id, "grant", {"holder": "rec:1", "ttl_s": 30})
        assert isinstance(lease, Lease)
        undo = RunScript(instance="recoverer", run_id=run.run_id, t0=mine.now)
        undo.unwind("recovery", "issue_credit", [])
        spans = [rejoin(s, run, token=lease.token) for s in undo.spans() if s.name != undo.run.name]
        assert not (await _post(b, spans)).partial_success.rejected_spans  # it took the run up
        await leader.sync()
        assert leader.state.status(run.run_id) != sc.STATE_ORPHANED
        mine.now += 6.0  # quiet past the idle timeout, inside the lease
        ahead.now += 6.0
        database_clock_passes(b, 6.0)
        await leader.sync()
        assert leader.tick() == [], "a run under a live lease was orphaned"
        released = await b.lease(run.run_id, "release", {"holder": "rec:1", "token": 1})
        assert isinstance(released, Lease)
        await leader.sync()
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]


def _altered(span: ReadableSpan) -> ReadableSpan:
    """The same span id with other content (a buggy agent reusing an id)."""
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes={**(span.attributes or {}), sc.SAGA_COMPENSATION_ARGS: '{"credit_id": "cr_X"}'},
        start_time=span.start_time,
        end_time=span.end_time,
        status=span.status,
        events=span.events,
    )


async def _run_json(sidecar: Sidecar, run_id: str) -> Any:
    async with httpx.AsyncClient() as client:
        resp = await client.get(
            f"http://127.0.0.1:{sidecar.api_port}/runs/{run_id}",
            headers={"Accept": "application/json"},
        )
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_one_run_split_across_two_replicas_folds_as_one_sidecar(tmp_path: Path) -> None:
    """Spans of the same runs reach two replicas at once: each run is screened under its
    row lock in the database, so both replicas (and GET /runs/{id} through either) show
    what one SQLite sidecar shows for the spans that were accepted."""
    settings = settings_for(tmp_path, tick_interval=3600.0)  # no ticks: sync by hand
    runs = [compensated_run(), compensation_failed_run(), stuck_run(), completed_run()]
    # Two instances open the same new run ids at once, one at each replica: one owns each.
    racers = [
        (
            RunScript(instance="agent-x", run_id=f"race-{i}").do(0, "a", "read"),
            RunScript(instance="agent-y", run_id=f"race-{i}", t0=1_700_000_001.0).do(
                0, "b", "read"
            ),
        )
        for i in range(6)
    ]
    # A span id reused with other content reaches both replicas at once: one version stands.
    dup_run = open_run(instance="agent-d")
    dup = next(
        s for s in dup_run.spans() if s.attributes and s.attributes.get(sc.SAGA_STEP_INDEX) == 1
    )
    accepted: list[ReadableSpan] = []
    async with Sidecar(settings) as a, Sidecar(settings) as b:
        await _post(a, [s for s in dup_run.spans() if s is not dup])
        accepted += [s for s in dup_run.spans() if s is not dup]
        posts = []
        sent: list[list[ReadableSpan]] = []
        for run in runs:
            for i, span in enumerate(run.spans()):
                posts.append(_post(a if i % 2 else b, [span]))
                sent.append([span])
        for x, y in racers:
            posts += [_post(a, x.spans()), _post(b, y.spans())]
            sent += [x.spans(), y.spans()]
        posts += [_post(a, [dup]), _post(b, [_altered(dup)])]
        sent += [[dup], [_altered(dup)]]
        answers = await asyncio.gather(*posts)
        for spans, answer in zip(sent, answers, strict=True):
            refused = answer.partial_success.rejected_spans
            assert refused in (0, len(spans)), answer
            if not refused:
                accepted += spans
        dups = [ans.partial_success.rejected_spans for ans in answers[-2:]]
        assert sorted(dups) == [0, 1], "exactly one version of the reused span id stands"
        for i in range(len(racers)):
            won = [ans.partial_success.rejected_spans for ans in answers[-14 + 2 * i : -12 + 2 * i]]
            assert sorted(won) == [0, 1], f"race-{i}: exactly one instance owns the run"
        await a.sync()
        await b.sync()
        run_ids = [r.run_id for r in runs] + [x.run_id for x, _ in racers] + [dup_run.run_id]
        through_a = [await _run_json(a, r) for r in run_ids]
        through_b = [await _run_json(b, r) for r in run_ids]
    reference = Settings(
        otlp_http_port=0, otlp_grpc_port=0, api_port=0, db_path=tmp_path / "one.db"
    )
    async with Sidecar(reference) as one:
        await _post(one, accepted)
        alone = [await _run_json(one, r) for r in run_ids]
    assert through_a == alone
    assert through_b == alone


def _request(spans: list[ReadableSpan]) -> Decoded:
    body = encode_spans(spans).SerializeToString()
    return extract(parse_protobuf(body), body)


class _Commits:
    """Counts the intake transactions of a store (the real one underneath)."""

    def __init__(self, sidecar: Sidecar) -> None:
        assert sidecar.store is not None
        self.store = sidecar.store
        self.real = sidecar.store.write_screened
        self.count = 0
        self.store.write_screened = self  # type: ignore[method-assign]

        self.during_first: Callable[[], None] = lambda: None

    def __call__(self, *args: Any) -> Any:
        self.count += 1
        if self.count == 1:  # on the database thread, while the first transaction runs
            self.during_first()
        return self.real(*args)


def _group_requests() -> tuple[list[list[ReadableSpan]], list[str], int]:
    """Requests of the same runs and of different runs, a heartbeat, and one span id sent
    twice with other content (second last and last): (requests, run ids, first's index)."""
    runs = [compensated_run(), compensation_failed_run(), stuck_run(), completed_run()]
    requests: list[list[ReadableSpan]] = []
    for run in runs:  # the first half of each run's spans in one request, then one by one
        spans = run.spans()
        half = len(spans) // 2
        requests.append(spans[:half])
        requests += [[s] for s in spans[half:]]
    requests.append(heartbeat_spans("agent-1", [runs[2].run_id], at=1_700_000_050.0))
    dup_run = open_run(instance="agent-d")
    dup = next(
        s for s in dup_run.spans() if s.attributes and s.attributes.get(sc.SAGA_STEP_INDEX) == 1
    )
    requests.append([s for s in dup_run.spans() if s is not dup])
    requests += [[dup], [_altered(dup)]]
    return requests, [r.run_id for r in runs] + [dup_run.run_id], len(requests) - 2


async def test_concurrent_requests_at_one_replica_share_a_commit_and_fold_as_sequential(
    tmp_path: Path,
) -> None:
    """Requests that arrive while an intake transaction runs are taken together into one
    (group commit): screened in arrival order (of two versions of one span id in the group
    the first stands), folded in order, each answered. One of them whose sender went away
    is still stored and folded. The views are what one request at a time gives."""
    requests, run_ids, dup = _group_requests()

    def refused_for(n: int) -> list[int]:  # the second version of the span id is refused
        return [1 if i == dup + 1 else 0 for i in range(n)]

    clock = FakeClock()
    settings = settings_for(tmp_path, tick_interval=3600.0)
    async with Sidecar(settings, clock=clock) as grouped:
        commits = _Commits(grouped)
        loop = asyncio.get_running_loop()
        tasks = [asyncio.create_task(grouped.ingest(_request(r), "http")) for r in requests]
        await asyncio.sleep(0)  # every request is waiting for the next transaction
        gone = tasks[3]
        gone.cancel()
        answers = await asyncio.gather(*(t for t in tasks if t is not gone))
        assert commits.count == 1, "one transaction for the whole group"
        views = {r: grouped.state.view(r) for r in run_ids}
        # Again on fresh runs in two groups, the second sent while the first one's
        # transaction runs: it is stored while the first group is folded.
        again, again_ids, _ = _group_requests()
        half = len(again) // 2
        second: list[asyncio.Task[Decoded]] = []
        sent = asyncio.Event()

        def send_second() -> None:
            for r in again[half:]:
                second.append(asyncio.create_task(grouped.ingest(_request(r), "http")))
            sent.set()

        commits.count = 0
        commits.during_first = lambda: loop.call_soon_threadsafe(send_second)
        first = [grouped.ingest(_request(r), "http") for r in again[:half]]
        more = await asyncio.gather(*first)
        await sent.wait()
        more += await asyncio.gather(*second)
        assert commits.count == 2
        assert [a.rejected for a in more] == refused_for(len(again))
        views2 = {r: grouped.state.view(r) for r in again_ids}
    assert gone.cancelled()
    assert [a.rejected for a in answers] == refused_for(len(requests))[:3] + refused_for(
        len(requests)
    )[4:]
    reference = Settings(
        otlp_http_port=0, otlp_grpc_port=0, api_port=0, db_path=tmp_path / "one.db"
    )
    async with Sidecar(reference, clock=clock) as one:
        for spans in requests:
            await one.ingest(_request(spans), "http")
        alone = {r: one.state.view(r) for r in run_ids}
        for spans in again:
            await one.ingest(_request(spans), "http")
        alone2 = {r: one.state.view(r) for r in again_ids}
    assert views == alone
    assert views2 == alone2
    # And from the store: a replica started on it folds the same views.
    async with Sidecar(settings, clock=clock) as again:
        assert {r: again.state.view(r) for r in run_ids} == alone


async def test_a_failed_commit_answers_503_to_every_member_and_folds_none(
    tmp_path: Path,
) -> None:
    """A group whose COMMIT fails (here a deferred constraint refusing one member's run):
    every member's request fails with the store error (503), none is folded or stored, and
    the next requests go through."""
    import psycopg

    settings = settings_for(tmp_path, tick_interval=3600.0)
    assert settings.db_url is not None
    with psycopg.connect(settings.db_url, autocommit=True) as conn:
        async with Sidecar(settings) as sidecar:
            conn.execute(
                "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'poisoned run'; END $$"
            )
            conn.execute(
                "CREATE CONSTRAINT TRIGGER poison AFTER INSERT ON spans "
                "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
                "WHEN (NEW.run_id = 'poison-run') EXECUTE FUNCTION refuse_poison()"
            )
            good = [completed_run(), compensated_run()]
            poison = RunScript(instance="agent-p", run_id="poison-run").do(0, "a", "read")
            requests = [good[0].spans(), poison.spans(), good[1].spans()]
            answers = await asyncio.gather(
                *(sidecar.ingest(_request(r), "http") for r in requests), return_exceptions=True
            )
            for answer in answers:
                assert isinstance(answer, StoreError), answer
                assert "poisoned run" in str(answer)
            for run in [*good, poison]:
                assert sidecar.state.view(run.run_id) is None
            assert sidecar.store is not None
            assert await sidecar._call(sidecar.store.span_count) == 0
            assert conn.execute("SELECT count(*) FROM run_owners").fetchone() == (0,)
            # The same requests again, less the poisoned one: stored and folded.
            for answer in await asyncio.gather(
                *(sidecar.ingest(_request(r), "http") for r in requests[::2])
            ):
                assert not answer.rejected
            for run in good:
                assert sidecar.state.view(run.run_id) is not None
            conn.execute("DROP TRIGGER poison ON spans")


async def test_a_group_holds_at_most_its_bound_and_groups_commit_in_arrival_order(
    tmp_path: Path,
) -> None:
    """The group bound (``_groups.Groups``) on PostgreSQL's driver: five requests with a
    bound of two are three transactions, in arrival order; the views are what one
    request at a time gives (a stranger's span to a run opened two groups earlier is
    refused as it would be then)."""
    first = open_run(instance="agent-1")
    stranger = RunScript(instance="agent-2", run_id=first.run_id, t0=1_700_000_001.0)
    stranger.do(2, "send_reply", "read")
    others = [completed_run(), compensated_run(), stuck_run()]
    requests = [first.spans(), *(r.spans() for r in others), stranger.spans()]
    async with Sidecar(settings_for(tmp_path, tick_interval=3600.0), clock=FakeClock()) as sc_:
        commits = _Commits(sc_)
        sc_._groups = Groups(2)
        answers = await asyncio.gather(*(sc_.ingest(_request(r), "http") for r in requests))
        assert commits.count == 3
        assert [a.rejected for a in answers] == [0, 0, 0, 0, len(stranger.spans())]
        owner = sc_.state.owner(first.run_id)
        assert owner is not None and owner.instance == "agent-1"
        views = {r.run_id: sc_.state.view(r.run_id) for r in [first, *others]}
    reference = Settings(
        otlp_http_port=0, otlp_grpc_port=0, api_port=0, db_path=tmp_path / "one.db"
    )
    async with Sidecar(reference, clock=FakeClock()) as one:
        for spans in requests:
            await one.ingest(_request(spans), "http")
        assert views == {r.run_id: one.state.view(r.run_id) for r in [first, *others]}


async def test_a_sync_read_before_a_prune_does_not_bring_instances_back(
    tmp_path: Path,
) -> None:
    """A sync reads the heartbeats, a prune forgets their instance while that read is
    still in flight, then the sync folds what it read: the instance stays forgotten
    (its heartbeat is judged against the fold's moment, not the read's start). It came
    back as a flaky test_bounded_state run on PostgreSQL."""
    clock = FakeClock()
    settings = settings_for(tmp_path, retention=3600.0, tick_interval=3600.0)
    assert settings.db_url is not None
    other = PgStore(parse_db(settings.db_url))  # another replica stored the heartbeat
    async with Sidecar(settings, clock=clock) as sidecar:
        other.write([], [heartbeat_row("agent-gone", clock.now, 1.0, [])])
        await sidecar.sync()
        assert sidecar.state.instance_count() == 1
        store = sidecar.store
        assert store is not None
        real_changes = store.changes
        read, release = threading.Event(), threading.Event()

        def slow_changes(now: float) -> Any:
            got = real_changes(now)  # read before the prune's delete
            read.set()
            release.wait(10)
            return got

        store.changes = slow_changes  # type: ignore[method-assign]
        try:
            syncing = asyncio.create_task(sidecar.sync())
            assert await asyncio.to_thread(read.wait, 10)
            clock.now += 3600.0 + 60.0  # the heartbeat is now past the retention
            sidecar.prune()
            assert sidecar.state.instance_count() == 0
            release.set()
            await syncing
        finally:
            release.set()
            store.changes = real_changes  # type: ignore[method-assign]
        await sidecar.flush()
        assert sidecar.state.instance_count() == 0
    other.close()


async def test_a_lease_read_across_a_step_of_the_clock_is_moved_by_it(tmp_path: Path) -> None:
    """The leader's sync reads a lease granted through the other replica, and its clock is
    stepped two minutes forward while that read is in flight: the lease, read on the
    clock before the step, is moved by it as it is folded (the step was told before,
    and moved only what the state held then), so the run under recovery is not
    orphaned while the lease lives."""
    clock, theirs = FakeClock(), FakeClock()
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with (
        Sidecar(settings, clock=clock, steady=clock.steady) as leader,
        Sidecar(settings, clock=theirs) as b,
    ):
        run = open_run(instance="agent-1", t0=clock.now)
        assert not (await _post(b, run.spans())).partial_success.rejected_spans
        await leader.sync()
        for c in (clock, theirs):
            c.now += 10.0  # the agent died
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()  # its orphan mark, which B reads
        await b.sync()
        lease = await b.lease(run.run_id, "grant", {"holder": "rec:1", "ttl_s": 30})
        assert isinstance(lease, Lease)
        undo = RunScript(instance="recoverer", run_id=run.run_id, t0=theirs.now)
        undo.unwind("recovery", "issue_credit", [])
        spans = [rejoin(s, run, token=lease.token) for s in undo.spans() if s.name != undo.run.name]
        assert not (await _post(b, spans)).partial_success.rejected_spans
        store = leader.store
        assert store is not None
        real_changes = store.changes
        read, release = threading.Event(), threading.Event()

        def slow_changes(now: float) -> Any:
            got = real_changes(now)
            read.set()
            release.wait(10)
            return got

        store.changes = slow_changes  # type: ignore[method-assign]
        try:
            syncing = asyncio.create_task(leader.sync())
            assert await asyncio.to_thread(read.wait, 10)
            clock.step(120.0)
            assert leader.tick() == []  # the step is told here, before the fold
            release.set()
            await syncing
        finally:
            release.set()
            store.changes = real_changes  # type: ignore[method-assign]
        for c in (clock, theirs):
            c.now += 6.0  # quiet past the idle timeout, inside the lease
        database_clock_passes(b, 6.0)
        assert leader.tick() == [], "a run under a live lease was orphaned"


def test_a_silent_leader_hands_on_the_lead_and_learns_it_lost_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader paused (SIGSTOP, a long GC pause) or cut off without a FIN keeps its
    connection, and with it the session lock: the database ends the session once it has
    been idle ``hold`` seconds, another replica leads, and the old one, asking again,
    is told it no longer leads before it would judge."""
    url = db_for(tmp_path / "sidecar.db")
    a, b = PgStore(parse_db(url)), PgStore(parse_db(url))
    try:
        assert a.try_lead(1.0) is True
        assert b.try_lead(1.0) is False  # held while a asks within the hold
        for _ in range(5):
            time.sleep(0.1)
            assert a.try_lead(1.0) is True
            assert b.try_lead(1.0) is False
        deadline = time.monotonic() + 30
        while not b.try_lead(1.0):  # a is silent now
            assert time.monotonic() < deadline, "the silent leader kept the lead"
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="sidecar"):
            assert a.try_lead(1.0) is False  # back: told before it would judge
        assert [r.getMessage() for r in caplog.records] == ["sidecar.leader.lost"]
        assert a.try_lead(1.0) is False  # b leads, and keeps the lead while it asks
        assert b.try_lead(1.0) is True
    finally:
        a.close()
        b.close()


def test_a_server_older_than_14_is_refused_before_the_schema_is_touched() -> None:
    target = parse_db("postgresql://saga:s3cret@db.internal:5432/saga")
    with pytest.raises(StoreError) as info:
        check_version(130012, target)
    message = str(info.value)
    assert "version 13.12" in message and "14 or newer" in message and "SQLite" in message
    assert "s3cret" not in message
    with pytest.raises(StoreError, match=r"version 9\.6\.24;"):
        check_version(90624, target)
    check_version(140000, target)  # 14.0 and later pass


def test_a_replica_reads_back_only_the_heartbeats_others_stored(tmp_path: Path) -> None:
    """Its own heartbeat rows are folded already (as its own spans are): a sync that
    returned them would count them as heard again, later than they were."""
    url = db_for(tmp_path / "sidecar.db")
    a, b = PgStore(parse_db(url)), PgStore(parse_db(url))
    try:
        a.changes(100.0), b.changes(100.0)
        a.write([], [heartbeat_row("agent-a", 101.0, 1.0, [])])
        b.write([], [heartbeat_row("agent-b", 101.5, 1.0, [])])
        assert [row[0] for row in a.changes(102.0).instances] == ["agent-b"]
        assert [row[0] for row in b.changes(102.0).instances] == ["agent-a"]
        b.write([], [heartbeat_row("agent-a", 103.0, 1.0, [])])  # the agent now beats through b
        assert [row[0] for row in a.changes(104.0).instances] == ["agent-a"]  # b's new row
        assert a.changes(105.0).instances == []  # each row once: a reread is not a beat
    finally:
        a.close()
        b.close()


def test_a_replica_reads_back_a_row_its_part_of_a_beat_joined(tmp_path: Path) -> None:
    """b stores the second part of a beat whose first part a stored, before b read a's row:
    the row names the runs of both parts, and b reads it back once (a's part is news to
    b, as a's rows are); a row b alone wrote is not read back."""
    url = db_for(tmp_path / "sidecar.db")
    a, b = PgStore(parse_db(url)), PgStore(parse_db(url))
    try:
        a.changes(100.0), b.changes(100.0)
        a.write([], [heartbeat_row("agent-1", 101.0, 1.0, ["r1"], beat=1, parts=2)])
        b.write([], [heartbeat_row("agent-1", 101.0, 1.0, ["r2"], beat=1, parts=2)])
        ((_, _, _, runs, _),) = b.changes(102.0).instances
        assert sorted(json.loads(runs)) == ["r1", "r2"]
        assert b.changes(103.0).instances == []
        ((_, _, _, runs, _),) = a.changes(104.0).instances
        assert sorted(json.loads(runs)) == ["r1", "r2"]
        b.write([], [heartbeat_row("agent-1", 105.0, 1.0, ["r1"], beat=2, parts=1)])
        assert b.changes(106.0).instances == []
    finally:
        a.close()
        b.close()


async def test_a_heartbeat_another_replica_committed_late_does_not_orphan_its_agent(
    tmp_path: Path,
) -> None:
    """The follower's COMMIT of a heartbeat waits on a lock far past the agent's window
    (another session holds the instances table) while the agent waits for its answer.
    The leader must not page it when the row finally lands with its screening time (it
    counts from when the leader read it, and the leader judges only up to the start of
    its last read); once the agent really stops, it is paged."""
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=3600.0, tick_interval=0.02)
    got: list[tuple[str, AlertEvent]] = []
    a, b = _alerting_replicas(settings, clock, got)
    assert settings.db_url is not None
    url = settings.db_url
    async with a, b:
        await _until(lambda: a.leading != b.leading, "one leader")
        leader, follower = (a, b) if a.leading else (b, a)
        run = open_run(instance="agent-1")
        await export_http(follower, run.spans())
        for _ in range(5):  # a live agent at the follower, beating every second
            clock.now += 1.0
            await export_http(follower, heartbeat_spans("agent-1", [run.run_id], clock.now))
            await asyncio.sleep(0.05)
        await _until(lambda: leader.state.status(run.run_id) == sc.STATE_RUNNING, "seen")
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with psycopg.connect(url) as conn:
                conn.execute("LOCK TABLE instances IN ACCESS EXCLUSIVE MODE")
                held.set()
                release.wait(10)

        holder = asyncio.create_task(asyncio.to_thread(hold))
        assert await asyncio.to_thread(held.wait, 10)
        clock.now += 1.0
        beat = asyncio.create_task(
            export_http(follower, heartbeat_spans("agent-1", [run.run_id], clock.now))
        )
        await asyncio.sleep(0.3)  # screened, its COMMIT waiting on the lock
        clock.now += 10.0  # far past the agent's 3 s window
        await asyncio.sleep(0.3)
        release.set()
        await holder
        await beat
        for _ in range(10):  # the leader syncs and ticks meanwhile
            await asyncio.sleep(0.05)
            assert leader.state.status(run.run_id) == sc.STATE_RUNNING
        assert not [e for _, e in got if e.alertname == sc.ALERT_RUN_ORPHANED]
        clock.now += 10.0  # the agent died: no more heartbeats
        await _until(lambda: leader.state.status(run.run_id) == sc.STATE_ORPHANED, "orphaned")
        await _until(lambda: any(e.alertname == sc.ALERT_RUN_ORPHANED for _, e in got), "paged")


async def test_a_replica_whose_clock_is_behind_is_read_as_any_other(tmp_path: Path) -> None:
    """The follower's clock runs 10 s behind the leader's (nothing requires them within
    5 s): the leader reads its heartbeats, marks and leases all the same (by the
    database's change numbers, not by the times the rows hold), so its live agent is
    never paged, its death is, and a lease released through it ends at the leader."""
    ahead, behind = FakeClock(), FakeClock()
    behind.now = ahead.now - 10.0
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=ahead) as leader, Sidecar(settings, clock=behind) as b:
        run = open_run(instance="agent-1")
        await export_http(b, run.spans())
        for _ in range(15):  # a live agent beating every second at the follower
            ahead.now += 1.0
            behind.now += 1.0
            await export_http(b, heartbeat_spans("agent-1", [run.run_id], behind.now))
            await leader.sync()
            assert leader.tick() == [], "a live agent paged"
        ahead.now += 10.0  # it died
        behind.now += 10.0
        await leader.sync()
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()
        await b.sync()
        lease = await b.lease(run.run_id, "grant", {"holder": "rec:1", "ttl_s": 600})
        assert isinstance(lease, Lease)
        assert await b.lease(run.run_id, "release", {"holder": "rec:1", "token": 1})
        await leader.sync()
        mine = leader.state.lease(run.run_id)
        assert mine is not None and mine.released, mine


async def test_a_replica_whose_clock_is_ahead_is_read_as_any_other(tmp_path: Path) -> None:
    """The follower's clock runs an hour ahead of the leader's: its heartbeats count as
    heard when the leader reads them, not at the time the follower stored (the leader kept
    a dead agent alive for the size of the skew), so the agent's death is paged within its
    window."""
    mine, ahead = FakeClock(), FakeClock()
    ahead.now = mine.now + 3600.0
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=mine) as leader, Sidecar(settings, clock=ahead) as b:
        run = open_run(instance="agent-1", t0=mine.now)
        await export_http(b, run.spans())
        for _ in range(5):  # a live agent beating every second at the follower
            mine.now += 1.0
            ahead.now += 1.0
            await export_http(b, heartbeat_spans("agent-1", [run.run_id], mine.now))
            await leader.sync()
            assert leader.tick() == [], "a live agent paged"
        mine.now += 10.0  # it died: past its window
        ahead.now += 10.0
        await leader.sync()
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]


async def test_a_follower_whose_clock_is_ahead_takes_the_leaders_orphan_mark(
    tmp_path: Path,
) -> None:
    """The follower's clock runs an hour ahead of the leader's and the agent spoke only
    to it: the leader's mark (its time on the leader's clock) is still read as written
    after everything the follower heard of the run (by change number), so the dead run
    is orphaned and waits for a person at both replicas, not `running` at the follower."""
    mine, ahead = FakeClock(), FakeClock()
    ahead.now = mine.now + 3600.0
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=mine) as leader, Sidecar(settings, clock=ahead) as b:
        run = open_run(instance="agent-1", t0=mine.now)
        await export_http(b, run.spans())
        for _ in range(5):  # a live agent beating every second at the follower
            mine.now += 1.0
            ahead.now += 1.0
            await export_http(b, heartbeat_spans("agent-1", [run.run_id], mine.now))
            await leader.sync()
        mine.now += 10.0  # it died: past its window
        ahead.now += 10.0
        await leader.sync()
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()
        await b.sync()
        for replica in (leader, b):
            view = replica.state.view(run.run_id)
            assert view is not None and view["status"] == sc.STATE_ORPHANED
            assert [s["run_id"] for s in replica.state.summaries(needs_person=True)] == [run.run_id]


async def test_a_follower_whose_clock_is_behind_keeps_a_run_it_heard_after_the_mark(
    tmp_path: Path,
) -> None:
    """The follower's clock runs an hour behind the leader's. The leader orphans the run;
    the agent then beats at the follower before it reads the mark: the mark was written
    before that heartbeat (by change number, whatever the clocks say), so the follower
    keeps the run running, also when the mark's row comes again with a resolution made
    through the leader, which had not read the heartbeat yet. The leader then reads it,
    ends the mark, and both replicas agree the run is running."""
    mine, behind = FakeClock(), FakeClock()
    behind.now = mine.now - 3600.0
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    async with Sidecar(settings, clock=mine) as leader, Sidecar(settings, clock=behind) as b:
        run = open_run(instance="agent-1", t0=mine.now)
        await export_http(b, run.spans())
        await leader.sync()
        mine.now += 10.0  # silent past its window
        behind.now += 10.0
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()
        mine.now += 1.0  # it was only late
        behind.now += 1.0
        await export_http(b, heartbeat_spans("agent-1", [run.run_id], mine.now))
        await b.sync()  # reads the mark, stored before the heartbeat it took
        assert b.state.status(run.run_id) == sc.STATE_RUNNING
        assert await leader.resolve(run.run_id, "restarting the agent") is not None
        await b.sync()  # the mark's row again (its resolution changed), the same mark
        assert b.state.status(run.run_id) == sc.STATE_RUNNING
        await leader.sync()  # the heartbeat: the leader ends its mark
        await leader.flush()
        await b.sync()
        for replica in (leader, b):
            assert replica.state.status(run.run_id) == sc.STATE_RUNNING


async def test_a_span_whose_commit_waited_past_the_mark_keeps_its_run_at_the_follower(
    tmp_path: Path,
) -> None:
    """The agent's span reaches the follower (its clock an hour behind) within the run's
    window, but its transaction (which opens another run first, so it already has its
    transaction id) waits on the run's owner row, which another session holds, while the
    leader, which cannot see it, orphans the run. Stored after the mark's transaction
    began, the span keeps the run running at the follower when it reads the mark,
    though its transaction id is the older; the leader, reading the span, ends its mark."""
    mine, behind = FakeClock(), FakeClock()
    behind.now = mine.now - 3600.0
    settings = settings_for(tmp_path, idle_timeout=5.0, tick_interval=3600.0)
    assert settings.db_url is not None
    url = settings.db_url
    async with Sidecar(settings, clock=mine) as leader, Sidecar(settings, clock=behind) as b:
        run = open_run(instance="agent-1", t0=mine.now)
        await export_http(b, run.spans())
        await leader.sync()
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with psycopg.connect(url) as conn:
                conn.execute("SELECT 1 FROM run_owners WHERE run_id = %s FOR UPDATE", (run.run_id,))
                held.set()
                release.wait(10)

        holder = asyncio.create_task(asyncio.to_thread(hold))
        assert await asyncio.to_thread(held.wait, 10)
        mine.now += 4.0  # within the window
        behind.now += 4.0
        run.do(2, "tag_ticket", "reversible", comp=("untag", {"t": 1}, "untag"))
        opened = open_run(instance="agent-1", t0=mine.now).spans()[:1]
        sent = asyncio.create_task(export_http(b, opened + run.spans()[-1:]))
        await asyncio.sleep(0.3)  # screened up to the owner row's lock, waiting
        mine.now += 6.0
        behind.now += 6.0
        assert [t.after for t in leader.tick()] == [sc.STATE_ORPHANED]
        await leader.flush()
        release.set()
        await holder
        await sent
        await b.sync()  # reads the mark, begun before the span was stored
        assert b.state.status(run.run_id) == sc.STATE_RUNNING
        await leader.sync()
        await leader.flush()
        await b.sync()
        for replica in (leader, b):
            assert replica.state.status(run.run_id) == sc.STATE_RUNNING


def _lock_waits(url: str) -> int:
    """Sessions of the database at ``url`` waiting on a lock now."""
    with psycopg.connect(url) as conn:
        ((n,),) = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        ).fetchall()
    return int(n)


async def test_a_span_committed_long_after_it_took_its_number_is_still_read(
    tmp_path: Path,
) -> None:
    """The follower's intake takes the sequence number of a run's end, then waits on a
    row lock (another session holds the agent's instances row) far past the 30 s after
    which the leader used to give the missing number up, while the leader reads higher
    numbers committed meanwhile. Then it commits (the agent got its 200): the leader
    must fold the run's end, not keep the run open forever and page it as orphaned."""
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=3600.0, tick_interval=3600.0)
    assert settings.db_url is not None
    url = settings.db_url
    async with Sidecar(settings, clock=clock) as leader, Sidecar(settings, clock=clock) as b:
        run = open_run(instance="agent-1")
        await export_http(b, [*run.spans(), *heartbeat_spans("agent-1", [run.run_id], clock.now)])
        await leader.sync()
        assert leader.state.status(run.run_id) == sc.STATE_RUNNING
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with psycopg.connect(url) as conn:
                conn.execute("SELECT 1 FROM instances WHERE instance = 'agent-1' FOR UPDATE")
                held.set()
                release.wait(30)

        holder = asyncio.create_task(asyncio.to_thread(hold))
        try:
            assert await asyncio.to_thread(held.wait, 10)
            run.end(sc.STATUS_COMPLETED)
            end = [s for s in run.spans() if s.name == run.run.name]
            beat = heartbeat_spans("agent-1", [], clock.now)
            ending = asyncio.create_task(export_http(b, [*end, *beat]))
            # Its spans hold their numbers; its heartbeat waits for the row.
            await _until(lambda: _lock_waits(url) > 0, "the intake waiting on the row")
            other = completed_run(instance="agent-2")  # later numbers, committed
            await export_http(leader, other.spans())
            for _ in range(3):  # each read far past the old give-up time
                await leader.sync()
                clock.now += 60.0
            assert leader.state.status(other.run_id) == sc.STATUS_COMPLETED
            assert leader.state.status(run.run_id) == sc.STATE_RUNNING
        finally:
            release.set()
            await holder
        assert await ending is SpanExportResult.SUCCESS
        await b.sync()
        assert b.state.status(run.run_id) == sc.STATUS_COMPLETED
        await leader.sync()
        assert leader.state.status(run.run_id) == sc.STATUS_COMPLETED


def test_a_burnt_sequence_number_is_given_up_once_its_transaction_ended(
    tmp_path: Path,
) -> None:
    """A number a rolled-back transaction took is missing for good: once every
    transaction that could hold it has ended, it is no longer looked up."""
    url = db_for(tmp_path / "sidecar.db")
    a, b = PgStore(parse_db(url)), PgStore(parse_db(url))
    try:
        a.changes(0.0)
        with psycopg.connect(url) as conn:  # takes a number, then rolls back
            conn.execute(
                "INSERT INTO spans(run_id, span_id, received_at, service, instance, data) "
                "VALUES ('r', 's0', 0, 'svc', 'i', '')"
            )
            conn.rollback()
        b.write([("r", "s1", 0.0, "svc", "i", b"")])
        a.changes(0.0)  # finds the gap below s1's number
        for _ in range(100):  # any transaction of the cluster open meanwhile ends
            if not a._gaps:
                break
            a.changes(0.0)
            threading.Event().wait(0.01)
        assert a._gaps == {}
    finally:
        a.close()
        b.close()


# A replica that claims the oldest pending row of a sink, says which, and lives on.
_CLAIMER = """
import sys, time
from sidecar._pgstore import PgAlertStore
from sidecar._storage import parse_db
store = PgAlertStore(parse_db(sys.argv[1]))
row = store.next_row(sys.argv[2], "pending")
print(row.id if row else "none", flush=True)
time.sleep(600)
"""


def _claim_until(url: str, row_id: int) -> tuple[float, float]:
    """A row's claimed_until and the database's clock now."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT claimed_until, extract(epoch FROM clock_timestamp())::float8 "
            "FROM alert_outbox WHERE id = %s",
            (row_id,),
        ).fetchone()
    assert row is not None
    return float(row[0]), float(row[1])


def test_a_killed_replicas_claim_is_free_at_once_a_live_ones_is_not(tmp_path: Path) -> None:
    """A replica SIGKILLed between claiming an alert and marking it: another replica
    delivers the alert as soon as the dead one's sessions are gone, long before the
    claim's backstop expiry, and never takes a live replica's claim. (With claims kept
    until their expiry alone, the alert waited CLAIM_TTL_S: a chaos run gave up.)"""
    url = db_for(tmp_path / "sidecar.db")
    sink = SharedSink([], "w")
    writer = Outbox(url, [sink])
    try:
        assert writer.add(_events(["r1"])[:1]) == 1
    finally:
        writer.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    claimer = subprocess.Popen(
        [sys.executable, "-c", _CLAIMER, url, sink.name], stdout=subprocess.PIPE, text=True, env=env
    )
    other = PgAlertStore(parse_db(url))
    try:
        assert claimer.stdout is not None
        claimed = claimer.stdout.readline().strip()
        assert claimed.isdigit(), claimed
        assert other.next_row(sink.name, PENDING) is None  # held by a live replica
        os.kill(claimer.pid, signal.SIGKILL)
        claimer.wait()
        until, _ = _claim_until(url, int(claimed))
        row = None
        for _ in range(1500):  # the dead one's backend notices its closed socket
            row = other.next_row(sink.name, PENDING)
            if row is not None:
                break
            threading.Event().wait(0.02)
        assert row is not None and row.id == int(claimed)
        _, now = _claim_until(url, row.id)
        assert now < until  # taken because its claimer died, not because it expired
        assert until - now > CLAIM_TTL_S / 2
    finally:
        if claimer.poll() is None:
            claimer.kill()
            claimer.wait()
        other.close()


def test_a_replica_that_lost_its_presence_takes_it_again_before_it_claims(
    tmp_path: Path,
) -> None:
    """The presence connection dropped (a database restart, an idle timeout): the next
    claim takes a new presence lock first, so other replicas still see the claim as a
    live one's and skip it."""
    import psycopg

    url = db_for(tmp_path / "sidecar.db")
    sink = SharedSink([], "w")
    writer = Outbox(url, [sink])
    try:
        assert writer.add(_events(["r1", "r2"])[::2]) == 2
    finally:
        writer.close()
    a, b = PgAlertStore(parse_db(url)), PgAlertStore(parse_db(url))
    try:
        with psycopg.connect(url, autocommit=True) as admin:
            pid = a._presence.info.backend_pid
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            # It signals the backend and returns: wait until the backend has gone, or the
            # claim below may still find the old connection alive.
            gone = "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s)"
            for _ in range(1000):
                row = admin.execute(gone, (pid,)).fetchone()
                if row is not None and row[0]:
                    break
                time.sleep(0.01)
        first = a.next_row(sink.name, PENDING)
        assert first is not None
        assert a._presence.info.backend_pid != pid
        second = b.next_row(sink.name, PENDING)  # the next row, not a's older one
        assert second is not None and second.id > first.id
    finally:
        a.close()
        b.close()


class HeldSink(SharedSink):
    """A receiver slow to answer: each send waits for ``release`` (set ``entered`` first)."""

    def __init__(self, got: list[tuple[str, AlertEvent]], replica: str) -> None:
        super().__init__(got, replica)
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def send(self, event: AlertEvent) -> None:
        self.entered.set()
        await self.release.wait()
        await super().send(event)


@pytest.mark.parametrize("looks_dead", ["presence_cut", "claim_expired"])
async def test_a_row_whose_send_is_in_flight_is_not_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, looks_dead: str
) -> None:
    """Replica a is sending a fire when its claim stops looking alive to the others: its
    presence connection is cut (a database restart, idle_session_timeout), or the claim
    ran out (a send slower than it; CLAIM_TTL_S is 0 here). The request is still in
    flight: no other replica may take the fire, nor send its resolve, before a has
    recorded it. (Another replica sent both at once, and a's fire landed last: a fire
    after its resolve.)"""
    if looks_dead == "claim_expired":
        monkeypatch.setattr("sidecar._pgstore.CLAIM_TTL_S", 0.0)
    url = db_for(tmp_path / "sidecar.db")
    got: list[tuple[str, AlertEvent]] = []
    sink = HeldSink(got, "a")
    a = Outbox(url, [sink])
    other = PgAlertStore(parse_db(url))
    fire, resolve = _events(["r1"])
    try:
        await a.start()
        await a.call(a.add, [fire])
        await asyncio.wait_for(sink.entered.wait(), 10)  # claimed, and its send begun
        if looks_dead == "presence_cut":
            presence = a._store._presence  # type: ignore[attr-defined]
            with psycopg.connect(url, autocommit=True) as admin:
                pid = presence.info.backend_pid  # its lock gone once this returns
                admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        await a.call(a.add, [resolve])  # the run ended meanwhile
        assert await asyncio.to_thread(other.next_row, sink.name, PENDING) is None
        sink.release.set()
        await _until(lambda: len(got) == 2, "the fire and its resolve delivered")
        assert await a.wait_idle()
    finally:
        sink.release.set()
        await a.stop()
        a.close()
        other.close()
    assert [(who, e.action) for who, e in got] == [("a", Action.FIRE), ("a", Action.RESOLVE)]


async def test_a_replica_paused_past_its_claim_does_not_send_what_another_took_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica a claims a fire and is paused (a stopped process, a long GC pause) until
    its claim runs out (CLAIM_TTL_S is 0 here); b takes the fire over and delivers it,
    then its resolve. Woken, a must not send the fire it claimed (it did: a second
    page, after the resolve) nor record anything on the row."""
    monkeypatch.setattr("sidecar._pgstore.CLAIM_TTL_S", 0.0)
    url = db_for(tmp_path / "sidecar.db")
    got: list[tuple[str, AlertEvent]] = []
    a, b = Outbox(url, [SharedSink(got, "a")]), Outbox(url, [SharedSink(got, "b")])
    store = a._store
    claim = store.next_row
    claimed, resume = threading.Event(), threading.Event()
    claims: list[object] = []

    def paused(sink: str, state: str) -> Any:
        row = claim(sink, state)
        claims.append(row)
        if row is not None and not claimed.is_set():
            claimed.set()
            resume.wait(10)  # a is paused between its claim and its send
        return row

    store.next_row = paused  # type: ignore[method-assign]
    fire, resolve = _events(["r1"])
    try:
        await a.start()
        await a.call(a.add, [fire])
        assert await asyncio.to_thread(claimed.wait, 10)
        await b.start()
        await b.call(b.add, [resolve])
        await _until(lambda: len(got) == 2, "b delivered the fire and its resolve")
        resume.set()
        await _until(lambda: len(claims) >= 2, "a woke and looked for its next row")
        assert await a.wait_idle() and await b.wait_idle()
        rows = [(r.action, r.state, r.attempts) for r in a.rows()]
    finally:
        resume.set()
        for box in (a, b):
            await box.stop()
            box.close()
    assert [(who, e.action) for who, e in got] == [("b", Action.FIRE), ("b", Action.RESOLVE)]
    assert rows == [("fire", DELIVERED, 1), ("resolve", DELIVERED, 1)]


def test_claims_made_before_a_lost_presence_are_held_under_the_new_one(tmp_path: Path) -> None:
    """A replica whose presence connection was cut takes a new presence lock and moves
    its claims to it: a row it claimed before (being sent, or held back for a retry)
    does not look like a dead replica's to the others once it is present again."""
    url = db_for(tmp_path / "sidecar.db")

    class OtherSink(SharedSink):
        name = "webhook:http://other"

    first, second = SharedSink([], "w"), OtherSink([], "w")
    writer = Outbox(url, [first, second])
    try:
        assert writer.add(_events(["r1"])[:1]) == 2  # the fire, once per sink
    finally:
        writer.close()
    a, b = PgAlertStore(parse_db(url)), PgAlertStore(parse_db(url))
    try:
        held = a.next_row(first.name, PENDING)
        assert held is not None
        with psycopg.connect(url, autocommit=True) as admin:
            pid = a._presence.info.backend_pid  # its lock gone once this returns
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        assert a.next_row(second.name, PENDING) is not None  # present again
        assert b.next_row(first.name, PENDING) is None  # still a's
        assert a.sending(held.id, 10.0)
    finally:
        a.close()
        b.close()


class Alertmanager(SharedSink):
    """An Alertmanager seen through a replica; with ``hold_resend``, its first re-send
    waits for ``release`` (``entered`` set first): a re-send pass in progress."""

    kind = "alertmanager"
    name = "alertmanager:http://am"

    def __init__(
        self, got: list[tuple[str, AlertEvent]], replica: str, resend: float | None
    ) -> None:
        super().__init__(got, replica)
        self.resend = resend
        self.held: AlertEvent | None = None  # the re-send held, once it is
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    @property  # type: ignore[override]
    def resend_interval(self) -> float | None:
        return self.resend

    async def send(self, event: AlertEvent) -> None:
        again = any(e.dedup_key == event.dedup_key for _, e in self.got)
        if again and event.action is Action.FIRE and self.held is None:
            self.held = event
            self.entered.set()
            await self.release.wait()
        await super().send(event)


async def test_a_resend_pass_at_one_replica_never_follows_a_resolve_from_another(
    tmp_path: Path,
) -> None:
    """Replica a re-sends its firing alerts to Alertmanager, one at a time from a list it
    read first, while replica b delivers resolves. The fire a is re-sending holds its
    resolve back until that re-send is done; a fire whose resolve b delivered meanwhile
    is not re-sent (it was: Alertmanager took the alert as firing again and notified)."""
    url = db_for(tmp_path / "sidecar.db")
    got: list[tuple[str, AlertEvent]] = []
    sink, clock = Alertmanager(got, "a", resend=60.0), FakeClock()
    a = Outbox(url, [sink], clock=clock)
    b = Outbox(url, [Alertmanager(got, "b", resend=None)])
    store = a._store
    read = store.firing
    passes = [0]

    def firing(sink_name: str, delivered: str) -> list[tuple[int, float, str]]:
        passes[0] += 1
        return read(sink_name, delivered)

    store.firing = firing  # type: ignore[method-assign]
    events = _events(["r1", "r2"])
    fires = [e for e in events if e.action is Action.FIRE]
    resolves = {e.run_id: e for e in events if e.action is Action.RESOLVE}
    try:
        await a.start()
        await a.call(a.add, fires)
        await _until(lambda: len(got) == 2, "both fires delivered")
        clock.now += 61.0  # both due: a's next pass (within POLL_S) re-sends them
        await asyncio.wait_for(sink.entered.wait(), 10)  # a pass is re-sending a fire
        resending = sink.held
        assert resending is not None
        other = "r2" if resending.run_id == "r1" else "r1"
        await b.start()
        await b.call(b.add, [resolves[resending.run_id], resolves[other]])

        def resolved(run_id: str) -> bool:
            return any(e.run_id == run_id and e.action is Action.RESOLVE for _, e in got)

        await _until(lambda: resolved(other), "b delivered the other run's resolve")
        assert not resolved(resending.run_id)  # held back behind the re-send
        looked = passes[0]
        sink.release.set()
        await _until(lambda: resolved(resending.run_id), "then its resolve")
        await _until(lambda: passes[0] > looked, "a's pass ended")
    finally:
        sink.release.set()
        for box in (a, b):
            await box.stop()
            box.close()
    for run_id in ("r1", "r2"):
        mine = [e.action for _, e in got if e.run_id == run_id]
        assert mine[-1] is Action.RESOLVE and mine.count(Action.RESOLVE) == 1, (run_id, mine)


async def test_a_replica_resends_what_one_whose_clock_ran_ahead_sent(tmp_path: Path) -> None:
    """Replica a's clock runs an hour ahead: the send times it stores are in b's future.
    Once a is gone, b re-sends the firing alert every interval (it held off for the size of
    the skew, and Alertmanager ended the page after its resolve_timeout)."""
    url = db_for(tmp_path / "sidecar.db")
    got: list[tuple[str, AlertEvent]] = []
    ahead, behind = Alertmanager(got, "a", resend=0.1), Alertmanager(got, "b", resend=0.1)
    for sink in (ahead, behind):
        sink.release.set()  # no re-send held
    a = Outbox(url, [ahead], clock=lambda: time.time() + 3600.0)
    b = Outbox(url, [behind])
    fires = [e for e in _events(["r1"]) if e.action is Action.FIRE]
    try:
        await a.start()
        await a.call(a.add, fires)
        await _until(lambda: len(got) >= 3, "a delivered the fire and re-sent it")
        await a.stop()
        await b.start()
        await _until(lambda: [r for r, _ in got].count("b") >= 3, "b re-sends it")
    finally:
        for box in (a, b):
            await box.stop()
            box.close()
    assert {e.action for _, e in got} == {Action.FIRE}


async def test_delivery_goes_on_after_the_database_was_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database refuses connections for longer than the pool waits (a restart, a
    failover): the outbox's reads fail, and its worker keeps looking, backing off,
    instead of ending (it ended: that replica delivered no alert until restarted)."""
    monkeypatch.setattr("sidecar._pgstore.POOL_WAIT_S", 0.2)
    url = db_for(tmp_path / "sidecar.db")
    name = url.rsplit("/", 1)[1]
    admin_url = url.rsplit("/", 1)[0] + "/postgres"
    got: list[tuple[str, AlertEvent]] = []
    a = Outbox(url, [SharedSink(got, "a")], backoff=Backoff(initial=0.01, maximum=0.05))
    store = a._store
    claim = store.next_row
    failed: list[StoreError] = []

    def next_row(sink: str, state: str) -> Any:
        try:
            return claim(sink, state)
        except StoreError as exc:
            failed.append(exc)
            raise

    store.next_row = next_row  # type: ignore[method-assign]
    try:
        await a.start()
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            admin.execute(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
            try:
                await _until(lambda: len(failed) >= 2, "the worker's reads failed")
            finally:
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        writer = Outbox(url, [SharedSink([], "w")])
        try:
            assert writer.add(_events(["r1"])[:1]) == 1
        finally:
            writer.close()
        await _until(lambda: len(got) == 1, "the alert written after the outage delivered")
    finally:
        await a.stop()
        a.close()
