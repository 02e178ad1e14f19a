"""Memory bounded by open runs: finished runs leave memory and are served from the store.

The tests run on SQLite and on PostgreSQL (the replicas' one on PostgreSQL). What a
finished run answers (its view, its stack, its place in the listing, its page) must not
change when it is put away, after a restart, or when a late span brings it back.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sidecar_testkit import (
    BOTH_BACKENDS,
    FakeClock,
    compensated_run,
    compensation_failed_run,
    completed_run,
    export_http,
    open_run,
    settings_for,
)

from saga_otel import semconv as sc
from sidecar import Sidecar, _server
from sidecar._backends import open_store
from sidecar._otlp import extract
from sidecar._storage import PutAway


async def _get(sidecar: Sidecar, path: str, **headers: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{sidecar.api_port}{path}", headers=headers) as resp,
    ):
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def _answers(sidecar: Sidecar, run_ids: list[str]) -> dict[str, Any]:
    """Everything the API says about these runs, listing pages included."""
    out: dict[str, Any] = {}
    for run_id in run_ids:
        out[f"view {run_id}"] = await _get(sidecar, f"/runs/{run_id}")
        out[f"stack {run_id}"] = await _get(sidecar, f"/runs/{run_id}/stack")
    out["list"] = await _get(sidecar, "/runs")
    for query in ("status=completed", "saga=refund", "needs=person", f"id_prefix={run_ids[0][:6]}"):
        out[query] = await _get(sidecar, f"/runs?{query}")
    pages, cursor = [], ""
    while True:  # one run a page: the cursor walks memory and store alike
        status, body = await _get(sidecar, f"/runs?limit=1{cursor}")
        assert status == 200
        pages.append(body["runs"])
        if body["next_cursor"] is None:
            break
        cursor = f"&cursor={body['next_cursor']}"
    out["pages"] = pages
    return out


def _runs(t0: float) -> list[Any]:
    return [
        completed_run(t0=t0),
        compensated_run(t0=t0 + 1),
        compensation_failed_run(t0=t0 + 2),
        open_run(t0=t0 + 3),
        completed_run(t0=t0 + 3),  # same start as the open one: ties by run id
    ]


@BOTH_BACKENDS
async def test_finished_runs_leave_memory_and_answer_the_same(
    tmp_path: Path, clock: FakeClock
) -> None:
    runs = _runs(clock.now - 50)
    ids = [r.run_id for r in runs]
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        await export_http(sc_, [s for r in runs for s in r.spans()])
        before = await _answers(sc_, ids)
        assert len(before["pages"]) == len(runs)
        gone = await sc_.evict_async()
        # Finished runs go; the open one and the one that needs a person stay.
        assert sorted(gone) == sorted([ids[0], ids[1], ids[4]])
        assert sorted(sc_.state.run_ids()) == sorted([ids[2], ids[3]])
        assert await _answers(sc_, ids) == before
        status, page = await _get(sc_, f"/runs/{ids[1]}", Accept="text/html")
        assert status == 200 and ids[1] in page
    # A restart folds only what is in memory's share; the rest is still served.
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        assert sorted(sc_.state.run_ids()) == sorted([ids[2], ids[3]])
        assert await _answers(sc_, ids) == before


@BOTH_BACKENDS
async def test_a_late_span_reopens_a_run_put_away(tmp_path: Path, clock: FakeClock) -> None:
    """The last span of a run arrives after the rest was put away: the run comes back
    whole, its view equals a sidecar's that saw every span at once."""
    run = compensated_run(t0=clock.now - 50)
    spans = run.spans()
    last = next(s for s in spans if (s.attributes or {}).get(sc.SAGA_PHASE) == sc.PHASE_RUN)
    first = [s for s in spans if s is not last]
    async with Sidecar(settings_for(tmp_path / "whole"), clock=clock) as ref:
        await export_http(ref, spans)
        _, want = await _get(ref, f"/runs/{run.run_id}")
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        # Without its run span the run is open: put away only once it ends.
        await export_http(sc_, first)
        assert await sc_.evict_async() == []
        await export_http(sc_, [last])
        assert await sc_.evict_async() == [run.run_id]
        assert run.run_id not in sc_.state
        # The whole run again (a resend), once put away: taken as a resend, not a stranger.
        await export_http(sc_, spans)
        _, got = await _get(sc_, f"/runs/{run.run_id}")
        assert got == want
        assert got["status"] == sc.STATUS_COMPENSATED
        assert await sc_.evict_async() == [run.run_id]
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        assert run.run_id not in sc_.state
        _, got = await _get(sc_, f"/runs/{run.run_id}")
        assert got == want


@BOTH_BACKENDS
async def test_resolve_and_prune_reach_runs_put_away(tmp_path: Path, clock: FakeClock) -> None:
    run = completed_run(t0=clock.now - 50)
    async with Sidecar(settings_for(tmp_path, retention=3600.0), clock=clock) as sc_:
        await export_http(sc_, run.spans())
        assert await sc_.evict_async() == [run.run_id]
        view = await sc_.resolve(run.run_id, "checked by hand", by="dana")
        assert view is not None and view["resolution"] is not None
        assert await sc_.evict_async() == [run.run_id]
        _, got = await _get(sc_, f"/runs/{run.run_id}")  # folded back from the store
        assert got["resolution"]["note"] == "checked by hand"
        assert got["resolution"]["by"] == "dana"
        clock.now += 1800
        sc_.prune()
        await sc_.flush()
        assert (await _get(sc_, f"/runs/{run.run_id}"))[0] == 200
        clock.now += 3600
        sc_.prune()
        await sc_.flush()
        status, body = await _get(sc_, f"/runs/{run.run_id}")
        assert status == 404, body
        assert (await _get(sc_, "/runs"))[1]["runs"] == []


@BOTH_BACKENDS
async def test_a_run_reopened_by_a_late_span_is_folded_at_the_next_start(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A late span brings a run put away back into memory; if the sidecar stops before
    putting it away again, the next start folds it with the late span (what a start
    folds is read through the owners' put-away flag: a reopen clears it)."""
    run = completed_run(t0=clock.now - 50)
    spans = run.spans()
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        await export_http(sc_, spans)
        assert await sc_.evict_async() == [run.run_id]
        run.escalate(sc.ESCALATION_COMPENSATION_FAILED, {"not_undone": ["a late card"]})
        late = [s for s in run.spans() if s not in spans]
        await export_http(sc_, late)
        assert run.run_id in sc_.state
        _, want = await _get(sc_, f"/runs/{run.run_id}")
        assert want["escalation"] is not None, want
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        assert run.run_id in sc_.state  # folded at start, not left to a later lookup
        _, got = await _get(sc_, f"/runs/{run.run_id}")
        assert got == want


class _Turns:
    """Counts the event loop's turns while in its ``async with`` (a task that yields
    every turn): a batch that sees the count grow since the last one let others run."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _spin(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> _Turns:
        self._task = asyncio.create_task(self._spin())
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


@BOTH_BACKENDS
async def test_the_evict_loop_puts_runs_away_a_batch_at_a_time(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a saturated intake ~40,000 runs settle in an evict interval; put away in
    one pass on SQLite they held the loop ~0.8 s. In batches, the loop runs between."""
    monkeypatch.setattr(_server, "EVICT_BATCH", 2)
    runs = [completed_run(t0=clock.now - 50 + i) for i in range(5)]
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        for run in runs:
            await export_http(sc_, run.spans())
        store = sc_.store
        assert store is not None
        turns = _Turns()
        seen: list[tuple[int, list[str]]] = []  # (loop turns so far, runs) per batch
        put_away = store.put_away

        def batch(rows: list[PutAway]) -> None:
            seen.append((turns.count, [r.run_id for r in rows]))
            put_away(rows)

        monkeypatch.setattr(store, "put_away", batch)
        async with turns:
            gone = await sc_.evict_async()
        ids = [r.run_id for r in runs]
        assert sorted(gone) == sorted(ids) and not any(r in sc_.state for r in ids)
        assert [len(run_ids) for _, run_ids in seen] == [2, 2, 1]
        assert seen[0][0] < seen[1][0] < seen[2][0]  # other tasks ran between batches
        assert store.put_away_of(ids) == set(ids)


@BOTH_BACKENDS
async def test_the_prune_loop_deletes_runs_put_away_a_batch_at_a_time(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the retention every run put away goes, oldest first, a bounded transaction
    at a time with the loop free between them: on SQLite the store runs on the loop,
    and one transaction of 60,000 runs held every request and tick for ~3 s."""
    monkeypatch.setattr(_server, "PRUNE_BATCH", 3)
    runs = [completed_run(t0=clock.now - 50 + i) for i in range(8)]
    async with Sidecar(settings_for(tmp_path, retention=3600.0), clock=clock) as sc_:
        start = clock.now
        for i, run in enumerate(runs):
            clock.now = start + i + (2000.0 if i >= 6 else 0.0)  # the last two: later
            await export_http(sc_, run.spans())
            assert await sc_.evict_async() == [run.run_id]
        store = sc_.store
        assert store is not None
        turns = _Turns()
        seen: list[tuple[int, list[str]]] = []  # (loop turns so far, runs left) per batch
        prune = store.prune_put_away

        def batch(before: float, limit: int) -> int:
            seen.append((turns.count, sorted(store.put_away_of([r.run_id for r in runs]))))
            return prune(before, limit)

        monkeypatch.setattr(store, "prune_put_away", batch)
        clock.now = start + 3600.0 + 100.0  # the first six are past the retention
        async with turns:
            assert await sc_.prune_async() == ([], 6)
        ids = [r.run_id for r in runs]
        assert [left for _, left in seen] == [sorted(ids), sorted(ids[3:]), sorted(ids[6:])]
        assert seen[0][0] < seen[1][0] < seen[2][0]  # other tasks ran between batches
        for run in runs:
            status, _ = await _get(sc_, f"/runs/{run.run_id}")
            assert status == (404 if run in runs[:6] else 200)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
async def test_replicas_put_away_and_reopen_through_each_other(
    tmp_path: Path, clock: FakeClock, backend: str
) -> None:
    """A run put away by both replicas gets its last span at one of them: the other folds
    it in on its next sync onto the whole run (not onto an empty one), and both agree."""
    assert backend == "postgresql"
    run = compensated_run(t0=clock.now - 50)
    spans = run.spans()
    settings = settings_for(tmp_path, tick_interval=3600.0)  # syncs only when told
    async with Sidecar(settings, clock=clock) as a, Sidecar(settings, clock=clock) as b:
        await export_http(a, spans)
        await b.sync()
        assert run.run_id in b.state
        assert await a.evict_async() == [run.run_id]
        assert await b.evict_async() == [run.run_id]
        # A late span of the run (the agent's escalation, after its end) reaches B.
        run.escalate(sc.ESCALATION_COMPENSATION_FAILED, {"not_undone": ["a late card"]})
        late = [s for s in run.spans() if s not in spans]
        assert len(late) == 1
        await export_http(b, late)
        assert run.run_id in b.state
        await a.sync()  # A sees a span of a run it put away: it reopens it from the store
        assert run.run_id in a.state
        views = [r.state.view(run.run_id) for r in (a, b)]
        assert views[0] == views[1]
        assert views[0] is not None and views[0]["status"] == sc.STATUS_COMPENSATED
        assert len(views[0]["steps"]) == 4 and views[0]["escalation"] is not None
        assert await a.evict_async() == [run.run_id]
        got = (await a.lookup(run.run_id)).view(run.run_id)
        assert got == views[0]


@BOTH_BACKENDS
async def test_a_run_put_away_while_its_late_span_waits_for_a_commit_comes_back_whole(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Eviction is not held off by a group waiting for its commit (under steady intake
    some group is waiting at about a third of moments, and a held-off tick kept finished
    runs in memory an interval longer). The waiting group's late span of the run put
    away meanwhile brings it back whole: its view equals a sidecar's that saw every span
    at once."""
    run = compensated_run(t0=clock.now - 50)
    spans = run.spans()
    late = next(s for s in spans if (s.attributes or {}).get(sc.SAGA_PHASE) == sc.PHASE_COMPENSATE)
    early = [s for s in spans if s is not late]
    async with Sidecar(settings_for(tmp_path / "whole"), clock=clock) as ref:
        await export_http(ref, spans)
        _, want = await _get(ref, f"/runs/{run.run_id}")
    async with Sidecar(settings_for(tmp_path), clock=clock) as sc_:
        await export_http(sc_, early)  # the run has ended: settled, ready to put away
        body = encode_spans([late]).SerializeToString()
        decoded = extract(ExportTraceServiceRequest.FromString(body), body)
        waiting = asyncio.ensure_future(sc_.ingest(decoded, "http"))
        await asyncio.sleep(0)  # it has joined a group; the commit has not run
        assert sc_._groups  # a group waits for its commit
        assert await sc_.evict_async() == [run.run_id]  # not held off by it
        assert run.run_id not in sc_.state
        assert (await waiting).rejected == 0
        _, got = await _get(sc_, f"/runs/{run.run_id}")
        assert got == want


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_replicas_pruning_at_once_share_the_runs_and_delete_each_once(
    tmp_path: Path, backend: str
) -> None:
    """Two replicas' prune loops at the same moment share the runs: no error, no
    deadlock, no run deleted twice (the counts add up) and none left behind."""
    assert backend == "postgresql"
    database = settings_for(tmp_path).database
    first, second = open_store(database), open_store(database)
    try:
        ids = [f"run-{i:03d}" for i in range(60)]
        first.put_away(
            [PutAway(r, 1.0, "completed", "refund", 10.0 + i) for i, r in enumerate(ids)]
        )
        counts: dict[int, list[int]] = {0: [], 1: []}
        start = threading.Barrier(2)

        def prune(which: int, store: Any) -> None:
            start.wait(10)
            while True:
                n = store.prune_put_away(1000.0, 7)
                counts[which].append(n)
                if n < 7:
                    return

        threads = [
            threading.Thread(target=prune, args=(i, s)) for i, s in enumerate((first, second))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert sum(counts[0]) + sum(counts[1]) == len(ids)  # each run deleted once
        assert first.put_away_of(ids) == set() == second.put_away_of(ids)
    finally:
        first.close()
        second.close()
