"""PostgreSQL persistence: the same tables as ``_store.py``, for sidecar replicas on one database.

psycopg 3 with psycopg_pool: the maintained PostgreSQL driver for Python, typed
(mypy strict sees its API), with a connection pool that replaces broken
connections by itself. The store is synchronous (psycopg's blocking API); the
sidecar calls it from a worker thread, never on its event loop (``inline`` is
False), so a slow database delays requests, not the loop.

Every method is one transaction on a pooled connection. Whatever may run on two
replicas at once is serialized in the database: lease decisions under a
per-run advisory lock, schema upgrades under a global one, inserts with
``ON CONFLICT``. Error messages name the database without its password.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ._errors import StoreError
from ._leases import Lease, LeaseRefusal, Owner
from ._log import get_logger
from ._outbox_sql import (
    DELIVERED,
    HOLD_AGAIN,
    OUTBOX_V4,
    PENDING,
    PRUNE_RUN_ALERTS,
    RESEND_DUE,
    RESOLVE_FIRE,
    RETIRE,
    SET_EVENT,
    OutboxReads,
    sql,
)
from ._storage import (
    BEAT_V8,
    HELD_OWNER_ROWS,
    JOINS_SQL,
    LEASE_ROW,
    MARK_ROW,
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
    HeardRow,
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
    span_from_row,
)
from ._store import lease_from_row, newer_schema_message

log = get_logger("sidecar")

CONNECT_TIMEOUT_S = 5
# idle_session_timeout (the lead connection) and pg_current_xact_id (sync) need 14.
MIN_SERVER_VERSION = 140000
POOL_WAIT_S = 5.0  # a request waits this long for a connection, then answers 503
STORE_POOL = 4  # PgStore's connections
OUTBOX_POOL = 2  # PgAlertStore's
CONNECTIONS_EACH = STORE_POOL + OUTBOX_POOL + 2
"""Connections one sidecar holds on the server: its two pools, and one of its own each
for the leader lock (PgStore.try_lead) and the outbox's presence lock (one more for a
moment: a store's migration at start, a run's alert history)."""
# The server's refusals for want of a connection slot (SQLSTATE 53300, which libpq does
# not hand on for a failed connection: only the text).
_NO_SLOT = (
    "too many clients already",
    "remaining connection slots are reserved",
    "too many connections for",
)
INSTALL_HINT = "pip install 'saga-otel[sidecar]' (psycopg[binary] and psycopg-pool)"

_OUTBOX_V1 = """
CREATE TABLE IF NOT EXISTS alert_outbox (
    id BIGSERIAL PRIMARY KEY,
    dedup_key TEXT NOT NULL,
    action TEXT NOT NULL,
    sink TEXT NOT NULL,
    alertname TEXT NOT NULL,
    run_id TEXT NOT NULL,
    event TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    created_at DOUBLE PRECISION NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    delivered_at DOUBLE PRECISION,
    last_sent_at DOUBLE PRECISION,
    UNIQUE (dedup_key, action, sink)
);
CREATE INDEX IF NOT EXISTS alert_outbox_pending ON alert_outbox (sink, state, id);
CREATE INDEX IF NOT EXISTS alert_outbox_run ON alert_outbox (run_id);
"""
# A row's change number: the id of the transaction that wrote it (64 bits, never
# wrapping). A replica reads the rows changed since its last read by these, not by the
# writers' clocks (changes()), and orders an orphan mark against the spans (their xmin,
# _full_xid) and heartbeats of its run by them (RunState.read_orphaned; its own writes
# by where they came in that order: _insert).
_CHANGED = "pg_current_xact_id()::text::bigint"
# One step per schema version, as in _store.py (same numbers, same meaning).
_STEPS: dict[int, str] = {
    1: """
CREATE TABLE IF NOT EXISTS spans (
    run_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL,
    service TEXT NOT NULL,
    instance TEXT NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (run_id, span_id)
);
CREATE TABLE IF NOT EXISTS run_marks (
    run_id TEXT PRIMARY KEY,
    orphaned_at DOUBLE PRECISION,
    resolution_note TEXT,
    resolution_at DOUBLE PRECISION
);
CREATE TABLE IF NOT EXISTS instances (
    instance TEXT PRIMARY KEY,
    last_heartbeat DOUBLE PRECISION NOT NULL,
    interval_s DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS run_owners (
    run_id TEXT PRIMARY KEY,
    trace_id TEXT NOT NULL,
    instance TEXT NOT NULL,
    service TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS run_leases (
    run_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    token BIGINT NOT NULL,
    granted_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    released BOOLEAN NOT NULL,
    forced_reason TEXT,
    forced_by TEXT,
    forced_at DOUBLE PRECISION
);
"""
    + _OUTBOX_V1,
    2: _OUTBOX_V1
    + """
ALTER TABLE alert_outbox ADD COLUMN IF NOT EXISTS claimed_by TEXT;
ALTER TABLE alert_outbox ADD COLUMN IF NOT EXISTS claimed_until DOUBLE PRECISION;
-- Commit order of spans, so each replica folds in what the others stored (changes()).
ALTER TABLE instances ADD COLUMN IF NOT EXISTS open_runs TEXT;
ALTER TABLE spans ADD COLUMN IF NOT EXISTS seq BIGSERIAL;
CREATE INDEX IF NOT EXISTS spans_seq ON spans (seq);
""",
    3: """
CREATE TABLE IF NOT EXISTS run_index (
    run_id TEXT PRIMARY KEY,
    started_at DOUBLE PRECISION NOT NULL,
    status TEXT,
    saga TEXT NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS run_index_started ON run_index (started_at, run_id);
CREATE INDEX IF NOT EXISTS run_index_seen ON run_index (last_seen);
""",
    # 4: as SQLite's (the outbox's per-alert reads through indexes; see _store.py).
    4: OUTBOX_V4.format(add="ADD COLUMN IF NOT EXISTS", real="DOUBLE PRECISION"),
    # 5: as SQLite's (a start reads the runs held through the owners' flag).
    5: PUT_AWAY_FLAG_V5.format(add="ADD COLUMN IF NOT EXISTS"),
    # 6: heartbeats, run marks and leases carry their change number (replicas read them
    # by it, not by the times they hold), and a cleared mark the mark it ended, so a
    # replica reads a clear (orphaned_at NULL) as it reads a mark.
    6: "ALTER TABLE run_marks ADD COLUMN IF NOT EXISTS cleared DOUBLE PRECISION;"
    + "".join(
        f"""
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS changed BIGINT NOT NULL DEFAULT 0;
ALTER TABLE {table} ALTER COLUMN changed SET DEFAULT ({_CHANGED});
CREATE INDEX IF NOT EXISTS {table}_changed ON {table} (changed);
"""
        for table in ("instances", "run_marks", "run_leases")
    ),
    # 7: as SQLite's (who resolved a run; replicas read it with the mark's row).
    7: RESOLVED_BY_V7.format(add="ADD COLUMN IF NOT EXISTS"),
    # 8: as SQLite's (the beat an instance's row holds the runs of).
    8: BEAT_V8.format(add="ADD COLUMN IF NOT EXISTS", bigint="BIGINT"),
}
# The owners' put-away flag (schema 5) of sorted run ids, their rows locked in that
# order (as the intake locks them), so two replicas' put-aways cannot deadlock on them.
_FLAG_HELD = (
    "UPDATE run_owners SET put_away = %s WHERE run_id IN (SELECT run_id FROM run_owners "
    "WHERE run_id = ANY(%s) ORDER BY run_id FOR UPDATE)"
)
_MIGRATION_LOCK = 0x5A6A_0001  # pg_advisory_xact_lock key: one schema upgrade at a time
_LEADER_LOCK = 0x5A6A_0002  # pg_try_advisory_lock key: the replica that detects orphans
# A sequence number below the newest one seen may still commit (its transaction took it
# first and is still open: waiting on a lock, a slow disk) or never (ON CONFLICT DO
# NOTHING and rollbacks burn numbers). Such a gap is looked up again at every read until
# every transaction that could hold it has ended, however long that takes, never for a
# time: its holder took it before the number seen above it, so it had its xid (see
# _insert) before the read that found the gap; once a later read's xmin (_XMIN, at its
# start) reaches that read's xmax (_XMAX), the holder has ended, and the read that follows
# would have returned the row had it committed.
GAP_WINDOW = 10_000  # at start, only the newest numbers can belong to open transactions
# The bound on the numbers looked up again, only reached while one transaction stays
# open for hours (an idle-in-transaction session, a forgotten prepared transaction): the
# xmin stands still and every burnt number since stays a gap, each sent with every read.
# Past it the lowest are given up (logged as sidecar.sync.gaps_dropped).
MAX_GAPS = 100_000
# The oldest transaction still running as a read begins (its snapshot's xmin): a row
# that read could not see was written by a transaction at least this old, so the next
# read asks for the change numbers from here (and skips the rows it has read already).
# Writers' clocks play no part: a replica whose clock is behind is read as any other.
_XMIN = "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
# The first transaction id not yet given out as a statement's snapshot is taken: every
# transaction that had its xid before that statement began has an xid below it.
_XMAX = "(SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint)"
_INSTANCE_CHANGES = (
    "SELECT instance, last_heartbeat, interval_s, open_runs, changed FROM instances "
    "WHERE changed >= %s"
)
# An instance's heartbeat rows, one per instance (merge_heartbeats: one statement may not
# update a row twice), each joining the beat the row holds or taking its place. Under
# the row's lock: two replicas storing parts of one beat at once both end in the row.
_STORE_HEARTBEATS = (
    "INSERT INTO instances(instance, last_heartbeat, interval_s, open_runs, beat, "
    "beat_parts, beat_merged) SELECT * FROM unnest(%b::text[], %b::float8[], %b::float8[], "
    "%b::text[], %b::int8[], %b::int8[], %b::int8[]) ON CONFLICT (instance) DO UPDATE SET "
    "last_heartbeat = excluded.last_heartbeat, interval_s = excluded.interval_s, "
    f"open_runs = CASE WHEN {JOINS_SQL} THEN (SELECT COALESCE(json_agg(u.r), '[]')::text "
    "FROM (SELECT json_array_elements_text(COALESCE(instances.open_runs, '[]')::json) "
    "UNION SELECT json_array_elements_text(excluded.open_runs::json)) AS u(r)) "
    "ELSE excluded.open_runs END, "
    f"beat_merged = CASE WHEN {JOINS_SQL} THEN instances.beat_merged + excluded.beat_merged "
    "ELSE excluded.beat_merged END, beat = excluded.beat, beat_parts = excluded.beat_parts, "
    f"changed = excluded.changed RETURNING instance, changed, beat_merged, {_XMAX}"
)
# The shared rows' columns, then the mark a clear ended (marks), then the change number.
_MARK_CHANGES = MARK_ROW.replace(" FROM ", ", cleared, changed FROM ") + " WHERE changed >= %s"
# Lease times are kept on the database's clock, the one clock every replica shares: each
# lease a replica reads comes with the database's clock as it was read (_DB_NOW, after
# the lease's columns) and is moved onto the replica's clock by the difference between
# the two readings, and each one it writes is moved back the same way (_to_replica,
# PgStore.decide_lease). So whether a lease has expired is judged on one clock whichever
# replica asks: a replica whose clock runs ahead of the granter's no longer sees a live
# lease expired and grants it again, and a step of a replica's clock moves no lease.
_DB_NOW = "extract(epoch FROM clock_timestamp())::float8"
_LEASE_AT = LEASE_ROW.replace(" FROM ", f", {_DB_NOW} FROM ", 1)
_LEASE_CHANGES = LEASE_ROW.replace(" FROM ", f", {_DB_NOW}, changed FROM ", 1) + (
    " WHERE changed >= %s"
)
SYNC_BATCH = 5000
# A person's resolution; with _FIRST_ONLY, only where none stands: the first one stands
# (docs/sidecar.md), and one made at or before the run's orphan mark, or the mark it was
# revived from (``cleared``), lapsed (``_state._before_mark``, which every replica applies
# to it), so it is no longer there to keep.
_RESOLVE = (
    "INSERT INTO run_marks(run_id, resolution_note, resolution_at, resolution_by) "
    "VALUES (%s, %s, %s, %s) ON CONFLICT (run_id) DO UPDATE SET "
    "resolution_note = excluded.resolution_note, resolution_at = excluded.resolution_at, "
    "resolution_by = excluded.resolution_by, changed = excluded.changed{where} RETURNING 1"
)
_FIRST_ONLY = (
    " WHERE run_marks.resolution_at IS NULL "
    "OR run_marks.resolution_at <= COALESCE(run_marks.orphaned_at, run_marks.cleared)"
)
# An outbox row's claim lasts while its replica lives (its presence lock, below); this
# is the backstop for a replica alive but stuck, whose connection still holds the lock.
CLAIM_TTL_S = 120.0
# pg_advisory_lock(int4, int4) class of the presence locks: each alert store holds one
# (this class, a random key) on a connection of its own. A replica that dies loses it
# with its sessions, so its claims are free at once, not after CLAIM_TTL_S.
_PRESENCE_LOCK = 0x5A6A_0003
# The presence keys held now, as text (a claim's claimed_by is "<key>@<store>").
_LIVE_KEYS = (
    "ARRAY(SELECT l.objid::text FROM pg_locks l WHERE l.locktype = 'advisory' "
    "AND l.classid = %(ns)s::oid AND l.objsubid = 2 AND l.granted AND l.database = "
    "(SELECT oid FROM pg_database WHERE datname = current_database()))"
)
# A claim whose send has begun ("send:<key>@<store>", see PgAlertStore.sending) holds
# its row until claimed_until alone: a request in flight goes on when its replica's
# presence connection is cut, and the database cannot tell that from a dead replica.
_SENDING = "send:"
# Whether another store's claim has let row {o} go (an expression over alert_outbox {o}
# and the CTE live): never claimed or released, past its time (the database's clock),
# or not yet sending and its store's presence lock is gone.
_CLAIM_FREE = (
    "({o}.claimed_until IS NULL OR {o}.claimed_until < extract(epoch FROM clock_timestamp()) "
    "OR (NOT starts_with({o}.claimed_by, %(sending)s) "
    "AND split_part({o}.claimed_by, '@', 1) <> ALL(live.keys)))"
)
# This store's claim on row {o}, whatever presence key it was made under (see _take_presence).
_OURS = "split_part({o}.claimed_by, '@', 2) = %(store)s"


def _changes(
    spans: list[StoredSpan],
    owners: list[Any],
    instances: list[HeardRow],
    marks: list[Any],
    leases: list[Lease],
) -> Changes:
    """Rows read with ``OWNER_ROW`` and ``MARK_ROW`` (or ``_MARK_CHANGES``), and the
    leases (``_to_replica``), as ``Changes``."""
    return Changes(spans, owners_from_rows(owners), instances, [RunMark(*m) for m in marks], leases)


def _to_replica(rows: Iterable[Any], now: float) -> list[Lease]:
    """Lease rows read with ``_LEASE_AT`` (the database's clock last) as leases on the
    clock of the replica that read ``now`` just before: each time moved by the two
    clocks' difference (``_DB_NOW``, above)."""
    return [lease_from_row(row[:-1]).moved(now - float(row[-1])) for row in rows]


def _full_xid(xid: int, xmax: int) -> int:
    """A row's ``xmin`` (the 32-bit id of the transaction that wrote it) as the 64-bit
    change number ``pg_current_xact_id`` gave that transaction, from the 64-bit xmax of the
    snapshot that saw the row: the transaction began below it, less than 2^31 ids back
    (PostgreSQL's wraparound guard), and freezing keeps ``xmin`` as it was."""
    return xmax - ((xmax - xid) & 0xFFFF_FFFF)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _columns(rows: Sequence[Sequence[object]], width: int) -> list[list[object]]:
    """Rows as ``width`` column lists (parameters of one ``unnest`` insert)."""
    return [[row[i] for row in rows] for i in range(width)]


def lock_key(text: str) -> int:
    """A signed 64-bit advisory lock key for ``text``."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), signed=True)


def _password(target: DbTarget) -> str | None:
    try:
        parts = urlsplit(target.url or "")
    except ValueError:
        return None
    found = parts.password
    for pair in parts.query.split("&"):
        key, _, value = pair.partition("=")
        if key.lower() == "password" and value:
            found = value
    return found


def _where(target: DbTarget) -> str:
    try:
        parts = urlsplit(target.url or "")
        host = parts.hostname or "localhost"
        port = parts.port or 5432
    except ValueError:
        return target.shown
    return f"{host}:{port}{parts.path or '/'}"


def scrub(target: DbTarget, exc: BaseException) -> str:
    """The first line of ``exc``'s message, without the password (libpq may echo the URL)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    secret = _password(target)
    if secret:
        text = text.replace(secret, "***")
    if target.url:
        text = text.replace(target.url, target.shown)
    return text


def _psycopg() -> Any:
    try:
        import psycopg
        import psycopg_pool
    except ImportError as exc:
        raise StoreError(
            f"--db names PostgreSQL but its driver is not installed ({exc.name}): {INSTALL_HINT}"
        ) from exc
    return psycopg, psycopg_pool


def connect_error(target: DbTarget, exc: BaseException) -> StoreError:
    fix = "check the URL given with --db (SAGA_SIDECAR_DB) and that the server is up"
    if any(text in str(exc) for text in _NO_SLOT):
        # The server is up and the URL right: it has no connection left to give.
        fix = (
            "the server has no connection slot left: raise max_connections in its "
            "postgresql.conf (or the CONNECTION LIMIT of the role or database the error "
            f"names) or close clients you do not need; each sidecar holds up to "
            f"{CONNECTIONS_EACH} connections"
        )
    return StoreError(
        f"cannot connect to PostgreSQL at {_where(target)} ({target.shown}): "
        f"{scrub(target, exc)}; {fix}"
    )


def _open_pool(target: DbTarget, max_size: int, name: str) -> Any:
    """An open pool on ``target``, after one direct connection (for a clear error) and the
    schema migration. Raises StoreError naming the host and what failed."""
    psycopg, psycopg_pool = _psycopg()
    try:
        with psycopg.connect(target.url, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            check_version(conn.info.server_version, target)
            migrate(conn, target)
    except psycopg.Error as exc:
        raise connect_error(target, exc) from None
    pool = psycopg_pool.ConnectionPool(
        target.url,
        min_size=1,
        max_size=max_size,
        kwargs={"connect_timeout": CONNECT_TIMEOUT_S},
        check=psycopg_pool.ConnectionPool.check_connection,
        name=name,
        timeout=POOL_WAIT_S,
        open=False,
    )
    try:
        pool.open(wait=True, timeout=CONNECT_TIMEOUT_S * 2)
    except psycopg_pool.PoolTimeout as exc:
        pool.close()
        raise connect_error(target, exc) from None
    return pool


def check_version(version: int, target: DbTarget) -> None:
    """Refuse a server too old for what replicas rely on, before the schema is touched."""
    if version < MIN_SERVER_VERSION:
        # server_version_num: 130012 is 13.12; before 10, 90624 is 9.6.24.
        shown = (
            f"{version // 10000}.{version % 10000}"
            if version >= 100000
            else f"{version // 10000}.{version // 100 % 100}.{version % 100}"
        )
        raise StoreError(
            f"PostgreSQL at {_where(target)} is version {shown}; the sidecar needs "
            f"{MIN_SERVER_VERSION // 10000} or newer (leader hand-over and replica sync rely "
            "on it): upgrade the server, or run one sidecar on SQLite (--db PATH)"
        )


def migrate(conn: Any, target: DbTarget) -> int:
    """Bring the database to SCHEMA_VERSION in one transaction; the version found."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        found = int(row[0]) if row is not None else 0
        if found > SCHEMA_VERSION:
            raise StoreError(newer_schema_message(_where(target), found))
        for version in range(found + 1, SCHEMA_VERSION + 1):
            for statement in _statements(_STEPS[version]):
                conn.execute(statement)
        if found != SCHEMA_VERSION:
            conn.execute(
                "INSERT INTO meta(key, value) VALUES ('schema', %s) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(SCHEMA_VERSION),),
            )
    if 0 < found < SCHEMA_VERSION:
        log.info(
            "sidecar.db.upgraded", db=target.shown, from_schema=found, to_schema=SCHEMA_VERSION
        )
    return found


class _Pooled:
    """A pool and the errors of its users, shown without the password."""

    inline = False
    placeholder: ClassVar[str] = "%s"

    def __init__(self, target: DbTarget, max_size: int, name: str) -> None:
        self.target = target
        self._psycopg, _ = _psycopg()
        self._pool = _open_pool(target, max_size, name)

    def close(self) -> None:
        self._pool.close()

    @contextlib.contextmanager
    def _tx(self, what: str) -> Iterator[Any]:
        """A connection in a transaction (committed on leaving); StoreError on failure."""
        try:
            with self._pool.connection() as conn:
                yield conn
        except self._psycopg.Error as exc:
            raise StoreError(
                f"could not {what} in PostgreSQL at {_where(self.target)}: "
                f"{scrub(self.target, exc)}"
            ) from None
        except Exception as exc:
            if type(exc).__module__.startswith("psycopg_pool"):  # PoolTimeout, PoolClosed
                raise StoreError(
                    f"could not {what} in PostgreSQL at {_where(self.target)}: "
                    f"{scrub(self.target, exc)}"
                ) from None
            raise

    def _all(self, sql: str, args: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        with self._tx("read") as conn:
            return list(conn.execute(sql, args).fetchall())


class PgStore(_Pooled):
    """The run store on PostgreSQL (see :class:`sidecar._storage.Store`)."""

    def __init__(self, target: DbTarget) -> None:
        super().__init__(target, max_size=STORE_POOL, name="saga-sidecar-store")
        self._seq = 0  # the newest span sequence number folded in
        self._own: set[int] = set()  # sequence numbers of spans this process wrote
        # Missing sequence numbers -> the xmax of the read that found them: given up once
        # a read begins with its xmin at or past it (see GAP_WINDOW).
        self._gaps: dict[int, int] = {}
        self._gaps_capped = False  # MAX_GAPS reached (logged once until below again)
        self._floor = 0  # the change number the next changes() reads from (_XMIN)
        # (table, key) -> change number of the rows read (or, heartbeats, written here:
        # folded already) at or above the floor: a read returns them again, folded once.
        self._versions: dict[tuple[str, str], int] = {}
        self._lead: Any = None  # the connection holding the leader lock
        self._leading = False

    def close(self) -> None:
        if self._lead is not None:
            with contextlib.suppress(Exception):
                self._lead.close()
            self._lead = None
        super().close()

    def try_lead(self, hold: float) -> bool:
        """The session advisory lock on its own connection: held while the connection lives,
        so a replica that dies (or loses the database) hands it on. The server ends the
        session once it has been idle ``hold`` seconds (idle_session_timeout, on the
        database's clock), so a replica paused, or cut off with no FIN, hands it on too;
        the leader asks on every tick, and a replica that lost it learns so before it
        judges (the ``SELECT 1``)."""
        psycopg = self._psycopg
        try:
            if self._lead is None or self._lead.closed:
                self._leading = False
                self._lead = psycopg.connect(
                    self.target.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
                )
                self._lead.execute(
                    "SELECT set_config('idle_session_timeout', %s, false)",
                    (str(max(1, round(hold * 1000))),),
                )
            if self._leading:
                self._lead.execute("SELECT 1")
                return True
            row = self._lead.execute("SELECT pg_try_advisory_lock(%s)", (_LEADER_LOCK,)).fetchone()
            self._leading = bool(row and row[0])
            if self._leading:
                log.info("sidecar.leader.taken", db=_where(self.target), hold_s=hold)
        except psycopg.Error as exc:
            log.warning(
                "sidecar.leader.lost", db=_where(self.target), error=scrub(self.target, exc)
            )
            with contextlib.suppress(Exception):
                self._lead.close()
            self._lead, self._leading = None, False
        return self._leading

    def changes(self, now: float) -> Changes:
        with self._tx("read what other replicas stored") as conn:
            ((floor,),) = conn.execute(_XMIN).fetchall()  # before any read: see _XMIN
            # xmin: the span's change number (as its run's marks carry theirs), so an orphan
            # mark is ordered against the spans of its run by the database, not by clocks.
            rows = conn.execute(
                "SELECT seq, run_id, span_id, service, instance, data, xmin::text::bigint, "
                f"{_XMAX} FROM spans WHERE seq > %s OR seq = ANY(%s) ORDER BY seq LIMIT %s",
                (self._seq, list(self._gaps), SYNC_BATCH),
            ).fetchall()
            spans = []
            for seq, run_id, span_id, service, instance, data, xid, xmax in rows:
                self._gaps.pop(seq, None)
                if seq > self._seq:
                    for missing in range(self._seq + 1, seq):
                        self._gaps[missing] = int(xmax)
                    self._seq = seq
                if seq in self._own:
                    self._own.discard(seq)
                    continue
                changed = _full_xid(int(xid), int(xmax))
                spans.append(StoredSpan(run_id, span_id, service, instance, bytes(data), changed))
            # Every number up to the last row read was looked up (a full batch stops there).
            read_to = rows[-1][0] if len(rows) == SYNC_BATCH else self._seq
            self._give_up_gaps(int(floor), read_to)
            run_ids = sorted({s.run_id for s in spans})
            owners = conn.execute(OWNER_ROW + " WHERE run_id = ANY(%s)", (run_ids,)).fetchall()
            instances, marks, leases = (
                self._unseen(table, conn.execute(select, (self._floor,)).fetchall())
                for table, select in (
                    ("instances", _INSTANCE_CHANGES),
                    ("run_marks", _MARK_CHANGES),
                    ("run_leases", _LEASE_CHANGES),
                )
            )
        self._versions = {k: n for k, n in self._versions.items() if n >= floor}
        self._floor = int(floor)
        heard = [
            (str(i), float(a), float(s), str(r or "[]"), int(n)) for i, a, s, r, n in instances
        ]
        return _changes(spans, owners, heard, marks, _to_replica((r[:-1] for r in leases), now))

    def _give_up_gaps(self, floor: int, read_to: int) -> None:
        """Forget the gaps up to ``read_to`` whose holders had all ended as the read began
        (``floor``, its xmin, at or past the xmax of the read that found them): not read
        now, they were burnt. Then keep at most MAX_GAPS, giving up the lowest."""
        gaps = {g: x for g, x in self._gaps.items() if x > floor or g > read_to}
        if len(gaps) > MAX_GAPS:
            lowest = sorted(gaps)[: len(gaps) - MAX_GAPS]
            if not self._gaps_capped:
                log.warning(
                    "sidecar.sync.gaps_dropped",
                    db=_where(self.target),
                    dropped=len(lowest),
                    below=lowest[-1] + 1,
                    oldest_running_xid=floor,
                    hint="a transaction has stayed open for long (see pg_stat_activity "
                    "'idle in transaction' and pg_prepared_xacts): spans it stores are "
                    "not read by this replica until it restarts",
                )
            for g in lowest:
                del gaps[g]
        self._gaps_capped = len(gaps) >= MAX_GAPS
        self._gaps = gaps

    def _unseen(self, table: str, rows: list[Any]) -> list[Any]:
        """Rows (key first, change number last) not read before."""
        versions = self._versions
        out = []
        for row in rows:
            key, number = (table, str(row[0])), int(row[-1])
            if versions.get(key) != number:
                versions[key] = number
                out.append(row)
        return out

    def schema_version(self) -> int:
        ((value,),) = self._all("SELECT value FROM meta WHERE key = 'schema'")
        return int(value)

    def write(
        self,
        spans: Sequence[SpanRow],
        heartbeats: Sequence[HeartbeatRow] = (),
        owners: Sequence[tuple[str, Owner]] = (),
    ) -> None:
        with self._tx("store spans") as conn, conn.cursor() as cur:
            self._insert(cur, spans, heartbeats, owners)

    def write_screened(
        self,
        keys: Sequence[tuple[str, str]],
        openers: Sequence[tuple[str, Owner]],
        now: float,
        decide: Callable[[Screening], tuple[IntakeRows, T]],
    ) -> tuple[T, int]:
        """The runs' owner rows are the lock: a new run's is inserted first (a replica
        inserting the same one waits for our commit, then finds ours), then every row is
        locked FOR UPDATE in run id order (lease decisions take the same lock), so two
        requests of one run, at any replicas, are screened and stored one after the other.
        A deadlock (rows locked in different orders by a lease and an intake) aborts one
        transaction: a 503, and the exporter sends again."""
        run_ids = sorted({r for r, _ in keys})
        with self._tx("store spans") as conn, conn.cursor() as cur:
            opened: set[str] = set()
            if openers:
                ordered = sorted(openers)
                cur.execute(
                    "INSERT INTO run_owners(run_id, trace_id, instance, service) "
                    "SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[]) "
                    "ON CONFLICT (run_id) DO NOTHING RETURNING run_id",
                    _columns([(r, o.trace_id, o.instance, o.service) for r, o in ordered], 4),
                )
                opened.update(str(r) for (r,) in cur.fetchall())
            found = Screening({}, {}, {}, frozenset(opened))
            if run_ids:
                found = self._screening(conn, keys, run_ids, now)
                found = found._replace(opened=frozenset(opened))
            rows, result = decide(found)
            unused = opened - {row[0] for row in rows.spans}
            if unused:  # every span of the run was refused: it was never opened
                cur.execute("DELETE FROM run_owners WHERE run_id = ANY(%s)", (sorted(unused),))
            return result, self._insert(cur, rows.spans, rows.heartbeats, rows.owners)

    def _insert(
        self,
        cur: Any,
        spans: Sequence[SpanRow],
        heartbeats: Sequence[HeartbeatRow],
        owners: Sequence[tuple[str, Owner]],
    ) -> int:
        """Store the rows; their change number, which the sidecar keeps with what it folds
        of them (0: no span and no heartbeat stored). Not the transaction's id but the
        first id not yet given out as its last write began (``_XMAX``): every transaction
        that had its id by then came before it, an orphan mark's included, though a
        COMMIT waiting on a lock may have taken its own id long before that mark's."""
        change = 0
        # One statement per table (arrays through unnest): one round trip each, however
        # many requests a group commit brings. Parameters in binary (%b): no text
        # escaping of the span bytes, half the insert's time at 4k spans.
        if owners:
            cur.execute(
                "INSERT INTO run_owners(run_id, trace_id, instance, service) "
                "SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[]) "
                "ON CONFLICT (run_id) DO NOTHING",
                _columns([(r, o.trace_id, o.instance, o.service) for r, o in owners], 4),
            )
        if spans:
            # In array order: of two rows with one key, the first is stored (DO NOTHING).
            # The transaction takes its xid (pg_current_xact_id, a one-time filter run
            # before the first row's default nextval) before any sequence number: a
            # transaction gets one at its first write, and this may be it (nothing may
            # be written or locked before: write(), a screening that locked no row),
            # while a row's nextval (its default) comes before its heap write, so the
            # first number would be taken with no xid. A replica gives a gap up once
            # every transaction with an xid
            # from before the gap was seen has ended (see GAP_WINDOW): a holder of a
            # number with no xid yet would be given up while it could still commit.
            cur.execute(
                "INSERT INTO spans(run_id, span_id, received_at, service, instance, data) "
                "SELECT * FROM unnest(%b::text[], %b::text[], %b::float8[], %b::text[], "
                "%b::text[], %b::bytea[]) WHERE pg_current_xact_id() IS NOT NULL "
                f"ON CONFLICT (run_id, span_id) DO NOTHING RETURNING seq, {_XMAX}",
                _columns(spans, 6),
            )
            for seq, xmax in cur.fetchall():
                self._own.add(seq)  # in our state already: changes() skips them
                change = int(xmax)
        if heartbeats:
            rows = merge_heartbeats(heartbeats)
            cur.execute(_STORE_HEARTBEATS, _columns(rows, 7))
            merged = {row[0]: row[6] for row in rows}
            for instance, number, held, xmax in cur.fetchall():
                # Ours are in our state already: changes() skips them (as our own spans);
                # not a row that joined parts of its beat stored before, maybe by another
                # replica: read back, it names their runs too.
                if held is None or held <= merged[instance]:
                    self._versions["instances", str(instance)] = int(number)
                change = int(xmax)
        return change

    def mark_orphaned(self, marks: Iterable[tuple[str, float]]) -> None:
        rows = list(marks)
        if rows:
            with self._tx("store orphan marks") as conn, conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO run_marks(run_id, orphaned_at) VALUES (%s, %s) "
                    "ON CONFLICT (run_id) DO UPDATE SET orphaned_at = excluded.orphaned_at, "
                    "cleared = NULL, changed = excluded.changed",
                    rows,
                )

    def clear_orphaned(self, marks: Iterable[tuple[str, float]]) -> None:
        rows = list(marks)
        if rows:
            with self._tx("clear orphan marks") as conn, conn.cursor() as cur:
                cur.executemany(
                    "UPDATE run_marks SET cleared = orphaned_at, orphaned_at = NULL, "
                    f"changed = {_CHANGED} WHERE run_id = %s AND orphaned_at = %s",
                    rows,
                )

    def clear_resolutions(self, lapsed: Iterable[tuple[str, float]]) -> None:
        rows = list(lapsed)
        if rows:
            with self._tx("clear lapsed resolutions") as conn, conn.cursor() as cur:
                cur.executemany(
                    "UPDATE run_marks SET resolution_note = NULL, resolution_at = NULL, "
                    f"resolution_by = NULL, changed = {_CHANGED} "
                    "WHERE run_id = %s AND resolution_at = %s",
                    rows,
                )

    def resolve(self, run_id: str, wanted: Resolution, *, replace: bool = False) -> Resolution:
        # One statement decides, on the row's newest version (ON CONFLICT reads and locks
        # it, committed or waited for): two replicas resolving at once cannot both write.
        # The row's change number moves with it: the other replicas read it (changes()).
        with self._tx("store the resolution") as conn:
            written = conn.execute(
                _RESOLVE.format(where="" if replace else _FIRST_ONLY),
                (run_id, wanted.note, wanted.at, wanted.by),
            ).fetchone()
            if written is not None:
                return wanted
            # Not written: a resolution stands, its row locked by the statement above
            # until commit. Read in a statement of its own: the one above's snapshot may
            # predate the commit that wrote it.
            row = conn.execute(
                "SELECT resolution_note, resolution_at, resolution_by FROM run_marks "
                "WHERE run_id = %s",
                (run_id,),
            ).fetchone()
            return Resolution(str(row[0]), float(row[1]), row[2])

    def delete_runs(self, run_ids: list[str]) -> None:
        if run_ids:
            with self._tx("prune runs") as conn:
                for table in ("spans", "run_marks", "run_owners", "run_leases", "run_index"):
                    conn.execute(f"DELETE FROM {table} WHERE run_id = ANY(%s)", (run_ids,))
                self._prune_alerts(conn, run_ids)

    def delete_instances(self, instances: list[str]) -> None:
        if instances:
            with self._tx("prune instances") as conn:
                conn.execute("DELETE FROM instances WHERE instance = ANY(%s)", (instances,))

    def decide_lease(
        self, run_id: str, now: float, decide: Callable[[Lease | None], Lease | LeaseRefusal]
    ) -> Lease | LeaseRefusal:
        """Under a per-run advisory lock held to commit: no replica grants in between. The
        lease is judged on the database's clock, read once the lock is held: ``decide``
        sees it moved onto the caller's clock at ``now`` (``_to_replica``), and what it
        decides is moved back by the same difference, so its expiry is ``now`` plus the
        time to live on the database's clock whichever replica wrote it."""
        with self._tx("update the lease") as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(f"lease:{run_id}"),))
            # The run's row lock too: no span of it is screened while its lease changes.
            conn.execute("SELECT 1 FROM run_owners WHERE run_id = %s FOR UPDATE", (run_id,))
            ((db_now,),) = conn.execute(f"SELECT {_DB_NOW}").fetchall()
            row = conn.execute(LEASE_ROW + " WHERE run_id = %s", (run_id,)).fetchone()
            ahead = now - float(db_now)  # the caller's clock against the database's
            outcome = decide(None if row is None else lease_from_row(row).moved(ahead))
            if isinstance(outcome, Lease):
                stored = outcome.moved(-ahead)
                o = stored.override
                conn.execute(
                    "INSERT INTO run_leases(run_id, holder, token, granted_at, expires_at, "
                    "released, forced_reason, forced_by, forced_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id) DO UPDATE "
                    "SET holder = excluded.holder, token = excluded.token, "
                    "granted_at = excluded.granted_at, expires_at = excluded.expires_at, "
                    "released = excluded.released, forced_reason = excluded.forced_reason, "
                    "forced_by = excluded.forced_by, forced_at = excluded.forced_at, "
                    "changed = excluded.changed",
                    (
                        run_id,
                        stored.holder,
                        stored.token,
                        stored.granted_at,
                        stored.expires_at,
                        stored.released,
                        o.reason if o else None,
                        o.by if o else None,
                        o.at if o else None,
                    ),
                )
            return outcome

    def spans(self) -> Iterator[StoredSpan]:
        with self._tx("read spans") as conn, conn.cursor(name="saga_spans") as cur:
            # What a start reads of the marks comes after this: changes() reads on from
            # here (the marks folded twice are the same).
            ((floor,),) = conn.execute(_XMIN).fetchall()
            self._floor, self._versions = int(floor), {}
            # Later changes() read on from the newest number; numbers missing just below
            # it may belong to transactions still open: they are looked up again until
            # those have ended (as changes() does, from this read's xmax).
            # (All spans count here, those of runs put away too: they are not missing.)
            found = conn.execute(
                f"SELECT seq, {_XMAX} FROM spans WHERE seq > "
                "(SELECT coalesce(max(seq), 0) FROM spans) - %s",
                (GAP_WINDOW,),
            ).fetchall()
            recent = {int(seq) for seq, _ in found}
            xmax = int(found[0][1]) if found else 0
            cur.itersize = 2000
            cur.execute(
                SPAN_ROW + " WHERE " + NOT_PUT_AWAY.format(table="spans") + " ORDER BY run_id"
            )
            for row in cur:
                yield span_from_row(row)
            newest = max(recent, default=self._seq)
            low = max(self._seq, newest - GAP_WINDOW)
            self._gaps = {g: xmax for g in range(low + 1, newest) if g not in recent}
            self._seq = max(self._seq, newest)

    def stored_spans(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], bytes]:
        pairs = list(keys)
        if not pairs:
            return {}
        rows = self._all(
            "SELECT s.run_id, s.span_id, s.data FROM spans s "
            "JOIN unnest(%s::text[], %s::text[]) AS k(run_id, span_id) "
            "ON s.run_id = k.run_id AND s.span_id = k.span_id",
            ([r for r, _ in pairs], [s for _, s in pairs]),
        )
        return {(r, s): bytes(d) for r, s, d in rows}

    @staticmethod
    def _screening(
        conn: Any, keys: Sequence[tuple[str, str]], run_ids: list[str], now: float
    ) -> Screening:
        """The runs' owners (their rows locked until commit), leases (on the caller's clock
        at ``now``) and stored spans."""
        owners = conn.execute(
            OWNER_ROW + " WHERE run_id = ANY(%b::text[]) ORDER BY run_id FOR UPDATE", (run_ids,)
        ).fetchall()
        leases = conn.execute(_LEASE_AT + " WHERE run_id = ANY(%b::text[])", (run_ids,))
        stored = conn.execute(
            "SELECT s.run_id, s.span_id, s.data FROM spans s "
            "JOIN unnest(%b::text[], %b::text[]) AS k(run_id, span_id) "
            "ON s.run_id = k.run_id AND s.span_id = k.span_id",
            ([r for r, _ in keys], [s for _, s in keys]),
        ).fetchall()
        return Screening(
            dict(owners_from_rows(owners)),
            {lease.run_id: lease for lease in _to_replica(leases, now)},
            {(r, s): bytes(d) for r, s, d in stored},
        )

    def marks(self) -> list[RunMark]:
        rows = self._all(MARK_ROW + " WHERE " + NOT_PUT_AWAY.format(table="run_marks"))
        return [RunMark(*row) for row in rows]

    def instances(self) -> list[InstanceRow]:
        rows = self._all("SELECT instance, last_heartbeat, interval_s FROM instances")
        return [(str(a), float(b), float(c)) for a, b, c in rows]

    def owners(self) -> list[tuple[str, Owner]]:
        return owners_from_rows(self._all(HELD_OWNER_ROWS))

    def leases(self, now: float) -> list[Lease]:
        rows = self._all(_LEASE_AT + " WHERE " + NOT_PUT_AWAY.format(table="run_leases"))
        return _to_replica(rows, now)

    def clock_stepped(self, step: float) -> None:
        """Nothing to move: lease times are on the database's clock (``_DB_NOW``)."""

    # --- finished runs put away from memory -----------------------------------------

    def put_away(self, rows: Sequence[PutAway]) -> None:
        if rows:
            with self._tx("index finished runs") as conn, conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO run_index(run_id, started_at, status, saga, last_seen) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (run_id) DO UPDATE SET "
                    "started_at = excluded.started_at, status = excluded.status, "
                    "saga = excluded.saga, last_seen = excluded.last_seen",
                    sorted(rows),  # index rows locked in run id order too (replicas)
                )
                conn.execute(_FLAG_HELD, (1, sorted(r.run_id for r in rows)))

    def put_away_of(self, run_ids: Sequence[str]) -> set[str]:
        if not run_ids:
            return set()
        rows = self._all("SELECT run_id FROM run_index WHERE run_id = ANY(%s)", (list(run_ids),))
        return {str(r) for (r,) in rows}

    def load_runs(self, run_ids: Sequence[str], now: float, *, reopen: bool = False) -> Changes:
        ids = sorted(set(run_ids))
        with self._tx("read runs") as conn:
            spans, owners, marks, leases = (
                conn.execute(select + " WHERE run_id = ANY(%s)" + order, (ids,)).fetchall()
                for select, order in (
                    (SPAN_ROW, " ORDER BY run_id"),
                    (OWNER_ROW, ""),
                    (MARK_ROW, ""),
                    (_LEASE_AT, ""),
                )
            )
            if reopen:
                conn.execute("UPDATE run_index SET status = NULL WHERE run_id = ANY(%s)", (ids,))
                conn.execute(_FLAG_HELD, (0, ids))
        spans_read = [span_from_row(row) for row in spans]
        return _changes(spans_read, owners, [], marks, _to_replica(leases, now))

    def put_away_page(self, query: RunQuery, limit: int) -> list[tuple[str, float]]:
        sql, args = put_away_page_sql(query, limit, "%s")
        return [(str(r), float(t)) for r, t in self._all(sql, args)]

    def prune_put_away(self, before: float, limit: int = PRUNE_BATCH) -> int:
        with self._tx("prune finished runs") as conn:
            # SKIP LOCKED: replicas pruning at once take different batches, not turns.
            rows = conn.execute(
                "DELETE FROM run_index WHERE run_id IN (SELECT run_id FROM run_index "
                "WHERE last_seen < %s AND status IS NOT NULL ORDER BY last_seen LIMIT %s "
                "FOR UPDATE SKIP LOCKED) RETURNING run_id",
                (before, limit),
            ).fetchall()
            run_ids = [str(r) for (r,) in rows]
            for table in ("spans", "run_marks", "run_owners", "run_leases"):
                conn.execute(f"DELETE FROM {table} WHERE run_id = ANY(%s)", (run_ids,))
            self._prune_alerts(conn, run_ids)
        return len(run_ids)

    def _prune_alerts(self, conn: Any, run_ids: list[str]) -> None:
        if run_ids:
            with conn.cursor() as cur:
                cur.executemany(sql(self, PRUNE_RUN_ALERTS), [(r, r) for r in run_ids])

    def span_count(self) -> int:
        ((n,),) = self._all("SELECT count(*) FROM spans")
        return int(n)

    def instance_count(self) -> int:
        ((n,),) = self._all("SELECT count(*) FROM instances")
        return int(n)


class _PgAlertTx:
    placeholder: ClassVar[str] = "%s"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def fires(self, dedup_key: str) -> list[tuple[str, str, str]]:
        rows = self._conn.execute(
            "SELECT sink, event, state FROM alert_outbox WHERE dedup_key = %s "
            "AND action = 'fire' ORDER BY id",
            (dedup_key,),
        ).fetchall()
        return [(str(a), str(b), str(c)) for a, b, c in rows]

    def keys(self, alertname: str, run_id: str) -> list[tuple[str, str]]:
        rows = self._conn.execute(
            "SELECT DISTINCT dedup_key, action FROM alert_outbox WHERE run_id = %s "
            "AND alertname = %s",
            (run_id, alertname),
        ).fetchall()
        return [(str(k), str(a)) for k, a in rows]

    def insert(self, row: NewAlert) -> bool:
        cur = self._conn.execute(
            "INSERT INTO alert_outbox (dedup_key, action, sink, alertname, run_id, event, "
            "state, created_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (dedup_key, action, sink) DO NOTHING",
            tuple(row),
        )
        return bool(cur.rowcount)

    def retire(self, row_id: int, state: str, note: str, at: float) -> None:
        self._conn.execute(sql(self, RETIRE), (state, note, at, row_id))

    def hold_again(self, dedup_key: str, action: str, sink: str) -> None:
        self._conn.execute(sql(self, HOLD_AGAIN), (dedup_key, action, sink))

    def set_event(self, row_id: int, event: str) -> None:
        self._conn.execute(sql(self, SET_EVENT), (event, row_id))

    def resolve_fire(self, dedup_key: str, sink: str, at: float) -> None:
        self._conn.execute(sql(self, RESOLVE_FIRE), (at, dedup_key, sink))


class PgAlertStore(OutboxReads, _Pooled):
    """The alert outbox's rows on PostgreSQL (see :class:`sidecar._storage.AlertStore`)."""

    def __init__(self, target: DbTarget) -> None:
        super().__init__(target, max_size=OUTBOX_POOL, name="saga-sidecar-outbox")
        self._key = ""  # the presence lock's key, as text; "" while none is held
        self._presence: Any = None  # the connection holding it
        # This store in its claims ("<key>@<who>"): its process, and a nonce for two
        # stores of one process; unlike the key, it outlives a lost presence lock.
        self._who = f"{socket.gethostname()}:{os.getpid()}/{secrets.token_hex(4)}"
        # Taken now, well before the first claim (other replicas judge claims by it).
        with contextlib.suppress(StoreError):
            self._take_presence()

    def close(self) -> None:
        self._drop_presence()
        super().close()

    def _drop_presence(self) -> None:
        if self._presence is not None:
            with contextlib.suppress(Exception):
                self._presence.close()
            self._presence, self._key = None, ""

    def _args(self, **more: object) -> dict[str, object]:
        """The parameters every claim statement names (see _CLAIM_FREE, _OURS), and more."""
        return {
            "me": f"{self._key}@{self._who}",
            "store": self._who,
            "sending": _SENDING,
            "ns": _PRESENCE_LOCK,
            **more,
        }

    @contextlib.contextmanager
    def transaction(self) -> Iterator[AlertTx]:
        with self._tx("write alerts to the outbox") as conn:
            yield _PgAlertTx(conn)

    def _take_presence(self) -> None:
        """Hold a presence lock of our own on a connection of its own (a new one), and
        move this store's claims on pending rows to it: claims made under a lock lost with
        its connection (a database restart, idle_session_timeout) would look like a dead
        replica's, and another replica would take a row this one holds back for a retry."""
        psycopg = self._psycopg
        self._drop_presence()
        conn = None
        try:
            conn = psycopg.connect(
                self.target.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
            )
            while True:  # a key another store holds (1 in 2**31): draw again
                key = secrets.randbelow(2**31 - 1) + 1
                row = conn.execute(
                    "SELECT pg_try_advisory_lock(%s, %s)", (_PRESENCE_LOCK, key)
                ).fetchone()
                if row and row[0]:
                    break
            conn.execute(
                "UPDATE alert_outbox SET claimed_by = CASE WHEN starts_with(claimed_by, "
                "%(sending)s) THEN %(sending)s ELSE '' END || %(key)s || '@' || %(store)s "
                f"WHERE state = %(pending)s AND {_OURS.format(o='alert_outbox')}",
                self._args(key=str(key), pending=PENDING),
            )
        except psycopg.Error as exc:
            if conn is not None:  # connected, but the lock failed: no session left open
                with contextlib.suppress(Exception):
                    conn.close()
            raise StoreError(
                f"could not take the outbox's presence lock in PostgreSQL at "
                f"{_where(self.target)}: {scrub(self.target, exc)}"
            ) from None
        self._presence, self._key = conn, str(key)

    def next_row(self, sink: str, state: str) -> OutboxRecord | None:
        """Claim the next row: rows locked by another replica's claim are skipped (SKIP
        LOCKED), and so are rows another replica holds (see _CLAIM_FREE). A store claims
        only while its own presence lock is seen held: others must never take its claims
        for a dead one's."""
        present, row = self._claim(sink, state)
        if not present:
            self._take_presence()  # lost with its connection (a restart of the database)
            present, row = self._claim(sink, state)
        return row

    def _claim(self, sink: str, state: str) -> tuple[bool, OutboxRecord | None]:
        """(whether our presence lock is held, the row claimed): one statement, so a
        store that finds nothing to claim learns in the same round trip whether it lost
        its lock (the one snapshot of pg_locks, ``live``, answers both)."""
        args = self._args(key=self._key, ttl=CLAIM_TTL_S, sink=sink, state=state)
        with self._tx("claim an alert") as conn:
            got = conn.execute(
                f"WITH live AS (SELECT {_LIVE_KEYS} AS keys), c AS ("
                "UPDATE alert_outbox SET claimed_by = %(me)s, claimed_until = "
                "extract(epoch FROM clock_timestamp()) + %(ttl)s WHERE id = ("
                "SELECT o.id FROM alert_outbox o, live WHERE %(key)s = ANY(live.keys) "
                "AND o.sink = %(sink)s AND o.state = %(state)s "
                f"AND ({_OURS.format(o='o')} OR {_CLAIM_FREE.format(o='o')}) "
                # Nor while an older row of its alert waits, or is being sent (a fire
                # re-sent to Alertmanager, see resending): a resolve goes after its fire.
                "AND NOT EXISTS (SELECT 1 FROM alert_outbox e WHERE e.sink = o.sink AND "
                "e.dedup_key = o.dedup_key AND e.id < o.id AND (e.state = %(state)s "
                f"OR NOT {_CLAIM_FREE.format(o='e')})) "
                "ORDER BY o.id LIMIT 1 FOR UPDATE OF o SKIP LOCKED) "
                "RETURNING id, dedup_key, action, sink, state, attempts, last_error, event) "
                "SELECT %(key)s = ANY(live.keys), c.* FROM live LEFT JOIN c ON true",
                args,
            ).fetchone()
        if got is None:  # never: live is one row
            return False, None
        return bool(got[0]), (OutboxRecord(*got[1:]) if got[1] is not None else None)

    def sending(self, row_id: int, seconds: float) -> bool:
        """Make this store's claim on a pending row a send's, for ``seconds`` (see
        _SENDING); False when the claim is no longer ours (another replica took the row
        over when it expired, and sends it) or the row is no longer pending."""
        with self._tx("claim an alert's send") as conn:
            cur = conn.execute(
                "UPDATE alert_outbox SET claimed_by = %(sending)s || %(me)s, claimed_until = "
                "extract(epoch FROM clock_timestamp()) + %(seconds)s WHERE id = %(id)s "
                f"AND state = %(pending)s AND {_OURS.format(o='alert_outbox')}",
                self._args(id=row_id, seconds=seconds, pending=PENDING),
            )
            return bool(cur.rowcount)

    def mark(
        self, row_id: int, state: str, error: str | None, sent: bool, now: float, hold: float = 0
    ) -> bool:
        with self._tx("update an alert") as conn:
            cur = conn.execute(
                "UPDATE alert_outbox SET state = %(state)s, attempts = attempts + 1, "
                "last_error = %(error)s, "
                "delivered_at = CASE WHEN %(sent)s THEN %(now)s ELSE delivered_at END, "
                "last_sent_at = CASE WHEN %(sent)s THEN %(now)s ELSE last_sent_at END, "
                "claimed_until = CASE WHEN %(hold)s > 0 THEN extract(epoch FROM "
                "clock_timestamp()) + %(hold)s END, "
                "claimed_by = CASE WHEN %(hold)s > 0 THEN %(me)s END "
                f"WHERE id = %(id)s AND {_OURS.format(o='alert_outbox')}",
                self._args(state=state, error=error, sent=sent, now=now, hold=hold, id=row_id),
            )
            return bool(cur.rowcount)

    def resending(self, row_id: int, due: float, seconds: float) -> bool:
        due_now = RESEND_DUE.format(state="%(delivered)s", due="%(due)s")
        with self._tx("claim an alert's re-send") as conn:
            cur = conn.execute(
                f"WITH live AS (SELECT {_LIVE_KEYS} AS keys) UPDATE alert_outbox SET "
                "claimed_by = %(sending)s || %(me)s, claimed_until = "
                "extract(epoch FROM clock_timestamp()) + %(seconds)s FROM live "
                f"WHERE id = %(id)s AND {due_now} AND ({_OURS.format(o='alert_outbox')} "
                f"OR {_CLAIM_FREE.format(o='alert_outbox')})",
                self._args(id=row_id, due=due, seconds=seconds, delivered=DELIVERED),
            )
            return bool(cur.rowcount)

    def touch_sent(self, row_id: int, at: float) -> None:
        with self._tx("update an alert") as conn:
            conn.execute(
                "UPDATE alert_outbox SET last_sent_at = %(at)s, claimed_by = NULL, "
                f"claimed_until = NULL WHERE id = %(id)s AND {_OURS.format(o='alert_outbox')}",
                self._args(at=at, id=row_id),
            )

    def history(self, run_id: str) -> list[HistoryRecord]:
        return pg_history(self.target, run_id)


def pg_history(target: DbTarget, run_id: str) -> list[HistoryRecord]:
    """The alert rows of one run, oldest first, on a short connection of its own."""
    psycopg, _ = _psycopg()
    try:
        with psycopg.connect(target.url, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            exists = conn.execute("SELECT to_regclass('alert_outbox')").fetchone()
            if exists is None or exists[0] is None:
                return []
            rows = conn.execute(
                "SELECT created_at, alertname, action, sink, state, attempts, last_error, event "
                "FROM alert_outbox WHERE run_id = %s ORDER BY id",
                (run_id,),
            ).fetchall()
    except psycopg.Error as exc:
        raise StoreError(
            f"cannot read the alert outbox in PostgreSQL at {_where(target)}: {scrub(target, exc)}"
        ) from None
    return [HistoryRecord(*r) for r in rows]
