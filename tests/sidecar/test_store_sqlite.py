"""SQLite-only properties of sidecar/_store.py (the WAL and its checkpoints)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from test_outbox import unwinding, view

from sidecar._alerting import evaluate
from sidecar._outbox import Outbox
from sidecar._store import BACKSTOP_PAGES


def test_an_alert_commit_never_checkpoints_the_wal_itself(tmp_path: Path) -> None:
    """The store's thread checkpoints (CHECKPOINT_INTERVAL); a COMMIT on the way of an
    alert must not copy a busy WAL into the database file itself, as SQLite's default
    (1,000 pages) made every alert's COMMIT do under load (6-30 ms each)."""
    path = tmp_path / "sidecar.db"
    box = Outbox(path, [])
    intake = sqlite3.connect(path, isolation_level=None)
    intake.execute("PRAGMA wal_autocheckpoint = 0")  # the store's thread is not running here
    intake.execute("CREATE TABLE filler(x BLOB)")
    intake.execute("BEGIN")
    intake.executemany("INSERT INTO filler VALUES (?)", [(os.urandom(3000),)] * 1500)
    intake.execute("COMMIT")  # ~1,500 pages in the WAL: past SQLite's default, not ours
    assert BACKSTOP_PAGES > 1500
    size = path.stat().st_size
    try:
        assert box.add(evaluate(view("r1"), unwinding("r1"), now=2.0)) == 1
        assert path.stat().st_size == size  # nothing was copied into the database file
    finally:
        intake.close()
        box.close()
