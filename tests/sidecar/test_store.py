"""Durability: a 200 means stored; restarts (even kill -9) rebuild the same runs."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_testkit import (
    BOTH_BACKENDS,
    CREDIT,
    TICKET,
    FakeClock,
    RunScript,
    compensated_run,
    compensation_failed_run,
    db_for,
    export_http,
    open_run,
    settings_for,
    start_sidecar,
    stuck_run,
)
from support import sql_on

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar._backends import open_store
from sidecar._storage import Resolution, heartbeat_row, parse_db

pytestmark = BOTH_BACKENDS


def test_kill_9_then_restart_on_the_same_db(tmp_path: Path, backend: str) -> None:
    db = tmp_path / "state" / "sidecar.db"
    run = RunScript()
    run.do(0, "issue_credit", comp=CREDIT)
    run.do(1, "update_ticket", "reversible", comp=TICKET)
    first, second = run.spans()
    proc, ports = start_sidecar(db)
    try:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{ports['otlp_http']}/v1/traces")
        assert exporter.export([first]) is SpanExportResult.SUCCESS
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if backend == "sqlite":
        assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    proc, ports = start_sidecar(db)
    try:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{ports['otlp_http']}/v1/traces")
        assert exporter.export([second]) is SpanExportResult.SUCCESS
        base = f"http://127.0.0.1:{ports['api']}"
        body = httpx.get(f"{base}/runs/{run.run_id}/stack").json()
        assert body["status"] == sc.STATE_RUNNING
        assert [item["step"] for item in body["stack"]] == ["update_ticket", "issue_credit"]
        view = httpx.get(f"{base}/runs/{run.run_id}").json()
        assert [s["index"] for s in view["steps"]] == [0, 1]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


async def test_restart_keeps_orphan_marks_and_resolutions(tmp_path: Path) -> None:
    clock = FakeClock()
    settings = settings_for(tmp_path, idle_timeout=10.0)
    orphan, stuck = open_run(), stuck_run()
    async with Sidecar(settings, clock=clock) as sc_:
        await export_http(sc_, orphan.spans() + stuck.spans())
        clock.now += 11
        assert [t.after for t in sc_.tick()] == [sc.STATE_ORPHANED]
        assert await sc_.resolve(stuck.run_id, "settled by hand") is not None
    async with Sidecar(settings, clock=clock) as sc_:
        assert sc_.state.status(orphan.run_id) == sc.STATE_ORPHANED
        view = sc_.state.view(stuck.run_id)
        assert view is not None and view["resolution"] == {
            "note": "settled by hand",
            "at": clock.now,
            "by": None,
        }
        assert sc_.tick() == []


async def test_who_resolved_a_run_is_stored_and_goes_when_the_resolution_lapses(
    tmp_path: Path,
) -> None:
    """``by`` is stored with the note (resolution_by) and comes back after a restart; a
    lapsed resolution leaves no name behind in the store."""
    clock = FakeClock()
    settings = settings_for(tmp_path)
    stuck, failed = stuck_run(), compensation_failed_run()
    spans = failed.spans()
    cut = next(i for i, s in enumerate(spans) if s.attributes[sc.SAGA_PHASE] == sc.PHASE_UNWIND)
    async with Sidecar(settings, clock=clock) as sc_:
        await export_http(sc_, stuck.spans() + spans[: cut + 1])
        assert await sc_.resolve(stuck.run_id, "settled by hand", by="alice") is not None
        assert await sc_.resolve(failed.run_id, "watching it", by="bob") is not None
        await export_http(sc_, spans[cut + 1 :])  # its undo failed: the resolution lapses
        await sc_.flush()
    async with Sidecar(settings, clock=clock) as sc_:
        view = sc_.state.view(stuck.run_id)
        assert view is not None
        assert view["resolution"] == {"note": "settled by hand", "at": clock.now, "by": "alice"}
        view = sc_.state.view(failed.run_id)
        assert view is not None and view["resolution"] is None
    with sql_on(db_for(tmp_path / "sidecar.db")) as run:
        rows = run("SELECT run_id, resolution_note, resolution_by FROM run_marks")
    assert sorted(rows) == sorted(
        [(stuck.run_id, "settled by hand", "alice"), (failed.run_id, None, None)]
    )


async def test_prune_removes_finished_runs_from_memory_and_disk(tmp_path: Path) -> None:
    clock = FakeClock()
    settings = settings_for(tmp_path, retention=100.0, idle_timeout=1e6)
    done, waiting, running = compensated_run(), stuck_run(), open_run()
    async with Sidecar(settings, clock=clock) as sc_:
        await export_http(sc_, done.spans() + waiting.spans() + running.spans())
        assert sc_.prune() == []
        clock.now += 101
        # The stuck run waits for a person, however old: pruning it would leave its page
        # firing with no run left to resolve.
        assert sc_.prune() == [done.run_id]
        clock.now += 10 * 86400.0
        assert sc_.prune() == [] and waiting.run_id in sc_.state
        assert await sc_.resolve(waiting.run_id, "refunded by hand") is not None
        assert sc_.prune() == [waiting.run_id]
    store = open_store(settings.database)
    try:
        assert {s.run_id for s in store.spans()} == {running.run_id}
    finally:
        store.close()
    async with Sidecar(settings, clock=clock) as sc_:
        assert done.run_id not in sc_.state and running.run_id in sc_.state
        assert waiting.run_id not in sc_.state


async def test_a_lapsed_resolution_stays_lapsed_after_a_restart(tmp_path: Path) -> None:
    """Resolved while it unwound, then its undo failed: the resolution lapsed in memory
    and in the store, so a restart does not bring it back to hide the run."""
    clock = FakeClock()
    settings = settings_for(tmp_path)
    run = compensation_failed_run()
    spans = run.spans()
    cut = next(i for i, s in enumerate(spans) if s.attributes[sc.SAGA_PHASE] == sc.PHASE_UNWIND)
    async with Sidecar(settings, clock=clock) as sc_:
        await export_http(sc_, spans[: cut + 1])
        assert await sc_.resolve(run.run_id, "watching it") is not None
        await export_http(sc_, spans[cut + 1 :])
        view = sc_.state.view(run.run_id)
        assert view is not None and view["resolution"] is None
        await sc_.flush()
    async with Sidecar(settings, clock=clock) as sc_:
        view = sc_.state.view(run.run_id)
        assert view is not None and view["status"] == sc.STATUS_COMPENSATION_FAILED
        assert view["resolution"] is None


async def test_a_lost_write_of_a_lapse_is_logged_with_what_it_costs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Intake goes on when the store cannot clear a lapsed resolution, and the log says
    what that costs, at once (SQLite) or from PostgreSQL's database thread alike."""
    from sidecar import StoreError

    settings = settings_for(tmp_path)
    run = compensation_failed_run()
    spans = run.spans()
    cut = next(i for i, s in enumerate(spans) if s.attributes[sc.SAGA_PHASE] == sc.PHASE_UNWIND)
    async with Sidecar(settings, clock=FakeClock()) as sc_:
        await export_http(sc_, spans[: cut + 1])
        assert await sc_.resolve(run.run_id, "watching it") is not None
        assert sc_.store is not None

        def refuse(run_ids: object) -> None:
            raise StoreError("the database is read-only")

        sc_.store.clear_resolutions = refuse  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR):
            await export_http(sc_, spans[cut + 1 :])
            await sc_.flush()
        assert sc_.state.status(run.run_id) == sc.STATUS_COMPENSATION_FAILED
    told = [vars(r).get("fix") or "" for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("hidden again until re-resolved" in fix for fix in told), told


def test_the_first_resolution_stands_in_the_store_whoever_writes_it(tmp_path: Path) -> None:
    """The store decides which resolution stands, not a sidecar's memory (a replica's may
    be a tick old): two stores on one database, each told of nothing. Another note is not
    written and the standing one is answered; the same note keeps its time and name;
    ``replace`` writes; a lapse clears only the resolution that lapsed, not one made since;
    one made at or before the run's orphan mark lapsed, so another takes its place."""
    where = settings_for(tmp_path).database
    a, b = open_store(where), open_store(where)
    t = 1_700_000_100.0
    alice = Resolution("reversed by hand", t, "alice")
    bob = Resolution("retried close_ticket", t + 5, "bob")

    def stored(run_id: str) -> list[tuple[object, ...]]:
        with sql_on(db_for(tmp_path / "sidecar.db")) as run:
            rows = run(
                "SELECT run_id, resolution_note, resolution_at, resolution_by FROM run_marks"
            )
        return [tuple(r[1:]) for r in rows if r[0] == run_id]

    try:
        assert a.resolve("run-1", alice) == alice
        assert b.resolve("run-1", bob) == alice
        assert b.resolve("run-1", Resolution(alice.note, t + 6, "bob")) == alice
        assert stored("run-1") == [tuple(alice)]
        assert b.resolve("run-1", bob, replace=True) == bob
        assert a.resolve("run-1", alice) == bob
        a.clear_resolutions([("run-1", alice.at)])  # a lapse of alice's, late: bob's stands
        assert stored("run-1") == [tuple(bob)]
        b.clear_resolutions([("run-1", bob.at)])
        assert stored("run-1") == [(None, None, None)]
        assert a.resolve("run-1", alice) == alice

        assert a.resolve("run-2", alice) == alice
        b.mark_orphaned([("run-2", t + 1)])  # orphaned after alice resolved it: it lapsed
        assert b.resolve("run-2", bob) == bob
        assert a.resolve("run-2", alice) == bob  # bob's came after the mark: it stands
    finally:
        a.close()
        b.close()


def test_store_ignores_duplicate_spans(tmp_path: Path) -> None:
    store = open_store(settings_for(tmp_path).database)
    try:
        row = ("run", "00000000000000aa", 1.0, "svc", "inst", b"span")
        store.write([row])
        store.write([row, row])
        assert store.span_count() == 1
    finally:
        store.close()


def test_unwritable_db_path_is_a_clear_error(tmp_path: Path, backend: str) -> None:
    from sidecar import StoreError

    blocker = tmp_path / "file"
    blocker.write_text("")
    # PostgreSQL's twin: nothing listens on port 1 of loopback.
    where = "postgresql://saga@127.0.0.1:1/x" if backend == "postgresql" else str(blocker / "x.db")
    try:
        open_store(parse_db(where))
    except StoreError as exc:
        assert "--db" in str(exc)
    else:
        raise AssertionError("opened a database that cannot be")


def test_the_parts_of_one_beat_stored_apart_leave_the_row_naming_every_run(
    tmp_path: Path,
) -> None:
    """A beat too large for one span comes as parts, in separate requests, possibly at
    two replicas (two stores on one database here): the instance's row names the runs of
    every part stored (what other replicas read), not only the last part's; the next beat
    takes its place. An agent whose beat number never changes grows the row by at most
    one beat's parts, and a heartbeat without a number replaces the row, as ever."""
    where = settings_for(tmp_path).database
    a, b = open_store(where), open_store(where)

    def held() -> tuple[list[str], object]:
        with sql_on(db_for(tmp_path / "sidecar.db")) as run:
            ((runs, beat),) = run("SELECT open_runs, beat FROM instances")
        return sorted(json.loads(runs)), beat

    try:
        a.write([], [heartbeat_row("agent-1", 101.0, 1.0, ["r1", "r2"], beat=7, parts=3)])
        b.write([], [heartbeat_row("agent-1", 101.0, 1.0, ["r3"], beat=7, parts=3)])
        assert held() == (["r1", "r2", "r3"], 7)
        # Two parts in one request, the last one of the beat at the other store.
        a.write(
            [],
            [
                heartbeat_row("agent-1", 102.0, 1.0, ["r1"], beat=8, parts=3),
                heartbeat_row("agent-1", 102.0, 1.0, ["r2"], beat=8, parts=3),
            ],
        )
        assert held() == (["r1", "r2"], 8)
        b.write([], [heartbeat_row("agent-1", 102.0, 1.0, ["r4"], beat=8, parts=3)])
        assert held() == (["r1", "r2", "r4"], 8)
        # A fourth "part" of a three-part beat is a new beat in disguise: it replaces.
        b.write([], [heartbeat_row("agent-1", 103.0, 1.0, ["r5"], beat=8, parts=3)])
        assert held() == (["r5"], 8)
        a.write([], [heartbeat_row("agent-1", 104.0, 1.0, ["r6"])])  # no number: whole
        assert held() == (["r6"], None)
        a.write([], [heartbeat_row("agent-1", 105.0, 1.0, ["r7"])])
        assert held() == (["r7"], None)
        # Any int64 an agent may send is stored (a refused write would refuse its request).
        big = heartbeat_row("agent-1", 106.0, 1.0, ["r8"], beat=2**63 - 1, parts=2**40)
        a.write([], [big])
        b.write([], [(*big[:3], '["r9"]', *big[4:])])
        assert held() == (["r8", "r9"], 2**63 - 1)
    finally:
        a.close()
        b.close()
