"""The SQLite store's upkeep at scale: starting over a big index, pruning a big backlog.

A week at 100 runs/s puts 60M runs away. Two things must not grow with that:

- the time `saga-sidecar serve` takes to listen: the put-away filter is built on a
  thread of the store, not before the ports open (reference: the same start on an
  empty file);
- how long retention's prune holds the event loop (on SQLite the store runs on it):
  the runs put away go a batch a transaction, the loop free between batches
  (reference: the same runs deleted in one transaction, as before, which held the
  loop for all of it).

Trials of subject and reference alternate, each on a fresh copy of one file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench._figures import Figure
from bench.bench_sidecar import _start_sidecar, _stop

PUT_AWAY = 1_000_000  # runs put away for the start trials, 2 spans of 200 bytes each
PRUNED = 20_000  # runs past the retention for the prune trials
SPANS = 10  # stored spans per pruned run
SPAN_BYTES = 400  # about a do span with its compensation, encoded
TRIALS = 3
GOAL_START = 1.5  # listening with a million runs put away vs an empty file
GOAL_STALL_MS = 50.0  # the longest the loop waits while a backlog is pruned


def _template(path: Path, runs: int, spans: int, age: float, span_bytes: int) -> None:
    """A sidecar file (the store's own schema) with ``runs`` finished runs put away,
    the oldest last seen ``age`` seconds ago, the newest ``age / 2``, each with ``spans``
    spans."""
    from sidecar._store import SqliteStore

    SqliteStore(path).close()
    db = sqlite3.connect(path, isolation_level=None)
    now = time.time() - age
    step = min(1.0, age / 2 / max(runs, 1))
    try:
        db.execute("BEGIN")
        db.executemany(
            "INSERT INTO run_index(run_id, started_at, status, saga, last_seen) "
            "VALUES (?, ?, 'completed', 'refund', ?)",
            ((f"{i:032x}", now + i * step - 5, now + i * step) for i in range(runs)),
        )
        data = os.urandom(span_bytes)
        db.executemany(
            "INSERT INTO spans(run_id, span_id, received_at, service, instance, data) "
            "VALUES (?, ?, ?, 'bench', 'bench-1', ?)",
            (
                (f"{i:032x}", f"{j:016x}", now + i * step, data)
                for i in range(runs)
                for j in range(spans)
            ),
        )
        db.executemany(
            "INSERT INTO run_owners(run_id, trace_id, instance, service, put_away) "
            "VALUES (?, ?, 'bench-1', 'bench', 1)",
            ((f"{i:032x}", f"{i:032x}") for i in range(runs)),
        )
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()


def _copy(template: Path, into: Path) -> Path:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{into}{suffix}").unlink(missing_ok=True)
    shutil.copyfile(template, into)
    return into


def _listening_after(db: Path) -> float:
    """Seconds from spawning `saga-sidecar serve` on ``db`` to its listening line."""
    t0 = time.perf_counter()
    proc, _port = _start_sidecar(db)
    took = time.perf_counter() - t0
    _stop(proc)
    return took


async def _prune_stalls(db: Path, batched: bool) -> tuple[float, float, int]:
    """(longest loop stall, whole prune) in seconds and runs deleted: a Sidecar over
    ``db`` (no sockets) pruning everything past its retention, while a task notes how
    long each of its loop turns waited."""
    from sidecar import Settings, Sidecar
    from sidecar._backends import open_store
    from sidecar._store import SqliteStore

    settings = Settings(db_path=db, retention=3600.0)
    sidecar = Sidecar(settings)
    store = sidecar.store = open_store(settings.database)
    assert isinstance(store, SqliteStore)
    # serve prunes a minute after its start: its filter is built by then
    await asyncio.to_thread(store._away_done.wait, 120)
    longest = 0.0

    async def watch() -> None:
        nonlocal longest
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    try:
        if batched:
            _, deleted = await sidecar.prune_async()
        else:  # as before: every run past the retention in one transaction
            deleted = store.prune_put_away(time.time() - settings.retention, limit=PRUNED + 1)
            await asyncio.sleep(0)
    finally:
        took = time.perf_counter() - t0
        watcher.cancel()
        store.close()
    return longest, took, deleted


def run(progress: Callable[[str], None]) -> list[Figure]:
    with tempfile.TemporaryDirectory() as tmp:
        big, empty = Path(tmp) / "big.db", Path(tmp) / "empty.db"
        progress(f"start: a file with {PUT_AWAY:,} runs put away, 2 spans each")
        _template(big, PUT_AWAY, 2, 86_400.0, 200)
        _template(empty, 0, 0, 86_400.0, 200)
        starts: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(TRIALS):
            for full in (False, True):
                starts[full].append(
                    _listening_after(_copy(big if full else empty, Path(tmp) / "t.db"))
                )
        progress(
            "start: listening after "
            + ", ".join(
                f"{a:.2f} / {b:.2f} s" for a, b in zip(starts[True], starts[False], strict=True)
            )
            + " (a million put away / empty)"
        )
        big.unlink()

        backlog = Path(tmp) / "backlog.db"
        progress(f"prune: a file with {PRUNED:,} runs of {SPANS} spans past the retention")
        _template(backlog, PRUNED, SPANS, 10_800.0, SPAN_BYTES)  # all past a 1 h retention
        stalls: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
        for _ in range(TRIALS):
            for batched in (False, True):
                db = _copy(backlog, Path(tmp) / "p.db")
                stalls[batched].append(asyncio.run(_prune_stalls(db, batched)))
        for got in stalls.values():
            if any(deleted != PRUNED for _, _, deleted in got):
                raise RuntimeError(f"a prune deleted {[d for _, _, d in got]}, not {PRUNED}")
        progress(
            "prune: longest stall "
            + ", ".join(
                f"{a[0] * 1e3:.1f} / {b[0] * 1e3:.0f} ms"
                for a, b in zip(stalls[True], stalls[False], strict=True)
            )
            + " (batched / one transaction)"
        )

    full, bare = statistics.median(starts[True]), statistics.median(starts[False])
    start_ratios = sorted(a / b for a, b in zip(starts[True], starts[False], strict=True))
    stall = statistics.median(s for s, _, _ in stalls[True])
    whole = statistics.median(s for s, _, _ in stalls[False])
    took = statistics.median(t for _, t, _ in stalls[True])
    took_once = statistics.median(t for _, t, _ in stalls[False])
    return [
        Figure(
            area="sidecar",
            name=f"`saga-sidecar serve` listening, {PUT_AWAY:,} runs put away (SQLite)",
            value=full,
            unit="s",
            reference_name="the same start on an empty file",
            reference_value=bare,
            ratio=full / bare,
            goal=f"<= {GOAL_START}",
            met=full / bare <= GOAL_START,
            notes=(
                f"from spawn to the sidecar.listening line; {TRIALS} alternating trials, "
                "each on a fresh copy of the file, the medians; ratio per trial min/median/"
                f"max {start_ratios[0]:.2f} / {statistics.median(start_ratios):.2f} / "
                f"{start_ratios[-1]:.2f}. The put-away filter (a Bloom filter of the index, "
                "about a second per million runs to read) is built on a thread of the "
                "store after the ports open; until it is ready each new run is looked "
                "up in the index. And a start reads the runs it holds through the "
                "owners' put-away flag and its partial index (schema 5), not a NOT EXISTS "
                "against the index over every stored span and owner. Before both (commit "
                "1f9a724, schema 4, the same file's shape, 3 alternating trials): "
                "4.89 / 4.40 / 4.36 s against 1.02 / 0.84 / 0.66 s empty, linear in the "
                "runs kept (a week at 100 runs/s: minutes)"
            ),
        ),
        Figure(
            area="sidecar",
            name=(
                f"longest event-loop stall while {PRUNED:,} runs put away are pruned "
                f"({SPANS} spans each, SQLite)"
            ),
            value=stall * 1e3,
            unit="ms",
            reference_name="the same runs deleted in one transaction (the loop held throughout)",
            reference_value=whole * 1e3,
            ratio=stall / whole,
            goal=f"stall <= {GOAL_STALL_MS:.0f} ms",
            met=stall * 1e3 <= GOAL_STALL_MS,
            notes=(
                f"{TRIALS} alternating trials, each on a fresh copy of the file, the "
                "medians; the stall is the longest wait of a task that yields every loop "
                "turn while Sidecar.prune_async runs (the background loop's prune: "
                "batches of sidecar._storage.PRUNE_BATCH runs, a loop turn between "
                f"them). The whole prune took {took:.2f} s batched and {took_once:.2f} s "
                "in one transaction: the same work, spread out. On SQLite the store runs "
                "on the event loop, so before the batches every request, ack and orphan "
                "tick waited for the whole prune (a day of backlog at 100 runs/s: "
                "minutes)"
            ),
        ),
    ]
