"""SQLite persistence: the raw saga spans of every run, orphan marks, resolutions, heartbeats.

The in-memory state is rebuilt from here on start, so the store keeps the
spans themselves (the state machine is a function of them) rather than views.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._errors import StoreError

SCHEMA_VERSION = 1

log = logging.getLogger("sidecar")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS spans (
    run_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    received_at REAL NOT NULL,
    service TEXT NOT NULL,
    instance TEXT NOT NULL,
    data BLOB NOT NULL,  -- the protobuf Span, exactly as received
    PRIMARY KEY (run_id, span_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS run_marks (
    run_id TEXT PRIMARY KEY,
    orphaned_at REAL,
    resolution_note TEXT,
    resolution_at REAL
);
CREATE TABLE IF NOT EXISTS instances (
    instance TEXT PRIMARY KEY,
    last_heartbeat REAL NOT NULL,
    interval_s REAL NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class StoredSpan:
    run_id: str
    span_id: str
    service: str
    instance: str
    data: bytes


@dataclass(frozen=True, slots=True)
class RunMark:
    run_id: str
    orphaned_at: float | None
    resolution_note: str | None
    resolution_at: float | None


def prepare_db_file(path: Path, *, warn: bool = True) -> None:
    """Create ``path``'s missing folders 0700 and the file 0600, whatever the umask.

    The database holds tool arguments, which may name customers or hold secrets.
    An existing folder open to group or others is left alone (an operator chose
    it) but, with ``warn``, logged at start so the choice is visible.
    """
    folder = path.parent
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for created in reversed(missing):
        created.mkdir(mode=0o700, exist_ok=True)
        os.chmod(created, 0o700)  # mkdir's mode passes through the umask
    mode = stat.S_IMODE(path.parent.stat().st_mode)
    if warn and not missing and mode & 0o077:
        log.warning(
            "the database folder %s has mode %s: other users may read the stored tool "
            "arguments; run `chmod 700 %s` or pick another --db folder",
            path.parent,
            oct(mode),
            path.parent,
        )
    # Create the file 0600 before SQLite does (it would use the umask's mode).
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    for suffix in ("", "-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        if side.exists():
            os.chmod(side, 0o600)


class Store:
    """One connection, used from the event loop thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            prepare_db_file(path)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            # WAL + synchronous=NORMAL: a committed transaction is in the WAL file (written
            # with write(2)) before COMMIT returns, so it survives kill -9 of this process;
            # only an OS crash or power loss can lose the last commits (FULL would fsync).
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
            # Another component (the alert outbox) may have created the file first with
            # the umask's mode: tighten it and WAL's side files either way.
            for suffix in ("", "-wal", "-shm"):
                side = Path(f"{path}{suffix}")
                if side.exists():
                    os.chmod(side, 0o600)
            self._db.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema', ?)",
                (str(SCHEMA_VERSION),),
            )
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(
                f"cannot open the sidecar database {str(path)!r}: {exc}; pass a writable "
                "path with --db (SAGA_SIDECAR_DB)"
            ) from exc

    def close(self) -> None:
        self._db.close()

    def write(
        self,
        spans: Sequence[tuple[str, str, float, str, str, bytes]],
        heartbeats: Sequence[tuple[str, float, float]] = (),
    ) -> None:
        """Store one request's spans and heartbeats in one transaction (dupes ignored)."""
        db = self._db
        try:
            db.execute("BEGIN")
            if spans:  # a statement per empty list is measurable in the durable path
                db.executemany(
                    "INSERT OR IGNORE INTO spans(run_id, span_id, received_at, service, "
                    "instance, data) VALUES (?, ?, ?, ?, ?, ?)",
                    spans,
                )
            if heartbeats:
                db.executemany(
                    "INSERT INTO instances(instance, last_heartbeat, interval_s) VALUES (?, ?, ?) "
                    "ON CONFLICT(instance) DO UPDATE SET last_heartbeat=excluded.last_heartbeat, "
                    "interval_s=excluded.interval_s",
                    heartbeats,
                )
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"could not store spans in {str(self.path)!r}: {exc}") from exc

    def mark_orphaned(self, marks: Iterable[tuple[str, float]]) -> None:
        self._marks(
            "INSERT INTO run_marks(run_id, orphaned_at) VALUES (?, ?) "
            "ON CONFLICT(run_id) DO UPDATE SET orphaned_at=excluded.orphaned_at",
            list(marks),
        )

    def resolve(self, run_id: str, note: str, at: float) -> None:
        self._marks(
            "INSERT INTO run_marks(run_id, resolution_note, resolution_at) VALUES (?, ?, ?) "
            "ON CONFLICT(run_id) DO UPDATE SET resolution_note=excluded.resolution_note, "
            "resolution_at=excluded.resolution_at",
            [(run_id, note, at)],
        )

    def _marks(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        if not rows:
            return
        try:
            self._db.execute("BEGIN")
            self._db.executemany(sql, rows)
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"could not update {str(self.path)!r}: {exc}") from exc

    def delete_runs(self, run_ids: list[str]) -> None:
        if not run_ids:
            return
        try:
            self._db.execute("BEGIN")
            rows = [(r,) for r in run_ids]
            self._db.executemany("DELETE FROM spans WHERE run_id = ?", rows)
            self._db.executemany("DELETE FROM run_marks WHERE run_id = ?", rows)
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"could not prune runs from {str(self.path)!r}: {exc}") from exc

    def delete_instances(self, instances: list[str]) -> None:
        if not instances:
            return
        try:
            self._db.execute("BEGIN")
            self._db.executemany(
                "DELETE FROM instances WHERE instance = ?", [(i,) for i in instances]
            )
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"could not prune instances from {str(self.path)!r}: {exc}") from exc

    def instance_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM instances").fetchone()[0])

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):  # no transaction was open
            self._db.execute("ROLLBACK")

    # --- loading -----------------------------------------------------------------

    def spans(self) -> Iterator[StoredSpan]:
        """Every stored span, grouped by run."""
        cur = self._db.execute(
            "SELECT run_id, span_id, service, instance, data FROM spans ORDER BY run_id"
        )
        for row in cur:
            yield StoredSpan(*row)

    def marks(self) -> list[RunMark]:
        rows = self._db.execute(
            "SELECT run_id, orphaned_at, resolution_note, resolution_at FROM run_marks"
        ).fetchall()
        return [RunMark(*row) for row in rows]

    def instances(self) -> list[tuple[str, float, float]]:
        rows = self._db.execute(
            "SELECT instance, last_heartbeat, interval_s FROM instances"
        ).fetchall()
        return [(str(a), float(b), float(c)) for a, b, c in rows]

    def span_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM spans").fetchone()[0])
