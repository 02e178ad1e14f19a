"""kill -9 of `saga-sidecar serve` while it upgrades a big version-4 database.

The upgrade's step to version 5 flags every put-away run's owner row (one UPDATE over
all of them, ~1.6 s a million runs on SQLite) and builds an index, inside the one
transaction that runs every later step too and writes the new version. A sidecar
killed in the middle (a deploy, an orchestrator's liveness probe) must leave the
database at version 4 as it was, or wholly upgraded, never upgraded with flags missing
(the start would fold those runs back into memory) or a version 4 with the column half
there (the next upgrade would fail); the next start finishes the upgrade.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import sql_on

from sidecar._pgstore import _STEPS as PG_STEPS
from sidecar._storage import SCHEMA_VERSION
from sidecar._store import _STEPS as SQLITE_STEPS
from sidecar._store import _statements

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

RUNS = 150_000  # owner rows; every 20th run is open (no index row), every 20th reopened
KILLS = 5
LOCKED = ("database is locked", "could not obtain lock")


def _status(i: int) -> str | None:
    return None if i % 20 == 1 else "completed"


def _make_v4(db: str) -> None:
    steps = PG_STEPS if "://" in db else SQLITE_STEPS
    with sql_on(db) as run:
        run("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        for version in (1, 2, 3, 4):
            for statement in _statements(steps[version]):
                run(statement)
        run("INSERT INTO meta(key, value) VALUES ('schema', '4')")
        run("BEGIN")
        run(
            "INSERT INTO run_owners(run_id, trace_id, instance, service) "
            "VALUES (?, ?, 'svc-1', 'svc')",
            [(f"{i:032x}", f"{i:032x}") for i in range(RUNS)],
        )
        run(
            "INSERT INTO run_index(run_id, started_at, status, saga, last_seen) "
            "VALUES (?, 1.0, ?, 'refund', 2.0)",
            [(f"{i:032x}", _status(i)) for i in range(RUNS) if i % 20],
        )
        run("COMMIT")


def _version(db: str) -> int:
    """The version, after checking the database is exactly that version's whole."""
    with sql_on(db) as run:
        ((version,),) = run("SELECT value FROM meta WHERE key = 'schema'")
        if "://" in db:
            columns = {
                c
                for (c,) in run(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = 'run_owners'"
                )
            }
        else:
            assert run("PRAGMA integrity_check") == [("ok",)]
            columns = {row[1] for row in run("PRAGMA table_info(run_owners)")}
        if int(version) == 4:
            assert "put_away" not in columns, "version 4 with the version-5 column"
            return 4
        assert int(version) == SCHEMA_VERSION, version
        flagged = {r for (r,) in run("SELECT run_id FROM run_owners WHERE put_away = 1")}
        expected = {f"{i:032x}" for i in range(RUNS) if i % 20 and _status(i) is not None}
        assert flagged == expected, f"{len(expected - flagged)} put-away runs not flagged"
        ((n,),) = run("SELECT count(*) FROM run_owners")
        assert n == RUNS
    return SCHEMA_VERSION


def _upgrading(db: str) -> bool:
    """Whether the upgrade is under way: a writer holds the file (SQLite), a statement
    on the owners' table runs (PostgreSQL)."""
    with sql_on(db) as run:
        if "://" in db:  # the upgrade's statements on its table, running now
            ((busy,),) = run(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state = 'active' AND query LIKE '%run_owners%' "
                "AND pid <> pg_backend_pid()"
            )
            return bool(busy)
        try:
            run("PRAGMA busy_timeout = 0")
            run("BEGIN IMMEDIATE")
            run("ROLLBACK")
        except Exception as exc:  # sqlite3.OperationalError: locked
            if any(text in str(exc) for text in LOCKED):
                return True
            raise
        return False


def _serve(db: str, log: Path) -> subprocess.Popen[str]:
    with log.open("a") as err:
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "saga-sidecar"), "serve",
             "--otlp-http-port", "0", "--otlp-grpc-port", "0", "--api-port", "0",
             "--db", db, "--no-alert-log"],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip


def test_a_sidecar_killed_while_upgrading_leaves_version_4_or_a_whole_upgrade(
    tmp_path: Path, db_backend: str | None, chaos_results: dict[str, Any]
) -> None:
    db = db_backend or str(tmp_path / "sidecar.db")
    log = tmp_path / "sidecar.log"
    _make_v4(db)
    assert _version(db) == 4
    seen: list[int] = []
    for _ in range(KILLS):
        proc = _serve(db, log)
        # Kill once the upgrade's transaction holds the database (a random moment of it).
        deadline = time.monotonic() + 60
        while not _upgrading(db) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(random.uniform(0.0, 0.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        seen.append(_version(db))
        if seen[-1] == SCHEMA_VERSION:
            break
    assert 4 in seen, f"no kill landed inside the upgrade: {seen}"
    proc = _serve(db, log)
    try:
        assert proc.stdout is not None
        assert '"sidecar.listening"' in proc.stdout.readline(), log.read_text()[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert _version(db) == SCHEMA_VERSION
    chaos_results["upgrade_kill" if db_backend is None else "upgrade_kill_postgresql"] = {
        "owner_rows": RUNS,
        "kills": len(seen),
        "version_after_each_kill": seen,
        "half_upgraded": 0,
    }
