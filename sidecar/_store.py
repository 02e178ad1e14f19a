"""SQLite persistence (the embedded backend): raw saga spans, marks, resolutions, heartbeats.

The in-memory state is rebuilt from here on start, so the store keeps the
spans themselves (the state machine is a function of them) rather than views.
The alert outbox's tables live in the same file (:class:`SqliteAlertStore`).
Both implement the interfaces of ``_storage.py``; the PostgreSQL backend is
``_pgstore.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ._errors import StoreError
from ._leases import Lease, LeaseRefusal, Override, Owner
from ._log import get_logger
from ._outbox_sql import (
    DELIVERED,
    HOLD_AGAIN,
    OUTBOX_V4,
    PRUNE_RUN_ALERTS,
    RESEND_DUE,
    RESOLVE_FIRE,
    RETIRE,
    ROW,
    SET_EVENT,
    OutboxReads,
)
from ._putaway_filter import PutAwayFilter
from ._storage import (
    BEAT_V8,
    HELD_OWNER_ROWS,
    JOINS_SQL,
    LEASE_ROW,
    MARK_ROW,
    NO_CHANGES,
    NOT_PUT_AWAY,
    OWNER_ROW,
    PRUNE_BATCH,
    PUT_AWAY_FLAG_V5,
    RESOLVED_BY_V7,
    SCHEMA_VERSION,
    SPAN_ROW,
    AlertTx,
    Changes,
    DbTarget,
    HeartbeatRow,
    HistoryRecord,
    InstanceRow,
    IntakeRows,
    NewAlert,
    OutboxRecord,
    PutAway,
    Resolution,
    RunMark,
    RunQuery,
    Screening,
    SpanRow,
    StoredSpan,
    T,
    merge_heartbeats,
    owners_from_rows,
    put_away_page_sql,
)

log = get_logger("sidecar")

_IN_BATCH = 500  # ids per IN (...) list: under SQLite's bound on host parameters
_AWAY_CHUNK = 65_536  # index rows per fetch while the filter is built (a stop check each)

# The schema as it shipped first (version 1), then one step per version. A database
# is brought from its version to SCHEMA_VERSION by the steps after it, in one
# transaction. Version 0 is an empty file (or one only the outbox wrote, which had
# no version): version 1's statements are all IF NOT EXISTS.
_OUTBOX_V1 = """
CREATE TABLE IF NOT EXISTS alert_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    dedup_key TEXT NOT NULL,
    action TEXT NOT NULL,
    sink TEXT NOT NULL,
    alertname TEXT NOT NULL,
    run_id TEXT NOT NULL,
    event TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    delivered_at REAL,
    last_sent_at REAL,
    UNIQUE (dedup_key, action, sink)
);
CREATE INDEX IF NOT EXISTS alert_outbox_pending ON alert_outbox (sink, state, id);
CREATE INDEX IF NOT EXISTS alert_outbox_run ON alert_outbox (run_id);
"""
_STEPS: dict[int, str] = {
    1: """
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
    + _OUTBOX_V1,
    # 2: the outbox is part of the versioned schema (a version-1 file may lack it), and
    # its rows can be claimed by one delivering process until a time (replicas).
    2: _OUTBOX_V1
    + """
ALTER TABLE alert_outbox ADD COLUMN claimed_by TEXT;
ALTER TABLE alert_outbox ADD COLUMN claimed_until REAL;
ALTER TABLE instances ADD COLUMN open_runs TEXT;
""",
    # 3: finished runs put away from memory (their spans stay in `spans`): listed and
    # pruned from this index; a start folds only the runs it does not hold.
    3: """
CREATE TABLE IF NOT EXISTS run_index (
    run_id TEXT PRIMARY KEY,
    started_at REAL NOT NULL,
    status TEXT,  -- NULL: reopened (back in a sidecar's memory after a late span)
    saga TEXT NOT NULL,
    last_seen REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS run_index_started ON run_index (started_at, run_id);
CREATE INDEX IF NOT EXISTS run_index_seen ON run_index (last_seen);
""",
    # 4: the outbox's per-alert reads cost what is pending or firing, not every row the
    # outbox ever held: its depth by state, and the fires still firing (a fire row is
    # marked resolved_at when its resolve row is written; rows written before are marked
    # here).
    4: OUTBOX_V4.format(add="ADD COLUMN", real="REAL"),
    # 5: the runs a start folds, read through the owners' put-away flag (NOT_PUT_AWAY).
    5: PUT_AWAY_FLAG_V5.format(add="ADD COLUMN"),
    # 6: replicas' change numbers (PostgreSQL's): one process per file reads nothing back.
    6: "",
    # 7: who resolved a run, as they named themselves; NULL for the resolutions before it.
    7: RESOLVED_BY_V7.format(add="ADD COLUMN"),
    # 8: the beat an instance's row holds the runs of (the parts of one beat are unioned).
    8: BEAT_V8.format(add="ADD COLUMN", bigint="INTEGER"),
}
# An instance's heartbeat row (merge_heartbeats' rule: a part of the beat held joins it).
_STORE_HEARTBEAT = (
    "INSERT INTO instances(instance, last_heartbeat, interval_s, open_runs, beat, "
    "beat_parts, beat_merged) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(instance) DO UPDATE "
    "SET last_heartbeat=excluded.last_heartbeat, interval_s=excluded.interval_s, "
    f"open_runs=CASE WHEN {JOINS_SQL} THEN (SELECT json_group_array(value) FROM "
    "(SELECT value FROM json_each(instances.open_runs) "
    "UNION SELECT value FROM json_each(excluded.open_runs))) ELSE excluded.open_runs END, "
    f"beat_merged=CASE WHEN {JOINS_SQL} THEN instances.beat_merged + excluded.beat_merged "
    "ELSE excluded.beat_merged END, beat=excluded.beat, beat_parts=excluded.beat_parts"
)


def _statements(script: str) -> list[str]:
    lines = [line.split("--", 1)[0] for line in script.splitlines()]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def newer_schema_message(where: str, found: int) -> str:
    return (
        f"the database {where} has schema version {found}, newer than this sidecar's "
        f"{SCHEMA_VERSION}: run the saga-sidecar release that wrote it (or a newer one), "
        "or point --db at another database"
    )


def migrate(db: sqlite3.Connection, where: str) -> int:
    """Bring the file to SCHEMA_VERSION in one transaction; the version found.

    Raises StoreError for a newer version (nothing is changed).
    """
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        found = int(row[0]) if row is not None else 0
        if found > SCHEMA_VERSION:
            raise StoreError(newer_schema_message(where, found))
        for version in range(found + 1, SCHEMA_VERSION + 1):
            for statement in _statements(_STEPS[version]):
                db.execute(statement)
        if found != SCHEMA_VERSION:
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES ('schema', ?)",
                (str(SCHEMA_VERSION),),
            )
        db.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            db.execute("ROLLBACK")
        raise
    if 0 < found < SCHEMA_VERSION:
        log.info("sidecar.db.upgraded", db=where, from_schema=found, to_schema=SCHEMA_VERSION)
    return found


def _target(where: DbTarget | Path) -> DbTarget:
    return where if isinstance(where, DbTarget) else DbTarget("sqlite", path=where)


def hold_file(path: Path) -> int:
    """Hold ``{path}.lock`` for as long as this process serves ``path``; the descriptor to
    close when it stops.

    One sidecar per SQLite file: the store is the file's only writer (its filter of runs
    put away trusts that), so a second ``serve`` on the same file stops at start with
    an error instead of writing behind the first one's back. ``flock`` is dropped by
    the kernel when the holder dies, SIGKILL included, so a restart never waits for a
    lock a dead process left. Readers (``saga-sidecar runs``) take no lock.

    The lock is a file of its own, never the database: closing a descriptor on the
    database would drop SQLite's POSIX locks on it (see prepare_db_file). Take it
    before anything in this process opens the database, so a second ``serve`` refused
    here has not opened it at all.
    """
    prepare_db_file(path, warn=False)
    lock = Path(f"{path}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StoreError(
            f"cannot open {str(lock)!r} next to the database: {exc}; pass a writable path "
            "with --db (SAGA_SIDECAR_DB)"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise StoreError(
            f"another sidecar already serves the database {str(path)!r} (it holds "
            f"{str(lock)!r}): stop it, or give this one its own file with --db; for several "
            "processes sharing runs use PostgreSQL (docs/scaling.md)"
        ) from exc
    return fd


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
    # Create the file 0600 before SQLite does (it would use the umask's mode), and
    # never open an existing one: closing any descriptor on a file drops every POSIX
    # lock this process holds on it, SQLite's shared lock included, which SQLite
    # (counting its locks per file inside the process) never takes again. A reader
    # closing the file (sqlite3, a backup) then finds no other connection, checkpoints
    # and deletes the -wal the sidecar still commits into: lost on kill -9.
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        pass
    else:
        os.close(fd)  # a new file: no lock of anyone's on it yet
    for suffix in ("", "-wal", "-shm"):
        side = Path(f"{path}{suffix}")
        if side.exists():
            os.chmod(side, 0o600)


def open_error(what: str, path: Path, exc: OSError | sqlite3.Error, fix: str) -> StoreError:
    """The StoreError for ``what`` in ``path`` that would not open, ending with ``fix``:
    unless the file is no SQLite database, or a damaged one, which no writable path
    mends."""
    if getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        fix = (
            "the file is not a SQLite database, or is damaged: if --db names the wrong "
            "file, give the right one; else move it aside with its -wal and -shm (the next "
            "start creates an empty database) or restore a backup (docs/operations.md)"
        )
    return StoreError(f"cannot open {what} {str(path)!r}: {exc}; {fix}")


CHECKPOINT_INTERVAL = 1.0
"""Seconds between the background WAL checkpoints (``SqliteStore._checkpoints``)."""
BACKSTOP_PAGES = 16384
"""WAL pages (64 MiB at 4 KiB) after which a commit checkpoints itself after all: only
when the background checkpoints fall that far behind."""


class SqliteStore:
    """One connection, used from the event loop thread only (``inline``: a local file).

    WAL checkpoints (copying committed pages into the database file, with an fsync)
    run on a thread of the store with a connection of its own, every
    CHECKPOINT_INTERVAL: not inside a COMMIT of the intake path, where SQLite's
    automatic checkpoint put 6-7 ms stalls on the request that crossed 1,000 pages.
    A commit is as durable either way (it is in the WAL when COMMIT returns).
    """

    inline = True

    def __init__(self, where: DbTarget | Path) -> None:
        self.target = _target(where)
        assert self.target.path is not None
        self.path = path = self.target.path
        try:
            prepare_db_file(path)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            # WAL + synchronous=NORMAL: a committed transaction is in the WAL file (written
            # with write(2)) before COMMIT returns, so it survives kill -9 of this process;
            # only an OS crash or power loss can lose the last commits (FULL would fsync).
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
            migrate(self._db, repr(str(path)))
            # Another component (the alert outbox) may have created the file first with
            # the umask's mode: tighten it and WAL's side files either way.
            for suffix in ("", "-wal", "-shm"):
                side = Path(f"{path}{suffix}")
                if side.exists():
                    os.chmod(side, 0o600)
        except (OSError, sqlite3.Error) as exc:
            fix = "pass a writable path with --db (SAGA_SIDECAR_DB)"
            raise open_error("the sidecar database", path, exc, fix) from exc
        self._closing = threading.Event()  # stops the store's threads
        self._checkpoint_soon = threading.Event()  # a checkpoint now, not at the interval
        self._checkpointer = threading.Thread(
            target=self._checkpoints, name="saga-db-checkpoint", daemon=True
        )
        self._checkpointer.start()
        # The filter of runs put away is built from the index on a thread (about a
        # second per million runs: a week at 100 runs/s would hold the ports shut for
        # a minute). Until it is ready every lookup asks the index, and ids put away
        # meanwhile wait in _away_pending: the thread reads only rows committed before
        # it started, and this process is the file's only writer. (Its read holds a
        # WAL snapshot meanwhile, so the WAL grows until the build is done.)
        self._away: PutAwayFilter | None = None
        self._away_pending: list[tuple[str, float]] = []
        self._away_built: PutAwayFilter | None = None
        self._away_done = threading.Event()
        self._away_reader: sqlite3.Connection | None = None
        self._away_builder = threading.Thread(
            target=self._build_away, name="saga-db-putaway-filter", daemon=True
        )
        self._away_builder.start()

    def _checkpoints(self) -> None:
        """PASSIVE checkpoints every CHECKPOINT_INTERVAL, or sooner when asked (a prune
        batch), until close (the store's thread).

        PASSIVE never waits for the writer: the intake commits on while pages are
        copied. A failure is logged and retried at the next interval (the backstop
        keeps the WAL bounded meanwhile).
        """
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            log.warning("sidecar.db.checkpointer_failed", db=str(self.path), error=str(exc))
            return
        try:
            while True:
                self._checkpoint_soon.wait(CHECKPOINT_INTERVAL)
                self._checkpoint_soon.clear()
                if self._closing.is_set():
                    break
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:
                    log.warning("sidecar.db.checkpoint_failed", db=str(self.path), error=str(exc))
        finally:
            db.close()

    def _build_away(self) -> None:
        """Read the index of runs put away into a new filter (the store's thread).

        Oldest first, so each slice spans a short time (pruning drops whole slices).
        A failure is logged and leaves the lookups on the index: slower, the same
        answers.
        """
        try:
            try:
                db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                self._away_reader = db  # close() interrupts a long read through it
                built = PutAwayFilter()
                began, runs = time.monotonic(), 0
                try:
                    rows = db.execute("SELECT run_id, last_seen FROM run_index ORDER BY last_seen")
                    while chunk := rows.fetchmany(_AWAY_CHUNK):
                        if self._closing.is_set():
                            return
                        built.add([(str(r), float(t)) for r, t in chunk])
                        runs += len(chunk)
                finally:
                    self._away_reader = None
                    db.close()
            except sqlite3.Error as exc:
                if not self._closing.is_set():
                    log.warning(
                        "sidecar.db.putaway_filter_failed",
                        db=str(self.path),
                        error=str(exc),
                        effect="every new run is looked up in the database",
                    )
                return
            self._away_built = built
            if runs:  # an empty index is no news
                log.info(
                    "sidecar.db.putaway_filter_built",
                    db=str(self.path),
                    runs=runs,
                    seconds=round(time.monotonic() - began, 3),
                )
        finally:
            self._away_done.set()

    def _filter(self) -> PutAwayFilter | None:
        """The filter once built (with the ids put away meanwhile), else None."""
        away = self._away
        if away is None and self._away_done.is_set() and self._away_built is not None:
            away = self._away = self._away_built
            away.add(self._away_pending)
            self._away_pending = []
        return away

    @property
    def put_away_filter_ready(self) -> bool:
        """Whether new runs are screened by the filter yet (else the index answers)."""
        return self._filter() is not None

    def schema_version(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        return int(row[0])

    def close(self) -> None:
        self._closing.set()
        self._checkpoint_soon.set()
        reader = self._away_reader
        if reader is not None and not self._away_done.is_set():
            with contextlib.suppress(sqlite3.Error):
                reader.interrupt()  # a read of millions of rows need not finish first
        self._away_builder.join()
        self._checkpointer.join()
        self._db.close()

    def write(
        self,
        spans: Sequence[SpanRow],
        heartbeats: Sequence[HeartbeatRow] = (),
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
                db.executemany(_STORE_HEARTBEAT, merge_heartbeats(heartbeats))
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

    def clear_orphaned(self, marks: Iterable[tuple[str, float]]) -> None:
        self._marks(
            "UPDATE run_marks SET orphaned_at = NULL WHERE run_id = ? AND orphaned_at = ?",
            list(marks),
        )

    def clear_resolutions(self, lapsed: Iterable[tuple[str, float]]) -> None:
        self._marks(
            "UPDATE run_marks SET resolution_note = NULL, resolution_at = NULL, "
            "resolution_by = NULL WHERE run_id = ? AND resolution_at = ?",
            list(lapsed),
        )

    def resolve(self, run_id: str, wanted: Resolution, *, replace: bool = False) -> Resolution:
        # As PostgreSQL's (one process here, but the same rule through the same interface):
        # the write lock taken first, the first resolution stands unless replaced; one made
        # at or before the run's orphan mark lapsed (SQLite keeps no cleared mark: its clears
        # and lapses are written at once, in order).
        where = "" if replace else (
            " WHERE run_marks.resolution_at IS NULL "
            "OR run_marks.resolution_at <= run_marks.orphaned_at"
        )  # fmt: skip
        with self._tx("store the resolution", "BEGIN IMMEDIATE") as db:
            db.execute(
                "INSERT INTO run_marks(run_id, resolution_note, resolution_at, resolution_by) "
                "VALUES (?, ?, ?, ?) ON CONFLICT(run_id) DO UPDATE SET "
                "resolution_note=excluded.resolution_note, resolution_at=excluded.resolution_at, "
                "resolution_by=excluded.resolution_by" + where,
                (run_id, wanted.note, wanted.at, wanted.by),
            )
            row = db.execute(
                "SELECT resolution_note, resolution_at, resolution_by FROM run_marks "
                "WHERE run_id = ?",
                (run_id,),
            ).fetchone()
        return Resolution(str(row[0]), float(row[1]), row[2])

    def _marks(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        if rows:
            with self._tx("update the run marks") as db:
                db.executemany(sql, rows)

    def delete_runs(self, run_ids: list[str]) -> None:
        if run_ids:
            rows = [(r,) for r in run_ids]
            with self._tx("prune runs") as db:
                for table in ("spans", "run_marks", "run_owners", "run_leases", "run_index"):
                    db.executemany(f"DELETE FROM {table} WHERE run_id = ?", rows)
                db.executemany(PRUNE_RUN_ALERTS, [(r, r) for r in run_ids])

    def delete_instances(self, instances: list[str]) -> None:
        if instances:
            with self._tx("prune instances") as db:
                db.executemany(
                    "DELETE FROM instances WHERE instance = ?", [(i,) for i in instances]
                )

    def instance_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM instances").fetchone()[0])

    @contextlib.contextmanager
    def _tx(self, what: str, begin: str = "BEGIN") -> Iterator[sqlite3.Connection]:
        """One write transaction: committed at the end of the block, or rolled back (on
        any error) and a database error raised as StoreError naming ``what`` failed."""
        db = self._db
        try:
            db.execute(begin)
            yield db
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            raise StoreError(f"could not {what} in {str(self.path)!r}: {exc}") from exc
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):  # no transaction was open
            self._db.execute("ROLLBACK")

    # --- loading -----------------------------------------------------------------

    def spans(self) -> Iterator[StoredSpan]:
        """Every stored span of the runs not put away, grouped by run."""
        cur = self._db.execute(
            f"{SPAN_ROW} WHERE {NOT_PUT_AWAY.format(table='spans')} ORDER BY run_id"
        )
        for row in cur:
            yield StoredSpan(*row)

    def marks(self) -> list[RunMark]:
        rows = self._db.execute(
            MARK_ROW + " WHERE " + NOT_PUT_AWAY.format(table="run_marks")
        ).fetchall()
        return [RunMark(*row) for row in rows]

    def instances(self) -> list[InstanceRow]:
        rows = self._db.execute(
            "SELECT instance, last_heartbeat, interval_s FROM instances"
        ).fetchall()
        return [(str(a), float(b), float(c)) for a, b, c in rows]

    def stored_spans(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], bytes]:
        """The stored bytes of those (run_id, span_id) that exist (duplicate detection)."""
        out = {}
        for run_id, span_id in keys:
            row = self._db.execute(
                "SELECT data FROM spans WHERE run_id = ? AND span_id = ?", (run_id, span_id)
            ).fetchone()
            if row is not None:
                out[(run_id, span_id)] = bytes(row[0])
        return out

    def owners(self) -> list[tuple[str, Owner]]:
        rows = self._db.execute(HELD_OWNER_ROWS).fetchall()
        return owners_from_rows(rows)

    def leases(self, now: float) -> list[Lease]:  # noqa: ARG002 (on the sidecar's clock)
        rows = self._db.execute(
            LEASE_ROW + " WHERE " + NOT_PUT_AWAY.format(table="run_leases")
        ).fetchall()
        return [lease_from_row(row) for row in rows]

    # --- finished runs put away from memory -----------------------------------------

    def put_away(self, rows: Sequence[PutAway]) -> None:
        if rows:
            # Before the rows: the filter may hold more than the index, never less.
            ids = [(r.run_id, r.last_seen) for r in rows]
            away = self._filter()
            if away is None:
                self._away_pending += ids
            else:
                away.add(ids)
            with self._tx("index finished runs") as db:
                db.executemany(
                    "INSERT INTO run_index(run_id, started_at, status, saga, last_seen) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT(run_id) DO UPDATE SET "
                    "started_at=excluded.started_at, status=excluded.status, "
                    "saga=excluded.saga, last_seen=excluded.last_seen",
                    rows,
                )
                db.executemany(
                    "UPDATE run_owners SET put_away = 1 WHERE run_id = ?",
                    [(r.run_id,) for r in rows],
                )

    def put_away_of(self, run_ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        away = self._filter()
        if away is not None:
            run_ids = away.maybe(run_ids)  # most new runs never reach the database
        for start in range(0, len(run_ids), _IN_BATCH):
            chunk = list(run_ids[start : start + _IN_BATCH])
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                f"SELECT run_id FROM run_index WHERE run_id IN ({marks})", chunk
            ).fetchall()
            found.update(str(r) for (r,) in rows)
        return found

    def load_runs(
        self,
        run_ids: Sequence[str],
        now: float,  # noqa: ARG002 (leases are on the sidecar's clock)
        *,
        reopen: bool = False,
    ) -> Changes:
        ids = sorted(set(run_ids))
        spans: list[StoredSpan] = []
        owners: list[tuple[str, Owner]] = []
        marks: list[RunMark] = []
        leases: list[Lease] = []
        with self._tx("read runs") as db:
            for start in range(0, len(ids), _IN_BATCH):
                chunk = ids[start : start + _IN_BATCH]
                ins = ",".join("?" * len(chunk))
                where = f" WHERE run_id IN ({ins})"
                spans += [
                    StoredSpan(*r) for r in db.execute(SPAN_ROW + where + " ORDER BY run_id", chunk)
                ]
                owners += owners_from_rows(db.execute(OWNER_ROW + where, chunk))
                marks += [RunMark(*row) for row in db.execute(MARK_ROW + where, chunk)]
                leases += [lease_from_row(row) for row in db.execute(LEASE_ROW + where, chunk)]
                if reopen:
                    db.execute(f"UPDATE run_index SET status = NULL WHERE run_id IN ({ins})", chunk)
                    db.execute(f"UPDATE run_owners SET put_away = 0 WHERE run_id IN ({ins})", chunk)
        return Changes(spans, owners, [], marks, leases)

    def put_away_page(self, query: RunQuery, limit: int) -> list[tuple[str, float]]:
        sql, args = put_away_page_sql(query, limit, "?")
        return [(str(r), float(t)) for r, t in self._db.execute(sql, args)]

    def prune_put_away(self, before: float, limit: int = PRUNE_BATCH) -> int:
        rows = self._db.execute(
            "SELECT run_id FROM run_index WHERE last_seen < ? AND status IS NOT NULL "
            "ORDER BY last_seen LIMIT ?",
            (before, limit),
        ).fetchall()
        run_ids = [str(r) for (r,) in rows]
        self.delete_runs(run_ids)
        if run_ids:
            # A backlog's batches write the WAL faster than checkpoints each second copy
            # it; at the backstop a COMMIT on the loop would copy it all (~150 ms). The
            # store's thread copies it now, while the loop serves between batches.
            self._checkpoint_soon.set()
        away = self._filter()
        # The filter drops whole slices older than ``before``: only once no row that old
        # is left but the reopened ones (a full batch may have left more), else a run
        # still indexed would be answered "new". While it is built it may keep pruned
        # ids: a superset.
        if away is not None and len(run_ids) < limit:
            kept = self._db.execute(  # reopened (status NULL): not pruned, still indexed
                "SELECT run_id, last_seen FROM run_index WHERE last_seen < ? AND status IS NULL",
                (before,),
            ).fetchall()
            away.pruned(before, ((str(r), float(t)) for r, t in kept))
        return len(run_ids)

    def decide_lease(
        self,
        run_id: str,
        now: float,  # noqa: ARG002 (leases are on the sidecar's clock)
        decide: Callable[[Lease | None], Lease | LeaseRefusal],
    ) -> Lease | LeaseRefusal:
        """Read the run's lease, let ``decide`` grant/renew/release or refuse, write the result.

        One BEGIN IMMEDIATE transaction: the write lock is taken before the read, so
        no other writer of this file can grant in between. Lease times are on the
        sidecar's clock, which one process reads (steps of it: :meth:`clock_stepped`).
        """
        with self._tx("update the lease", "BEGIN IMMEDIATE") as db:
            row = db.execute(LEASE_ROW + " WHERE run_id = ?", (run_id,)).fetchone()
            outcome = decide(None if row is None else lease_from_row(row))
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
        return outcome

    def clock_stepped(self, step: float) -> None:
        """Every lease row moves with the step (forced_at NULL stays NULL): a step forward
        ends none early, a step back lengthens none. Few rows: recovered runs only."""
        with self._tx("move the leases across a clock step") as db:
            db.execute(
                "UPDATE run_leases SET granted_at = granted_at + ?1, "
                "expires_at = expires_at + ?1, forced_at = forced_at + ?1",
                (step,),
            )

    def span_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM spans").fetchone()[0])

    def write_screened(
        self,
        keys: Sequence[tuple[str, str]],
        openers: Sequence[tuple[str, Owner]],  # noqa: ARG002 (the interface's)
        now: float,
        decide: Callable[[Screening], tuple[IntakeRows, T]],
    ) -> tuple[T, int]:
        """One process per file, one call at a time: nothing comes between the read and
        the write (the sidecar's inline intake screens against its memory instead). No
        change numbers: nothing is read back by them."""
        run_ids = sorted({r for r, _ in keys})
        owners = {r: o for r, o in self.owners() if r in run_ids} if run_ids else {}
        leases = {x.run_id: x for x in self.leases(now) if x.run_id in owners}
        rows, result = decide(Screening(owners, leases, self.stored_spans(keys)))
        self.write(rows.spans, rows.heartbeats, rows.owners)
        return result, 0

    def changes(self, now: float) -> Changes:  # noqa: ARG002 (the interface's)
        return NO_CHANGES  # one process per file: nothing changes behind its back

    def try_lead(self, hold: float) -> bool:  # noqa: ARG002 (the interface's)
        return True


def lease_from_row(row: tuple[object, ...]) -> Lease:
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


class _SqliteAlertTx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def fires(self, dedup_key: str) -> list[tuple[str, str, str]]:
        rows = self._db.execute(
            "SELECT sink, event, state FROM alert_outbox WHERE dedup_key = ? AND action = 'fire'",
            (dedup_key,),
        ).fetchall()
        return [(str(a), str(b), str(c)) for a, b, c in rows]

    def keys(self, alertname: str, run_id: str) -> list[tuple[str, str]]:
        rows = self._db.execute(
            "SELECT DISTINCT dedup_key, action FROM alert_outbox WHERE run_id = ? "
            "AND alertname = ?",
            (run_id, alertname),
        ).fetchall()
        return [(str(k), str(a)) for k, a in rows]

    def insert(self, row: NewAlert) -> bool:
        cur = self._db.execute(
            "INSERT OR IGNORE INTO alert_outbox (dedup_key, action, sink, alertname, run_id, "
            "event, state, created_at) VALUES (?,?,?,?,?,?,?,?)",
            tuple(row),
        )
        return bool(cur.rowcount)

    def retire(self, row_id: int, state: str, note: str, at: float) -> None:
        self._db.execute(RETIRE, (state, note, at, row_id))

    def hold_again(self, dedup_key: str, action: str, sink: str) -> None:
        self._db.execute(HOLD_AGAIN, (dedup_key, action, sink))

    def set_event(self, row_id: int, event: str) -> None:
        self._db.execute(SET_EVENT, (event, row_id))

    def resolve_fire(self, dedup_key: str, sink: str, at: float) -> None:
        self._db.execute(RESOLVE_FIRE, (at, dedup_key, sink))


class SqliteAlertStore(OutboxReads):
    """The alert outbox's rows in the sidecar's SQLite file, on a connection of their own.

    The outbox may call it from more than one thread: a lock serializes the calls.
    """

    inline = True
    placeholder = "?"

    def __init__(self, where: DbTarget | Path | str) -> None:
        memory = str(where) == ":memory:"
        self.target = _target(Path(where) if isinstance(where, str) else where)
        assert self.target.path is not None
        path = self.target.path
        self._lock = threading.Lock()
        try:
            if not memory:
                prepare_db_file(path, warn=False)  # the Store warns, once
            self._db = sqlite3.connect(
                ":memory:" if memory else str(path), isolation_level=None, check_same_thread=False
            )
            self._db.execute("PRAGMA busy_timeout = 10000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            # As the intake's connection: the store's thread checkpoints. At SQLite's
            # default (1,000 pages) an alert's COMMIT checkpointed the busy WAL itself,
            # 6-30 ms on the way of every alert under load.
            self._db.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP_PAGES}")
            migrate(self._db, repr(str(path)))
        except (OSError, sqlite3.Error) as exc:
            fix = "check the path is writable (--db) and not on a network filesystem"
            raise open_error("the alert outbox in", path, exc, fix) from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[AlertTx]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield _SqliteAlertTx(self._db)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise StoreError(f"cannot write alerts to the outbox: {exc}") from exc
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise

    def _all(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def next_row(self, sink: str, state: str) -> OutboxRecord | None:
        rows = self._all(ROW + " WHERE sink = ? AND state = ? ORDER BY id LIMIT 1", (sink, state))
        return OutboxRecord(*rows[0]) if rows else None

    def sending(self, row_id: int, seconds: float) -> bool:  # noqa: ARG002
        return True  # one process per file: its rows are its own

    def mark(
        self,
        row_id: int,
        state: str,
        error: str | None,
        sent: bool,
        now: float,
        hold: float = 0,  # noqa: ARG002 (one process per file: no claims to hold)
    ) -> bool:
        with self._lock:
            self._db.execute(
                "UPDATE alert_outbox SET state = ?, attempts = attempts + 1, last_error = ?, "
                "delivered_at = CASE WHEN ? THEN ? ELSE delivered_at END, "
                "last_sent_at = CASE WHEN ? THEN ? ELSE last_sent_at END WHERE id = ?",
                (state, error, sent, now, sent, now, row_id),
            )
        return True

    def resending(self, row_id: int, due: float, seconds: float) -> bool:  # noqa: ARG002
        where = RESEND_DUE.format(state="?", due="?")
        query = f"SELECT 1 FROM alert_outbox WHERE id = ? AND {where}"
        return bool(self._all(query, (row_id, DELIVERED, due)))

    def touch_sent(self, row_id: int, at: float) -> None:
        with self._lock:
            self._db.execute("UPDATE alert_outbox SET last_sent_at = ? WHERE id = ?", (at, row_id))

    def history(self, run_id: str) -> list[HistoryRecord]:
        assert self.target.path is not None
        return sqlite_history(self.target.path, run_id)


def sqlite_history(path: Path, run_id: str) -> list[HistoryRecord]:
    """The alert rows of one run, oldest first, on a read-only connection of their own.

    Empty when alerting never wrote to this database (no outbox table yet).
    """
    try:
        db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the alert outbox in {path}: {exc}") from exc
    try:
        db.execute("PRAGMA busy_timeout = 10000")
        rows = db.execute(
            "SELECT created_at, alertname, action, sink, state, attempts, last_error, event "
            "FROM alert_outbox WHERE run_id = ? ORDER BY id",
            (run_id,),
        ).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise StoreError(f"cannot read the alert outbox in {path}: {exc}") from exc
    finally:
        db.close()
    return [HistoryRecord(*r) for r in rows]
