"""The store interface: what the sidecar keeps in its database, whichever database it is.

Two backends implement it: SQLite (``_store.py``, the embedded default: one
machine, the demo, the tests) and PostgreSQL (``_pgstore.py``: any number of
sidecar replicas on one database). :func:`parse_db` turns ``--db`` into a
:class:`DbTarget`; ``_backends.py`` opens the backend it names (the PostgreSQL
driver is imported only then, so SQLite needs none).

A store is synchronous. ``inline`` says how the sidecar may call it: True
(SQLite, a local file) on the event loop as before; False (PostgreSQL, a
network round trip) only from a worker thread, never on the loop.

This module is a leaf: it imports only the pure ``_errors`` and ``_leases``, so
both backends and their users import it without a circle.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, TypeVar
from urllib.parse import urlsplit

from ._errors import ConfigError
from ._leases import Lease, LeaseRefusal, Owner

SCHEMA_VERSION = 8
"""The schema this sidecar writes. 1: the first (no outbox claims); 2: outbox claims;
3: the index of finished runs put away from memory (``run_index``); 4: the outbox's
fires marked ``resolved_at`` and its indexes on state and on the fires still firing;
5: the owners' ``put_away`` flag and its partial index (what a start folds); 6
(PostgreSQL; nothing on SQLite): change numbers on heartbeats, run marks and leases,
and the mark a clear ended, so replicas read every change by the database's order,
clears included, whatever their clocks say; 7: who resolved a run (``run_marks``'
``resolution_by``; NULL for the resolutions stored before, whose person is unknown);
8: the beat an instance's heartbeat row holds the runs of (``instances``' ``beat``,
``beat_parts``, ``beat_merged``), so the parts of one beat, stored apart, are unioned
(``merge_heartbeats``).

Opening an older database upgrades it in place; a newer one is refused
(``_store.py`` and ``_pgstore.py`` hold the steps, one per version).
"""
# Runs put away deleted per prune transaction: ~20-25 ms of SQLite on the event loop
# for runs of 10 spans (one transaction of 60,000 such runs held it ~3 s).
PRUNE_BATCH = 500
# Settled runs put away per batch by the evict loop: ~40 ms of the event loop (state
# and the SQLite write) where one pass over a saturated interval's ~40,000 held it ~0.8 s.
EVICT_BATCH = 2000

Backend = Literal["sqlite", "postgresql"]
POSTGRES_SCHEMES = ("postgresql", "postgres")
DB_FORMS = "a file path, sqlite:///PATH, or postgresql://USER@HOST:PORT/DB"


@dataclass(frozen=True, slots=True)
class DbTarget:
    """Where the sidecar's state lives: a SQLite file or a PostgreSQL URL.

    ``shown`` is what logs, errors and metrics may print: the URL without its
    password (and without any ``password=`` query parameter).
    """

    backend: Backend
    path: Path | None = None
    url: str | None = None

    @property
    def shown(self) -> str:
        if self.path is not None:
            return str(self.path)
        return redact_url(self.url or "")

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:  # never the password, whatever prints it
        return f"DbTarget({self.backend}, {self.shown!r})"


def redact_url(url: str) -> str:
    """``url`` with its password (user:PASSWORD@ and password=...) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable database URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}" if ":" in userinfo else f"{user}@{hostport}"
    query = "&".join(
        f"{k}=***" if k.lower() == "password" else p
        for p in parts.query.split("&")
        if p
        for k in [p.split("=", 1)[0]]
    )
    out = f"{parts.scheme}://{netloc}{parts.path}"
    return f"{out}?{query}" if query else out


def parse_db(text: str | Path) -> DbTarget:
    """A :class:`DbTarget` from ``--db``: a path, ``sqlite:///PATH`` or a PostgreSQL URL.

    Any other scheme is an error naming the supported forms (a URL must never
    turn into a file under a ``postgresql:`` folder).
    """
    if isinstance(text, Path):
        return DbTarget("sqlite", path=text)
    raw = text.strip()
    if not raw:
        raise ConfigError(f"--db is empty: give {DB_FORMS}")
    scheme, sep, rest = raw.partition("://")
    if not sep:
        if raw.lower().startswith(("sqlite:", "postgresql:", "postgres:")):
            raise ConfigError(f"--db {redact_url(raw)!r} is not a URL: give {DB_FORMS}")
        return DbTarget("sqlite", path=Path(raw).expanduser())
    scheme = scheme.lower()
    if scheme == "sqlite":
        # sqlite:///relative/... is not a thing: three slashes then an absolute path,
        # as SQLAlchemy writes it (sqlite:////abs is also accepted).
        if not rest.startswith("/") or rest == "/":
            raise ConfigError(
                f"--db {raw!r}: a SQLite URL is sqlite:/// then the path; give {DB_FORMS}"
            )
        path = rest[1:] if rest.startswith("//") else rest
        return DbTarget("sqlite", path=Path(path).expanduser())
    if scheme in POSTGRES_SCHEMES:
        parts = urlsplit(raw)
        if not parts.hostname and "host=" not in parts.query:
            raise ConfigError(
                f"--db {redact_url(raw)!r} names no host: write postgresql://USER@HOST:PORT/DB"
            )
        return DbTarget("postgresql", url=raw)
    raise ConfigError(
        f"--db {redact_url(raw)!r}: unsupported scheme {scheme + '://'!r}; give {DB_FORMS}"
    )


@dataclass(frozen=True, slots=True)
class StoredSpan:
    run_id: str
    span_id: str
    service: str
    instance: str
    data: bytes
    # Replicas (Store.changes): the change number of the transaction that stored it, in
    # the database's order of writes, not a clock (0: not read by change, as at a start).
    changed: int = 0


class Resolution(NamedTuple):
    """A person's resolution of a run: what they did or decided, when (the clock of the
    sidecar it was made through), and the name they gave (None: none given)."""

    note: str
    at: float
    by: str | None = None


@dataclass(frozen=True, slots=True)
class RunMark:
    run_id: str
    orphaned_at: float | None
    resolution_note: str | None
    resolution_at: float | None
    resolution_by: str | None  # who resolved it, as they named themselves (schema 7)
    # The orphan mark a clear ended (replicas: another one heard from the run).
    cleared: float | None = None
    # Replicas (Store.changes): the change number of the row's last change (0: not read
    # by change). A mark is ordered by it against the spans and heartbeats of its run.
    changed: int = 0


class Changes(NamedTuple):
    """What other processes on the same database committed since the last call."""

    spans: list[StoredSpan]
    owners: list[tuple[str, Owner]]
    instances: list[HeardRow]
    marks: list[RunMark]
    leases: list[Lease]


NO_CHANGES = Changes([], [], [], [], [])


class Screening(NamedTuple):
    """What the store holds about the runs of one request, for screening its spans."""

    owners: dict[str, Owner]
    leases: dict[str, Lease]
    stored: dict[tuple[str, str], bytes]
    opened: frozenset[str] = frozenset()  # runs whose owner row this request created


class PutAway(NamedTuple):
    """A finished run's row in the index of runs put away from memory (listing, pruning)."""

    run_id: str
    started_at: float
    status: str
    saga: str
    last_seen: float


class RunQuery(NamedTuple):
    """The filters of ``GET /runs`` that the index of put-away runs can answer.

    ``before``: the page cursor, (started_at, run_id) of the last run shown.
    """

    status: str | None = None
    saga: str | None = None
    since: float | None = None
    until: float | None = None
    id_prefix: str | None = None
    before: tuple[float, str] | None = None


SpanRow = tuple[str, str, float, str, str, bytes]
"""(run_id, span_id, received_at, service, instance, protobuf bytes)."""
HeartbeatRow = tuple[str, float, float, str, int | None, int, int]
"""(instance, heard at, interval seconds, the open runs it named as a JSON list, the
beat's number (None: a heartbeat without one, a whole beat), how many parts the beat
has, how many of them the row holds)."""
HeardRow = tuple[str, float, float, str, int]
"""A ``HeartbeatRow`` another process stored, and its change number (``Store.changes``)."""
InstanceRow = tuple[str, float, float]
"""(instance, last heartbeat, interval seconds)."""


def heartbeat_row(
    instance: str, at: float, interval: float, open_runs: Sequence[str],
    beat: int | None = None, parts: int = 1,
) -> HeartbeatRow:  # fmt: skip
    """The row of one heartbeat span (one part of its beat)."""
    return (instance, at, interval, json.dumps(list(open_runs)), beat, parts, 1)


def joins(held: HeartbeatRow, row: HeartbeatRow) -> bool:
    """Whether ``row`` is another part of the beat ``held`` holds (the runs they name are
    then unioned), not a new beat (whose runs take the place of ``held``'s). Counting the
    parts held keeps an agent that never changes its beat number from growing the row
    past one beat's worth. The stores' upserts apply the same rule in SQL."""
    beat = row[4]
    return beat is not None and held[4] == beat and held[6] + row[6] <= row[5]


# ``joins`` in SQL, for the stores' upserts of an instance's row (``instances``, the row
# held; ``excluded``, the row stored).
JOINS_SQL = (
    "(excluded.beat IS NOT NULL AND instances.beat = excluded.beat "
    "AND instances.beat_merged + excluded.beat_merged <= excluded.beat_parts)"
)


def merge_heartbeats(rows: Iterable[HeartbeatRow]) -> list[HeartbeatRow]:
    """One row per instance, as storing ``rows`` one after the other leaves it (in order
    of first appearance): a row replaces the one before unless it ``joins`` it."""
    out: dict[str, HeartbeatRow] = {}
    for row in rows:
        held = out.get(row[0])
        if held is not None and joins(held, row):
            runs = list(dict.fromkeys([*json.loads(held[3]), *json.loads(row[3])]))
            row = (*row[:3], json.dumps(runs), row[4], row[5], held[6] + row[6])
        out[row[0]] = row
    return list(out.values())


class IntakeRows(NamedTuple):
    """What one request stores once screened (see :meth:`Store.write_screened`)."""

    spans: Sequence[SpanRow]
    heartbeats: Sequence[HeartbeatRow]
    owners: Sequence[tuple[str, Owner]]


T = TypeVar("T")


class Store(Protocol):
    """Spans, run marks and resolutions, instances, run owners and recovery leases.

    Lease times: every :class:`Lease` a store takes or hands out is on the caller's clock,
    read as ``now`` (the caller's reading, passed with the call). The store keeps them
    on one clock that judges every lease it holds: SQLite on the sidecar's (one
    process; :meth:`clock_stepped` moves them with a step of it), PostgreSQL on the
    database's, which every replica shares, whatever the replicas' clocks say: each
    lease read or written is moved by the two clocks' difference measured in the same
    transaction.
    """

    @property
    def target(self) -> DbTarget: ...

    @property
    def inline(self) -> bool:
        """True: cheap local calls, made on the event loop. False: from a worker thread."""
        ...

    def close(self) -> None: ...

    def schema_version(self) -> int: ...

    # --- writing -------------------------------------------------------------------

    def write(
        self,
        spans: Sequence[SpanRow],
        heartbeats: Sequence[HeartbeatRow] = (),
        owners: Sequence[tuple[str, Owner]] = (),
    ) -> None:
        """One request's spans, heartbeats and new runs' owners, in one transaction.

        Committed on return (a 200 may follow); raises StoreError otherwise.
        """
        ...

    def write_screened(
        self,
        keys: Sequence[tuple[str, str]],
        openers: Sequence[tuple[str, Owner]],
        now: float,
        decide: Callable[[Screening], tuple[IntakeRows, T]],
    ) -> tuple[T, int]:
        """Screen and store one request in one transaction, serialized per run across every
        process on the database: a run's state moves one request at a time, as in one
        sidecar. The leases it reads are on the caller's clock at ``now``.

        ``keys`` are the request's (run_id, span_id); ``openers`` the owner each new run
        would get (its first span's). Runs without an owner get one of those first; then
        the runs' owner rows are locked (in run id order) until commit, and ``decide``
        screens the spans against the owners, leases and stored spans read under those
        locks and returns the rows to store (and a result handed back, with the change
        number of the spans and heartbeats it stored, on the scale :meth:`changes` reads
        rows with: every transaction numbered below it had its number before they were
        written; 0 for a store of one process, or when it stored none). Committed on
        return; raises StoreError otherwise.
        """
        ...

    def mark_orphaned(self, marks: Iterable[tuple[str, float]]) -> None: ...

    def clear_orphaned(self, marks: Iterable[tuple[str, float]]) -> None:
        """Drop the orphan marks (run id, orphaned_at) of runs heard from again (their
        agent, or a recoverer), each only while it is the run's mark: a later orphaning
        stands."""

    def resolve(self, run_id: str, wanted: Resolution, *, replace: bool = False) -> Resolution:
        """Store a person's resolution and answer the one that stands afterwards, decided
        in the database in one statement (serialized per run across every process on it,
        whatever each one's memory holds): ``wanted`` when the run has none, or only one
        made at or before its orphan mark (it lapsed: ``_state._before_mark``), or with
        ``replace``; else the one that stands, unchanged (the first resolution stands:
        the caller compares the notes)."""
        ...

    def clear_resolutions(self, lapsed: Iterable[tuple[str, float]]) -> None:
        """Drop the resolutions (run id, its ``at``) that lapsed: their runs came to need a
        person again. Each only while it is the run's resolution: one made since (another
        replica's, after its own lapse) stands."""

    def delete_runs(self, run_ids: list[str]) -> None: ...

    def delete_instances(self, instances: list[str]) -> None: ...

    def decide_lease(
        self, run_id: str, now: float, decide: Callable[[Lease | None], Lease | LeaseRefusal]
    ) -> Lease | LeaseRefusal:
        """Read the run's lease, let ``decide`` (which judges at ``now``, the caller's
        clock) grant, renew, release or refuse, write it.

        Serialized per run across every process on the database; the lease ``decide``
        reads is on the caller's clock at ``now``, its remaining time as the store's
        clock measures it (see the class), and so is the lease it writes.
        """
        ...

    def clock_stepped(self, step: float) -> None:
        """The caller's clock was stepped by ``step`` seconds while no time passed: move the
        lease times kept on it (SQLite), so every lease keeps its remaining time. Nothing
        on PostgreSQL: it keeps them on the database's clock."""
        ...

    # --- finished runs put away from memory (memory bounded by open runs) -----------

    def put_away(self, rows: Sequence[PutAway]) -> None:
        """Index finished runs that leave memory (insert or update); their spans stay.

        From then on :meth:`spans`, :meth:`owners`, :meth:`marks` and :meth:`leases`
        (what a start folds) leave them out, and :meth:`load_runs` brings them back.
        """
        ...

    def put_away_of(self, run_ids: Sequence[str]) -> set[str]:
        """Those of ``run_ids`` that are indexed as put away (reopened ones included)."""
        ...

    def load_runs(self, run_ids: Sequence[str], now: float, *, reopen: bool = False) -> Changes:
        """Everything stored about ``run_ids``: spans (grouped by run), owners, marks and
        leases (no instances; leases on the caller's clock at ``now``). ``reopen``: they go
        back into a sidecar's memory, so a start folds them again until they are put away
        anew."""
        ...

    def put_away_page(self, query: RunQuery, limit: int) -> list[tuple[str, float]]:
        """Up to ``limit`` (run id, started_at) of put-away runs matching ``query``, newest
        start first (ties: run id descending). Reopened runs match any status (their
        row's is unknown)."""
        ...

    def prune_put_away(self, before: float, limit: int = PRUNE_BATCH) -> int:
        """Delete up to ``limit`` of the put-away runs last active before ``before``,
        oldest first (spans, marks, owners, leases, index rows), in one transaction; how
        many (fewer than ``limit``: none is left). Idempotent: replicas may all run it."""
        ...

    # --- reading -------------------------------------------------------------------

    def spans(self) -> Iterator[StoredSpan]:
        """Every stored span of the runs not put away, grouped by run."""
        ...

    def stored_spans(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], bytes]:
        """The stored bytes of the given (run_id, span_id) that exist (duplicate checks)."""
        ...

    def marks(self) -> list[RunMark]:
        """The marks of the runs not put away."""
        ...

    def instances(self) -> list[InstanceRow]: ...

    def owners(self) -> list[tuple[str, Owner]]:
        """The owners of the runs not put away."""
        ...

    def leases(self, now: float) -> list[Lease]:
        """The leases of the runs not put away, on the caller's clock at ``now``."""
        ...

    def span_count(self) -> int: ...

    def instance_count(self) -> int: ...

    # --- replicas (a store shared by several sidecars) -------------------------------

    def changes(self, now: float) -> Changes:
        """Spans (with their runs' owners), heartbeats, marks and leases committed since
        the last call (or since :meth:`spans`), by any process. A span may come twice
        (folding is idempotent); a heartbeat, mark or lease row comes once a version (a
        heartbeat read twice would count as heard twice); none is missed. Leases are on
        the caller's clock at ``now``, the moment the read began. Each with its
        change number (the database's order of writes: the replicas order an orphan mark
        against what they heard of its run by it, never by the writers' clocks). Empty for
        a store of one process.
        """
        ...

    def try_lead(self, hold: float) -> bool:
        """Whether this process is (or now became) the one that runs orphan detection and
        retention; one that stops asking for ``hold`` seconds (paused, cut off) hands it
        on. Always True for a store of one process."""
        ...


class OutboxRecord(NamedTuple):
    """One alert_outbox row as the outbox reads it (``event``: its JSON text)."""

    id: int
    dedup_key: str
    action: str
    sink: str
    state: str
    attempts: int
    last_error: str | None
    event: str


class NewAlert(NamedTuple):
    dedup_key: str
    action: str
    sink: str
    alertname: str
    run_id: str
    event: str  # JSON
    state: str
    created_at: float


class HistoryRecord(NamedTuple):
    created_at: float
    alertname: str
    action: str
    sink: str
    state: str
    attempts: int
    last_error: str | None
    event: str


class AlertTx(Protocol):
    """The writes of one outbox transaction."""

    def fires(self, dedup_key: str) -> list[tuple[str, str, str]]:
        """(sink, event JSON, state) of the fire rows of ``dedup_key``."""
        ...

    def insert(self, row: NewAlert) -> bool:
        """Insert unless (dedup_key, action, sink) exists; True when inserted."""
        ...

    def keys(self, alertname: str, run_id: str) -> list[tuple[str, str]]:
        """(dedup_key, action) of every row of one alert of one run (its episodes)."""
        ...

    def retire(self, row_id: int, state: str, note: str, at: float) -> None:
        """End a row still waiting (pending or held) unsent: ``state``, ``note`` as its last
        error; a fire no longer fires on its sink (see _outbox_sql.RETIRE)."""
        ...

    def hold_again(self, dedup_key: str, action: str, sink: str) -> None:
        """Make the row (``dedup_key``, ``action``, ``sink``) held again (the no-sink row)."""
        ...

    def set_event(self, row_id: int, event: str) -> None:
        """Replace a row's event JSON (masked again, see AlertService.remask)."""
        ...

    def resolve_fire(self, dedup_key: str, sink: str, at: float) -> None:
        """Mark the fire row of (``dedup_key``, ``sink``) resolved: no longer firing."""
        ...


class AlertStore(Protocol):
    """The alert outbox's rows: one per (dedup_key, action, sink)."""

    @property
    def target(self) -> DbTarget: ...

    @property
    def inline(self) -> bool:
        """True: one process's local file. False: shared (poll for others' rows)."""
        ...

    def close(self) -> None: ...

    def transaction(self) -> AbstractContextManager[AlertTx]:
        """A write transaction (rolled back on an exception, StoreError on a database one)."""
        ...

    def stranded(self, sinks: Sequence[str], no_sink: str) -> list[tuple[int, str, str]]:
        """(id, sink, event JSON) of the rows waiting for none of ``sinks``, oldest first:
        held (sink ``no_sink``), or pending for a sink not among them."""
        ...

    def to_leave(self, sinks: Sequence[str]) -> list[tuple[int, str]]:
        """(id, run id) of the rows whose event may still be sent: waiting (pending, held),
        or fires still firing on one of ``sinks``."""
        ...

    def events(self, ids: Sequence[int]) -> list[tuple[int, str]]:
        """(id, event JSON) of the rows ``ids`` (those still there), oldest first."""
        ...

    def open_alerts(self) -> list[tuple[str, str]]:
        """(run_id, alertname) of fires without a resolve."""
        ...

    def rows(self, sink: str | None = None) -> list[OutboxRecord]: ...

    def count(self, state: str) -> int: ...

    def next_row(self, sink: str, state: str) -> OutboxRecord | None:
        """The oldest row of ``sink`` in ``state`` (the next delivery), never one whose
        dedup key has an older row in ``state`` (a resolve never overtakes its fire).

        A shared store claims it for this process (other processes skip it until
        :meth:`mark` or the claim's expiry), so each row is sent by one process.
        """
        ...

    def sending(self, row_id: int, seconds: float) -> bool:
        """Just before a row claimed by :meth:`next_row` is sent: True while the claim is
        still this process's (a shared store then holds the row ``seconds`` from now, the
        send's limit and a margin, whether or not the claimer is seen alive). False: the
        claim ran out and another process took the row over, which sends it: do not.
        """
        ...

    def mark(
        self, row_id: int, state: str, error: str | None, sent: bool, now: float, hold: float = 0
    ) -> bool:
        """Record a delivery attempt, if the row's claim is still this process's (False:
        another process took the row over, and records its own). ``hold`` > 0 (a retry's
        delay): no other process may take the row for that long; otherwise the claim ends."""
        ...

    def firing(self, sink: str, delivered: str) -> list[tuple[int, float, str]]:
        """(id, last_sent_at, event JSON) of delivered fires of ``sink`` without a resolve."""
        ...

    def resending(self, row_id: int, due: float, seconds: float) -> bool:
        """Just before a fire from :meth:`firing` is re-sent: True while it still fires
        and was not sent since ``due``. A shared store then holds it ``seconds`` (as
        :meth:`sending`), and its resolve waits meanwhile (:meth:`next_row`); False when
        another process holds it (re-sending it)."""
        ...

    def touch_sent(self, row_id: int, at: float) -> None:
        """Record a re-send (its time) and end its hold, if the hold is still ours."""
        ...

    def history(self, run_id: str) -> list[HistoryRecord]:
        """The rows of one run, oldest first; empty when the outbox was never created."""
        ...


NOT_PUT_AWAY = "{table}.run_id IN (SELECT run_id FROM run_owners WHERE put_away = 0)"
"""The condition (on ``{table}.run_id``) that a run is not put away: what a start folds.

Every run has an owner row (written with its first span), flagged while the run is put
away (status set in ``run_index``: schema 5 keeps the two together), and the unflagged
ones have a partial index: a start reads the runs held, not every run stored (a NOT
EXISTS against ``run_index`` read every stored span, seconds per million)."""

PUT_AWAY_FLAG_V5 = """
ALTER TABLE run_owners {add} put_away INTEGER NOT NULL DEFAULT 0;
UPDATE run_owners SET put_away = 1
    WHERE run_id IN (SELECT run_id FROM run_index WHERE status IS NOT NULL);
CREATE INDEX IF NOT EXISTS run_owners_held ON run_owners (run_id) WHERE put_away = 0;
"""
"""Schema step 5 (both backends; ``{add}``: the dialect's ADD COLUMN)."""

RESOLVED_BY_V7 = "ALTER TABLE run_marks {add} resolution_by TEXT;"
"""Schema step 7 (both backends): who resolved a run. Rows stored before keep their note
and time with NULL here: their person is unknown, and nothing is made up for them."""

BEAT_V8 = """
ALTER TABLE instances {add} beat {bigint};
ALTER TABLE instances {add} beat_parts {bigint};
ALTER TABLE instances {add} beat_merged {bigint};
"""
"""Schema step 8 (both backends): the beat an instance's row holds the runs of, how many
parts it has and how many the row holds (``merge_heartbeats``). NULL in the rows stored
before: the next heartbeat takes their place, as any heartbeat did."""


LEASE_ROW = (
    "SELECT run_id, holder, token, granted_at, expires_at, released, forced_reason, "
    "forced_by, forced_at FROM run_leases"
)
"""A lease's columns in the order ``lease_from_row`` reads them (both backends)."""
SPAN_ROW = "SELECT run_id, span_id, service, instance, data FROM spans"
"""A stored span's columns in :class:`StoredSpan`'s order (``span_from_row``)."""
OWNER_ROW = "SELECT run_id, trace_id, instance, service FROM run_owners"
"""A run owner's columns in the order ``owners_from_rows`` reads them."""
HELD_OWNER_ROWS = OWNER_ROW + " WHERE put_away = 0"
"""The owners of the runs not put away (``NOT_PUT_AWAY``'s rule, read through the same
partial index): what a start folds."""
MARK_ROW = (
    "SELECT run_id, orphaned_at, resolution_note, resolution_at, resolution_by FROM run_marks"
)
"""A run mark's columns in :class:`RunMark`'s order."""


def span_from_row(row: tuple[Any, ...]) -> StoredSpan:
    """A ``SPAN_ROW`` row (the data as bytes: PostgreSQL gives a memoryview)."""
    return StoredSpan(row[0], row[1], row[2], row[3], bytes(row[4]))


def owners_from_rows(rows: Iterable[tuple[Any, ...]]) -> list[tuple[str, Owner]]:
    return [(str(r), Owner(str(t), str(i), str(s))) for r, t, i, s in rows]


def put_away_page_sql(query: RunQuery, limit: int, mark: str) -> tuple[str, list[object]]:
    """The index query of :meth:`Store.put_away_page` (``mark``: the driver's placeholder)."""
    before = query.before or (0.0, "")
    prefix = query.id_prefix or ""
    # (the filter is set, its condition with {m} for each placeholder, its arguments)
    filters: list[tuple[bool, str, list[object]]] = [
        (query.status is not None, "(status = {m} OR status IS NULL)", [query.status]),
        (query.saga is not None, "saga = {m}", [query.saga]),
        (query.since is not None, "started_at >= {m}", [query.since]),
        (query.until is not None, "started_at <= {m}", [query.until]),
        (query.id_prefix is not None, "substr(run_id, 1, {m}) = {m}", [len(prefix), prefix]),
        (
            query.before is not None,
            "(started_at < {m} OR (started_at = {m} AND run_id < {m}))",
            [before[0], before[0], before[1]],
        ),
    ]
    where = [cond.format(m=mark) for used, cond, _ in filters if used]
    args = [arg for used, _, given in filters if used for arg in given]
    sql = "SELECT run_id, started_at FROM run_index"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY started_at DESC, run_id DESC LIMIT {mark}"
    args.append(limit)
    return sql, args
