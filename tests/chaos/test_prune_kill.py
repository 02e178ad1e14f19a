"""kill -9 of a sidecar while retention's prune works through a backlog.

The prune deletes the runs put away past the retention a batch a transaction
(``PRUNE_BATCH``), every table of a run in the batch's transaction: its spans, owner,
marks, lease, index row and its alert rows once nothing is left to do for them. A kill
at any moment must leave each run whole or gone, never part of it: a run with its
index row and no spans would be listed with an empty stack, one with spans and no
index row would be folded back into memory by the next start. Runs within the
retention and alerts still waiting for a sink are never touched; the next sidecar
finishes the prune.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import sql_on

from sidecar._backends import open_store
from sidecar._storage import parse_db

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

DRIVER = Path(__file__).with_name("prune_sidecar.py")
OLD = 8_000  # runs put away two hours ago: past the retention
KEPT = 300  # runs put away a minute ago: within it
SPANS = 4  # spans per run
RETENTION = 3600.0
KILLS = 8
WAITING = set(range(0, OLD, 997))  # old runs with an alert still waiting for its sink
# Old runs whose alerts were delivered and resolved.
SETTLED = [i for i in range(1, OLD, 13) if i not in WAITING]
MARKED = range(2, OLD, 7)  # old runs with a mark and a lease


def _rid(old: bool, i: int) -> str:
    return f"{'0' if old else 'f'}{i:031x}"


def _fill(db: str) -> None:
    """The store's own schema, with OLD runs put away past the retention and KEPT within."""
    open_store(parse_db(db)).close()
    now = time.time()
    runs = [(True, i, now - 2 * RETENTION + i * 0.01) for i in range(OLD)]
    runs += [(False, i, now - 60) for i in range(KEPT)]
    data = bytes(range(256)) * 2
    with sql_on(db) as run:
        run("BEGIN")
        run(
            "INSERT INTO run_index(run_id, started_at, status, saga, last_seen) "
            "VALUES (?, ?, 'completed', 'refund', ?)",
            [(_rid(o, i), seen - 5, seen) for o, i, seen in runs],
        )
        run(
            "INSERT INTO spans(run_id, span_id, received_at, service, instance, data) "
            "VALUES (?, ?, ?, 'svc', 'svc-1', ?)",
            [(_rid(o, i), f"{j:016x}", seen, data) for o, i, seen in runs for j in range(SPANS)],
        )
        run(
            "INSERT INTO run_owners(run_id, trace_id, instance, service, put_away) "
            "VALUES (?, ?, 'svc-1', 'svc', 1)",
            [(_rid(o, i), _rid(o, i)) for o, i, _ in runs],
        )
        marked = [(_rid(True, i),) for i in MARKED] + [(_rid(False, i),) for i in range(KEPT)]
        run("INSERT INTO run_marks(run_id, orphaned_at) VALUES (?, 1.0)", marked)
        run(
            "INSERT INTO run_leases(run_id, holder, token, granted_at, expires_at, released) "
            "VALUES (?, 'vm:1', 1, 1.0, 2.0, ?)",
            [(r, True) for (r,) in marked],
        )
        alerts: list[tuple[Any, ...]] = []
        for i in SETTLED:
            rid = _rid(True, i)
            key = f"SagaCompensationStarted:{rid}"
            alerts += [
                (key, "fire", rid, "delivered", 5.0),
                (key, "resolve", rid, "delivered", None),
            ]
        for i in WAITING:
            rid = _rid(True, i)
            alerts.append((f"SagaRunOrphaned:{rid}", "fire", rid, "pending", None))
        run(
            "INSERT INTO alert_outbox(dedup_key, action, sink, alertname, run_id, event, "
            "state, created_at, resolved_at) VALUES (?, ?, 'webhook', 'A', ?, '{}', ?, 1.0, ?)",
            alerts,
        )
        run("COMMIT")


def _check(db: str) -> int:
    """Every run is whole or gone, the kept ones whole, waiting alerts kept: the number
    of old runs left."""
    with sql_on(db) as run:
        index = {r for (r,) in run("SELECT run_id FROM run_index")}
        spans = dict(run("SELECT run_id, count(*) FROM spans GROUP BY run_id"))
        owners = {r for (r,) in run("SELECT run_id FROM run_owners WHERE put_away = 1")}
        marks = {r for (r,) in run("SELECT run_id FROM run_marks")}
        leases = {r for (r,) in run("SELECT run_id FROM run_leases")}
        outbox = dict(run("SELECT run_id, count(*) FROM alert_outbox GROUP BY run_id"))
        if "://" not in db:
            assert run("PRAGMA integrity_check") == [("ok",)]
    kept = {_rid(False, i) for i in range(KEPT)}
    assert kept <= index, f"{len(kept - index)} runs within the retention were pruned"
    assert all(spans.get(r) == SPANS for r in kept)
    assert kept <= owners and kept <= marks and kept <= leases
    # Whole or gone: each table holds a run exactly when the index does.
    assert set(spans) == index, f"spans without index {sorted(set(spans) - index)[:3]}, " + (
        f"index without spans {sorted(index - set(spans))[:3]}"
    )
    assert all(n == SPANS for n in spans.values()), "a run lost some of its spans"
    assert owners == index
    marked = {_rid(True, i) for i in MARKED} | kept
    assert marks == leases == marked & index
    for i in SETTLED:
        rid = _rid(True, i)
        assert outbox.get(rid) == (2 if rid in index else None), rid
    for i in WAITING:  # an alert still waiting for its sink outlives its run
        assert outbox.get(_rid(True, i)) == 1
    return len(index - kept)


def _old_left(db: str) -> int:
    with sql_on(db) as run:
        ((n,),) = run("SELECT count(*) FROM run_index WHERE run_id < 'f'")
    return int(n)


def _start(db: str, log: Path) -> subprocess.Popen[str]:
    with log.open("a") as err:
        proc = subprocess.Popen(
            [sys.executable, str(DRIVER), db, str(RETENTION)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert proc.stdout is not None
    for line in proc.stdout:
        if json.loads(line).get("event") == "ready":
            return proc
    proc.wait()
    raise AssertionError(f"the sidecar did not start: {log.read_text()[-2000:]}")


def test_a_sidecar_killed_while_pruning_leaves_every_run_whole_or_gone(
    tmp_path: Path, db_backend: str | None, chaos_results: dict[str, Any]
) -> None:
    db = db_backend or str(tmp_path / "sidecar.db")
    log = tmp_path / "sidecar.log"
    _fill(db)
    assert _check(db) == OLD
    left = [OLD]
    for _ in range(KILLS):
        proc = _start(db, log)
        # A random moment inside the prune (it starts 10 ms after the start): once it
        # has deleted a random share of what is left, then a little later, mostly inside
        # the next batch's transaction.
        target = int(left[-1] * random.uniform(0.1, 0.9))
        deadline = time.monotonic() + 60
        while _old_left(db) > target and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(random.uniform(0.0, 0.02))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left.append(_check(db))
        assert left[-1] <= left[-2], f"pruned runs came back: {left}"
        if left[-1] == 0:
            break
    assert any(0 < n < OLD for n in left), f"no kill landed inside the prune: {left}"
    # The next sidecar finishes the prune.
    proc = _start(db, log)
    try:
        deadline = time.monotonic() + 120
        while _check(db) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert _check(db) == 0, f"the prune never finished: {left}"
    assert proc.returncode == 0, log.read_text()[-2000:]
    chaos_results["prune_kill" if db_backend is None else "prune_kill_postgresql"] = {
        "runs_past_retention": OLD,
        "runs_kept": KEPT,
        "kills": len(left) - 1,
        "left_after_each_kill": left[1:],
        "partial_runs": 0,
    }
