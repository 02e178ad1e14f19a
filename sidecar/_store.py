"""SQLite persistence: the raw saga spans of every run, orphan marks, resolutions, heartbeats.

The in-memory state is rebuilt from here on start, so the store keeps the
spans themselves (the state machine is a function of them) rather than views.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._errors import StoreError
from ._leases import Lease, LeaseRefusal, Override, Owner
from ._log import get_logger

SCHEMA_VERSION = 1

log = get_logger("sidecar")

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
-- Who opened each run (its first accepted span): the only one, beside the lease
-- holder, allowed to change it. Written with that span, in its transaction.
CREATE TABLE IF NOT EXISTS run_owners (
    run_id TEXT PRIMARY KEY,
    trace_id TEXT NOT NULL,
    instance TEXT NOT NULL,
    service TEXT NOT NULL
);
-- One row per run ever leased; the token only grows (fencing), the override is
-- the last forced grant and outlives the lease.
CREATE TABLE IF NOT EXISTS run_leases (
    run_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    token INTEGER NOT NULL,
    granted_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    released INTEGER NOT NULL,
    forced_reason TEXT,
    forced_by TEXT,
    forced_at REAL
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
            "sidecar.db_folder.open_to_others",
            folder=str(path.parent),
            mode=oct(mode),
            problem="other users may read the stored tool arguments",
            fix=f"run `chmod 700 {path.parent}` or pick another --db folder",
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
        owners: Sequence[tuple[str, Owner]] = (),
    ) -> None:
        """Store one request's spans, heartbeats and new runs' owners in one transaction."""
        db = self._db
        try:
            db.execute("BEGIN")
            if owners:
                db.executemany(
                    "INSERT OR IGNORE INTO run_owners(run_id, trace_id, instance, service) "
                    "VALUES (?, ?, ?, ?)",
                    [(r, o.trace_id, o.instance, o.service) for r, o in owners],
                )
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

    def clear_orphaned(self, run_ids: Iterable[str]) -> None:
        """Drop the orphan marks of runs whose agent was heard from again."""
        self._marks(
            "UPDATE run_marks SET orphaned_at = NULL WHERE run_id = ?", [(r,) for r in run_ids]
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
            self._db.executemany("DELETE FROM run_owners WHERE run_id = ?", rows)
            self._db.executemany("DELETE FROM run_leases WHERE run_id = ?", rows)
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

    def stored_span(self, run_id: str, span_id: str) -> bytes | None:
        """The stored bytes of one span of a run, or None (duplicate detection)."""
        row = self._db.execute(
            "SELECT data FROM spans WHERE run_id = ? AND span_id = ?", (run_id, span_id)
        ).fetchone()
        return None if row is None else bytes(row[0])

    def owners(self) -> list[tuple[str, Owner]]:
        rows = self._db.execute(
            "SELECT run_id, trace_id, instance, service FROM run_owners"
        ).fetchall()
        return [(str(r), Owner(str(t), str(i), str(s))) for r, t, i, s in rows]

    def leases(self) -> list[Lease]:
        rows = self._db.execute(
            "SELECT run_id, holder, token, granted_at, expires_at, released, forced_reason, "
            "forced_by, forced_at FROM run_leases"
        ).fetchall()
        return [_lease(row) for row in rows]

    def decide_lease(
        self, run_id: str, decide: Callable[[Lease | None], Lease | LeaseRefusal]
    ) -> Lease | LeaseRefusal:
        """Read the run's lease, let ``decide`` grant/renew/release or refuse, write the result.

        One BEGIN IMMEDIATE transaction: the write lock is taken before the read, so
        no other writer of this file can grant in between.
        """
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute(
                "SELECT run_id, holder, token, granted_at, expires_at, released, forced_reason, "
                "forced_by, forced_at FROM run_leases WHERE run_id = ?",
                (run_id,),
            ).fetchone()
            outcome = decide(None if row is None else _lease(row))
            if isinstance(outcome, Lease):
                o = outcome.override
                db.execute(
                    "INSERT OR REPLACE INTO run_leases(run_id, holder, token, granted_at, "
                    "expires_at, released, forced_reason, forced_by, forced_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        run_id,
                        outcome.holder,
                        outcome.token,
                        outcome.granted_at,
                        outcome.expires_at,
                        int(outcome.released),
                        o.reason if o else None,
                        o.by if o else None,
                        o.at if o else None,
                    ),
                )
            db.execute("COMMIT")
            return outcome
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"could not update the lease in {str(self.path)!r}: {exc}") from exc
        except BaseException:
            self._rollback()
            raise

    def span_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM spans").fetchone()[0])


def _lease(row: tuple[object, ...]) -> Lease:
    run_id, holder, token, granted, expires, released, f_reason, f_by, f_at = row
    override = (
        Override(str(f_reason), str(f_by or ""), float(f_at))  # type: ignore[arg-type]
        if f_reason is not None and f_at is not None
        else None
    )
    return Lease(
        run_id=str(run_id),
        holder=str(holder),
        token=int(token),  # type: ignore[call-overload]
        granted_at=float(granted),  # type: ignore[arg-type]
        expires_at=float(expires),  # type: ignore[arg-type]
        released=bool(released),
        override=override,
    )
