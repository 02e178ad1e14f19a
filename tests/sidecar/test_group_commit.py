"""SQLite group commit: concurrent requests share one transaction and keep every rule.

Requests that join a group while it grows commit together (``Sidecar._commit_inline``,
the SQLite driver of ``sidecar/_groups.py``); each must still be answered only once
committed, screened as if the ones before it were folded, and fail together when their
transaction fails. The policy on its own: test_groups.py; PostgreSQL's driver:
test_replicas.py.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sidecar_testkit import FakeClock, RunScript, open_run, settings_for

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar._errors import StoreError
from sidecar._groups import GROWING_LOOKS, MAX_GROUP
from sidecar._otlp import Decoded, extract
from sidecar._store import SqliteStore


def _decoded(spans: Any) -> Decoded:
    body = encode_spans(list(spans)).SerializeToString()
    return extract(ExportTraceServiceRequest.FromString(body), body)


def _stored(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM spans").fetchone()[0])


def _store(sidecar: Sidecar) -> SqliteStore:
    store = sidecar.store
    assert isinstance(store, SqliteStore)
    return store


def _count_writes(sidecar: Sidecar) -> list[int]:
    """The spans of each transaction the sidecar's store writes from here on."""
    store = _store(sidecar)
    writes: list[int] = []
    real_write = store.write

    def counting_write(*args: Any) -> None:
        writes.append(len(args[0]))
        real_write(*args)

    store.write = counting_write  # type: ignore[method-assign,assignment]
    return writes


async def test_concurrent_requests_share_one_commit_and_all_fold(sidecar: Sidecar) -> None:
    runs = [open_run() for _ in range(6)]
    writes = _count_writes(sidecar)
    results = await asyncio.gather(*(sidecar.ingest(_decoded(r.spans()), "http") for r in runs))
    assert [d.rejected for d in results] == [0] * 6
    assert writes == [12]  # six requests of two spans: one transaction
    assert _stored(sidecar.db_path) == 12
    for r in runs:
        view = sidecar.state.view(r.run_id)
        assert view is not None and len(view["steps"]) == 2


async def test_a_request_a_loop_turn_behind_joins_a_growing_group(sidecar: Sidecar) -> None:
    """Arrivals spread over loop turns (handlers start a turn after their bytes): while
    the group grows it waits a turn more, so the late one shares the COMMIT."""
    runs = [open_run() for _ in range(3)]
    writes = _count_writes(sidecar)

    async def late(decoded: Decoded) -> Decoded:
        await asyncio.sleep(0)  # one loop turn behind the first two
        return await sidecar.ingest(decoded, "http")

    results = await asyncio.gather(
        sidecar.ingest(_decoded(runs[0].spans()), "http"),
        sidecar.ingest(_decoded(runs[1].spans()), "http"),
        late(_decoded(runs[2].spans())),
    )
    assert [d.rejected for d in results] == [0, 0, 0]
    assert writes == [6]
    # Alone, a request commits at the first look: it never waits for company.
    lone = open_run()
    await sidecar.ingest(_decoded(lone.spans()), "http")
    assert writes == [6, 2]
    assert _stored(sidecar.db_path) == 8


async def test_a_stream_of_arrivals_cannot_hold_a_group_open(sidecar: Sidecar) -> None:
    """One arrival every loop turn, for longer than GROWING_LOOKS: the first group is
    taken after GROWING_LOOKS looks, and every request is answered."""
    runs = [open_run() for _ in range(3 * GROWING_LOOKS)]
    writes = _count_writes(sidecar)

    async def after(turns: int, decoded: Decoded) -> Decoded:
        for _ in range(turns):
            await asyncio.sleep(0)
        return await sidecar.ingest(decoded, "http")

    results = await asyncio.gather(*(after(i, _decoded(r.spans())) for i, r in enumerate(runs)))
    assert [d.rejected for d in results] == [0] * len(runs)
    assert len(writes) > 1 and writes[0] <= 2 * (GROWING_LOOKS + 2)
    assert sum(writes) == 2 * len(runs) == _stored(sidecar.db_path)


async def test_a_group_holds_at_most_max_group_requests(sidecar: Sidecar) -> None:
    runs = [open_run() for _ in range(MAX_GROUP + 1)]
    writes = _count_writes(sidecar)
    results = await asyncio.gather(*(sidecar.ingest(_decoded(r.spans()), "http") for r in runs))
    assert [d.rejected for d in results] == [0] * len(runs)
    assert writes == [2 * MAX_GROUP, 2]  # the next arrival started the next group
    assert _stored(sidecar.db_path) == 2 * len(runs)


async def test_a_run_opened_in_the_forming_group_belongs_to_its_first_request(
    tmp_path: Path, clock: FakeClock
) -> None:
    first = open_run(instance="agent-1")
    stranger = RunScript(instance="agent-2", run_id=first.run_id, t0=1_700_000_001.0)
    stranger.do(2, "send_reply", "read")
    outcomes = []
    for concurrent in (True, False):  # the same answers as one request after the other
        async with Sidecar(settings_for(tmp_path / str(concurrent)), clock=clock) as sidecar:
            a, b = _decoded(first.spans()), _decoded(stranger.spans())
            if concurrent:
                got = list(
                    await asyncio.gather(sidecar.ingest(a, "http"), sidecar.ingest(b, "http"))
                )
            else:
                got = [await sidecar.ingest(a, "http"), await sidecar.ingest(b, "http")]
            outcomes.append([(d.rejected, d.errors) for d in got])
            owner = sidecar.state.owner(first.run_id)
            assert owner is not None and owner.instance == "agent-1"
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0][0] == 0
    assert outcomes[0][1][0] == len(stranger.spans())  # the stranger's spans: refused


async def test_a_conflicting_duplicate_in_the_same_group_is_refused(sidecar: Sidecar) -> None:
    run = open_run()
    body = encode_spans(list(run.spans())).SerializeToString()
    other = ExportTraceServiceRequest.FromString(body)
    for kv in other.resource_spans[0].scope_spans[0].spans[0].attributes:
        if kv.key == sc.SAGA_STEP_NAME:
            kv.value.string_value = "something_else"  # same span id, other content
    changed = other.SerializeToString()
    first, resend, conflict = await asyncio.gather(
        sidecar.ingest(extract(ExportTraceServiceRequest.FromString(body), body), "http"),
        sidecar.ingest(extract(ExportTraceServiceRequest.FromString(body), body), "http"),
        sidecar.ingest(extract(ExportTraceServiceRequest.FromString(changed), changed), "http"),
    )
    assert first.rejected == 0 and resend.rejected == 0  # a resend: the same bytes
    assert conflict.rejected == 1
    assert "already received with other content" in conflict.errors[0]
    assert _stored(sidecar.db_path) == 2
    view = sidecar.state.view(run.run_id)
    assert view is not None
    assert [s["name"] for s in view["steps"]] == ["lookup_order", "issue_credit"]


async def test_a_failed_group_commit_fails_every_request_and_folds_none(
    sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    runs = [open_run() for _ in range(3)]
    _store(sidecar)._db.execute("PRAGMA busy_timeout=50")
    # Another process holds the write lock: the group's transaction cannot commit.
    blocker = sqlite3.connect(sidecar.db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    caplog.set_level(logging.INFO, logger="sidecar")
    try:
        got = await asyncio.gather(
            *(sidecar.ingest(_decoded(r.spans()), "http") for r in runs),
            return_exceptions=True,
        )
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    # The log says why, once when the refusals begin (not once per request).
    failed = [r for r in caplog.records if r.getMessage() == "sidecar.intake.store_failed"]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR, caplog.records
    assert "locked" in failed[0].__dict__["error"], failed[0].__dict__
    assert all(isinstance(g, StoreError) for g in got), got
    assert all(sidecar.state.view(r.run_id) is None for r in runs)
    # Counted where an operator looks: the spans not stored, answered 503.
    unavailable = {"transport": "http", "outcome": "unavailable"}
    sample = sidecar.metrics.registry.get_sample_value
    assert sample("saga_sidecar_spans_received_total", unavailable) == 6
    assert not sidecar._groups  # nothing left waiting
    # The agents retry (a 503 asks them to): now everything is taken.
    again = await asyncio.gather(*(sidecar.ingest(_decoded(r.spans()), "http") for r in runs))
    assert [d.rejected for d in again] == [0, 0, 0]
    back = [r for r in caplog.records if r.getMessage() == "sidecar.intake.store_recovered"]
    assert [r.__dict__["refused_requests"] for r in back] == [3]
    assert _stored(sidecar.db_path) == 6
    assert sample("saga_sidecar_spans_received_total", unavailable) == 6


def test_a_write_transaction_failing_mid_way_is_rolled_back_whatever_failed(
    tmp_path: Path,
) -> None:
    """SQLite's one transaction helper (``SqliteStore._tx``): an error that is not the
    database's still rolls back, so the next write (a group's COMMIT) is not caught
    inside a transaction left open."""
    store = SqliteStore(tmp_path / "s.db")
    try:
        with pytest.raises(RuntimeError, match="not the database"), store._tx("mark") as db:
            db.execute("INSERT INTO run_marks(run_id, orphaned_at) VALUES ('r1', 1.0)")
            raise RuntimeError("not the database")
        marked = "SELECT run_id FROM run_marks"
        assert store._db.execute(marked).fetchall() == []
        store.mark_orphaned([("r2", 2.0)])
        assert store._db.execute(marked).fetchall() == [("r2",)]
    finally:
        store.close()
