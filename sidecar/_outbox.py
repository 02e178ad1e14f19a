"""The alert outbox: alerts are written to SQLite first, then delivered, at least once.

One row per (dedup_key, action, sink), inserted with INSERT OR IGNORE: a run
pages each sink at most once per alert, however often the rules are
re-evaluated and across restarts. Each sink has one worker that delivers its
rows oldest first (so a resolve never overtakes its fire), backs off
exponentially with jitter on retryable failures (honouring Retry-After) and
marks a row failed, with the sink's answer in the log, when the sink refuses
it for good. Rows survive restarts; a new :class:`Outbox` on the same file
delivers what is pending. Workers sleep on an :class:`asyncio.Event` set on
insert, so a new alert leaves within a loop iteration.

The tables live in the sidecar's database file beside the span store, under
their own connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from saga_otel import semconv as sc
from saga_otel.records import backoff_seconds

from ._alerting import Action, AlertEvent
from ._errors import ConfigError, StoreError
from ._log import get_logger
from ._sinks import SINK_KINDS, DeliveryRejected, DeliveryRetry, Sink
from ._store import prepare_db_file

# Operational logs go with the sidecar's own (stdlib, stderr); alerts use the log sink.
log = get_logger("sidecar.alerts")

PENDING: Final = "pending"
DELIVERED: Final = "delivered"
FAILED: Final = "failed"
HELD: Final = "held"
# The sink column of an alert no configured sink takes (no sink, or routed nowhere): the
# row is kept in state HELD and handed to the sinks of a later start that route it.
NO_SINK: Final = "(none)"

OUTCOME_DELIVERED: Final = "delivered"
OUTCOME_RETRIED: Final = "retried"
OUTCOME_FAILED: Final = "failed"

_DELAY_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

_SCHEMA: Final = """
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


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before retry number ``failures`` (from 1): exponential, capped, with jitter.

    A sink's Retry-After wins over the computed delay (capped at ``max_retry_after``
    so a bad header cannot park alerts for a day).
    """

    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 60.0
    jitter: float = 0.5  # up to this fraction of the delay is added at random
    max_retry_after: float = 300.0

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.maximum < self.initial or self.multiplier < 1:
            raise ConfigError(
                f"{self!r}: need initial > 0, maximum >= initial and multiplier >= 1, "
                "e.g. Backoff(initial=0.5, maximum=60)"
            )
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"backoff jitter {self.jitter} must be within 0..1")

    def delay(self, failures: int, rng: random.Random, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after)
        return backoff_seconds(
            failures,
            initial=self.initial,
            multiplier=self.multiplier,
            maximum=self.maximum,
            jitter_ratio=self.jitter,
            rng=rng,
        )


@dataclass(frozen=True, slots=True)
class Routing:
    """Which sink kinds get which severity. ``routes`` None: every sink gets everything."""

    routes: Mapping[str, frozenset[str]] | None = None

    @classmethod
    def parse(cls, specs: Iterable[str]) -> Routing:
        """From ``critical=pagerduty,webhook`` strings (repeatable per severity)."""
        routes: dict[str, set[str]] = {}
        for spec in specs:
            severity, sep, kinds = spec.partition("=")
            names = {k.strip() for k in kinds.split(",") if k.strip()}
            if not sep or not severity.strip() or not names:
                raise ConfigError(
                    f"--route {spec!r} is not SEVERITY=SINK[,SINK]: write e.g. "
                    "--route critical=pagerduty,webhook"
                )
            unknown = names - set(SINK_KINDS)
            if unknown:
                raise ConfigError(
                    f"--route {spec!r} names unknown sink(s) {sorted(unknown)}: use "
                    f"{', '.join(SINK_KINDS)}"
                )
            routes.setdefault(severity.strip(), set()).update(names)
        if not routes:
            return cls(None)
        return cls({k: frozenset(v) for k, v in routes.items()})

    def allows(self, severity: str, kind: str) -> bool:
        if self.routes is None:
            return True
        return kind in self.routes.get(severity, frozenset())


@dataclass(frozen=True, slots=True)
class AlertMetrics:
    alerts: Counter
    delay: Histogram
    outbox_depth: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AlertMetrics:
        return cls(
            alerts=Counter(
                sc.M_SIDECAR_ALERTS,
                "Alert deliveries by alert, sink kind and outcome (delivered, retried, failed).",
                ("alertname", "sink", "outcome"),
                registry=registry,
            ),
            delay=Histogram(
                sc.M_SIDECAR_ALERT_DELAY,
                "Seconds from the event an alert reports (e.g. unwind start) to the sink "
                "accepting it.",
                ("sink",),
                buckets=_DELAY_BUCKETS,
                registry=registry,
            ),
            outbox_depth=Gauge(
                sc.M_SIDECAR_OUTBOX_DEPTH,
                "Alert deliveries waiting in the outbox.",
                registry=registry,
            ),
        )


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    dedup_key: str
    action: str
    sink: str
    state: str
    attempts: int
    last_error: str | None
    event: AlertEvent


class Outbox:
    """Durable alert delivery to a set of sinks. Call :meth:`start` inside the event loop."""

    def __init__(
        self,
        db_path: Path | str,
        sinks: Sequence[Sink],
        routing: Routing | None = None,
        *,
        metrics: AlertMetrics | None = None,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        names = [s.name for s in sinks]
        if len(set(names)) != len(names):
            raise ConfigError(
                f"two alert sinks share a name in {names}: give each Alertmanager and "
                "webhook a different URL"
            )
        self.sinks = tuple(sinks)
        self.routing = routing or Routing()
        self.metrics = metrics
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        try:
            if str(db_path) != ":memory:":
                prepare_db_file(Path(db_path), warn=False)  # the Store warns, once
            self._db = sqlite3.connect(str(db_path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout = 10000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(
                f"cannot open the alert outbox in {db_path}: {exc}; check the path is writable "
                "(--db) and not on a network filesystem"
            ) from exc
        self._update_depth()

    # --- writing ------------------------------------------------------------------

    def add(self, events: Iterable[AlertEvent]) -> int:
        """Record deliveries of ``events`` for every routed sink; returns rows inserted.

        Synchronous and committed on return: once this returns the alerts survive a crash.
        A resolve goes to exactly the sinks its fire went to, with the fire's labels.
        """
        inserted = 0
        woken: set[str] = set()
        now = self._clock()
        with self._lock:
            if self._closed:
                # Only while the sidecar stops: the next start's re-evaluation raises it.
                raise StoreError(
                    "the alert outbox is closed (the sidecar is stopping): the alert is "
                    "raised again when it starts"
                )
            try:
                self._db.execute("BEGIN IMMEDIATE")
                for event in events:
                    for sink_name, row_event in self._targets(event):
                        if self._insert(sink_name, row_event, now):
                            inserted += 1
                            woken.add(sink_name)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise StoreError(f"cannot write alerts to the outbox: {exc}") from exc
        if inserted:
            self._update_depth()
            for name in woken:
                self._wake_sink(name)
        return inserted

    def _targets(self, event: AlertEvent) -> list[tuple[str, AlertEvent]]:
        if event.action is Action.FIRE:
            routed = [
                (s.name, event) for s in self.sinks if self.routing.allows(event.severity, s.kind)
            ]
            # No sink takes it: keep it held rather than drop it (see NO_SINK).
            return routed or [(NO_SINK, event)]
        # Resolve: only where the fire went, repeating the fire's labels and start.
        rows = self._db.execute(
            "SELECT sink, event, state FROM alert_outbox WHERE dedup_key = ? AND action = 'fire'",
            (event.dedup_key,),
        ).fetchall()
        live = {s.name for s in self.sinks}
        return [
            (sink, event.resolving_with(AlertEvent.from_dict(json.loads(text))))
            for sink, text, state in rows
            if sink in live or (sink == NO_SINK and state == HELD)
        ]

    def _insert(self, sink_name: str, event: AlertEvent, now: float) -> bool:
        cur = self._db.execute(
            "INSERT OR IGNORE INTO alert_outbox (dedup_key, action, sink, alertname, run_id, "
            "event, state, created_at) VALUES (?,?,?,?,?,?,?,?)",
            (
                event.dedup_key,
                event.action.value,
                sink_name,
                event.alertname,
                event.run_id,
                json.dumps(event.to_dict(), sort_keys=True),
                HELD if sink_name == NO_SINK else PENDING,
                now,
            ),
        )
        return bool(cur.rowcount)

    def release_held(self) -> int:
        """Hand held alerts (see NO_SINK) to the sinks that now route them; rows added."""
        added = 0
        now = self._clock()
        with self._lock:
            held = self._db.execute(
                "SELECT id, event FROM alert_outbox WHERE sink = ? AND state = ? ORDER BY id",
                (NO_SINK, HELD),
            ).fetchall()
            if not held or not self.sinks:
                return 0
            try:
                self._db.execute("BEGIN IMMEDIATE")
                for row_id, text in held:
                    targets = [t for t in self._targets(_load(text)) if t[0] != NO_SINK]
                    if not targets:
                        continue
                    for sink_name, row_event in targets:
                        added += self._insert(sink_name, row_event, now)
                    self._db.execute(
                        "UPDATE alert_outbox SET state = ?, delivered_at = ? WHERE id = ?",
                        (DELIVERED, now, row_id),
                    )
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise StoreError(f"cannot hand held alerts to the sinks: {exc}") from exc
        if added:
            self._update_depth()
        return added

    # --- reading ------------------------------------------------------------------

    def open_alerts(self) -> dict[str, list[str]]:
        """run_id -> alert names fired and not yet resolved (on any sink)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT f.run_id, f.alertname FROM alert_outbox f WHERE f.action = "
                "'fire' AND NOT EXISTS (SELECT 1 FROM alert_outbox r WHERE r.dedup_key = "
                "f.dedup_key AND r.action = 'resolve')"
            ).fetchall()
        out: dict[str, list[str]] = {}
        for run_id, alertname in rows:
            out.setdefault(str(run_id), []).append(str(alertname))
        return out

    def rows(self, sink: str | None = None) -> list[OutboxRow]:
        query = "SELECT id, dedup_key, action, sink, state, attempts, last_error, event FROM "
        query += "alert_outbox" + (" WHERE sink = ?" if sink else "") + " ORDER BY id"
        with self._lock:
            fetched = self._db.execute(query, (sink,) if sink else ()).fetchall()
        return [OutboxRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], _load(r[7])) for r in fetched]

    def depth(self) -> int:
        with self._lock:
            (count,) = self._db.execute(
                "SELECT COUNT(*) FROM alert_outbox WHERE state = ?", (PENDING,)
            ).fetchone()
        return int(count)

    def _update_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.outbox_depth.set(self.depth())

    # --- delivering -----------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.release_held()
        for sink in self.sinks:
            self._wake[sink.name] = asyncio.Event()
            self._tasks.append(
                asyncio.create_task(self._worker(sink), name=f"alert-outbox {sink.name}")
            )

    async def run(self) -> None:
        """Deliver until cancelled (for a background-task runner)."""
        await self.start()
        try:
            # With no sink there is no worker, but the outbox must stay open: alerts are
            # still written (held) for as long as the sidecar runs.
            await asyncio.gather(*self._tasks, asyncio.Event().wait())
        finally:
            await self.stop()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sink in self.sinks:
            await sink.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._db.close()

    async def wait_idle(self, limit: float = 10.0) -> bool:
        """True once nothing is pending (tests and benchmarks), False after ``limit`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while self.depth():
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def _wake_sink(self, name: str) -> None:
        event, loop = self._wake.get(name), self._loop
        if event is None or loop is None:
            return  # not started yet: start() delivers whatever is pending
        if threading.get_ident() == self._loop_thread:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    def _next(self, sink: str) -> OutboxRow | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, dedup_key, action, sink, state, attempts, last_error, event "
                "FROM alert_outbox WHERE sink = ? AND state = ? ORDER BY id LIMIT 1",
                (sink, PENDING),
            ).fetchone()
        if row is None:
            return None
        return OutboxRow(row[0], row[1], row[2], row[3], row[4], row[5], row[6], _load(row[7]))

    def _mark(self, row_id: int, state: str, error: str | None, sent: bool) -> None:
        now = self._clock()
        with self._lock:
            self._db.execute(
                "UPDATE alert_outbox SET state = ?, attempts = attempts + 1, last_error = ?, "
                "delivered_at = CASE WHEN ? THEN ? ELSE delivered_at END, "
                "last_sent_at = CASE WHEN ? THEN ? ELSE last_sent_at END WHERE id = ?",
                (state, error, sent, now, sent, now, row_id),
            )
        if state != PENDING:
            self._update_depth()

    def _count(self, alertname: str, kind: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.alerts.labels(alertname=alertname, sink=kind, outcome=outcome).inc()

    async def _worker(self, sink: Sink) -> None:
        wake = self._wake[sink.name]
        failures = 0
        while True:
            wake.clear()
            row = self._next(sink.name)
            if row is None:
                await self._idle(sink, wake)
                continue
            try:
                await sink.send(row.event)
            except DeliveryRejected as exc:
                failures = 0
                self._mark(row.id, FAILED, str(exc), sent=False)
                self._count(row.event.alertname, sink.kind, OUTCOME_FAILED)
                log.error(
                    "sidecar.alert.rejected",
                    sink=sink.name,
                    action=row.action,
                    dedup_key=row.dedup_key,
                    error=str(exc),
                    fix="a configuration error (routing key, URL, token): fix the sink's "
                    "settings; this alert is not retried",
                )
            except Exception as exc:
                # DeliveryRetry, or a bug in a sink: keep the row, never lose the alert.
                failures += 1
                retry_after = exc.retry_after if isinstance(exc, DeliveryRetry) else None
                delay = self.backoff.delay(failures, self._rng, retry_after)
                self._mark(row.id, PENDING, f"{type(exc).__name__}: {exc}", sent=False)
                self._count(row.event.alertname, sink.kind, OUTCOME_RETRIED)
                if failures == 1:
                    # Once per outage (and once when it ends): the retries are counted
                    # in saga_sidecar_alerts_total{outcome="retried"}.
                    log.warning(
                        "sidecar.sink.down",
                        sink=sink.name,
                        action=row.action,
                        dedup_key=row.dedup_key,
                        error=f"{type(exc).__name__}: {exc}",
                        retry_in_s=round(delay, 3),
                        exc_info=not isinstance(exc, DeliveryRetry),
                    )
                await self._sleep(delay)
            else:
                if failures:
                    log.info("sidecar.sink.up", sink=sink.name, failed_attempts=failures)
                failures = 0
                self._mark(row.id, DELIVERED, None, sent=True)
                self._count(row.event.alertname, sink.kind, OUTCOME_DELIVERED)
                if self.metrics is not None:
                    delay_s = max(0.0, self._clock() - row.event.at)
                    self.metrics.delay.labels(sink=sink.kind).observe(delay_s)

    async def _idle(self, sink: Sink, wake: asyncio.Event) -> None:
        interval = sink.resend_interval
        if interval is None:
            await wake.wait()
            return
        due_in = self._resend_due_in(sink.name, interval)
        if due_in is None or due_in > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=due_in)
            if wake.is_set():
                return
        await self._resend(sink, interval)

    def _firing(self, sink: str) -> list[tuple[int, float, str]]:
        with self._lock:
            return [
                (int(r[0]), float(r[1] or 0.0), str(r[2]))
                for r in self._db.execute(
                    "SELECT f.id, f.last_sent_at, f.event FROM alert_outbox f WHERE f.sink = ? "
                    "AND f.action = 'fire' AND f.state = ? AND NOT EXISTS (SELECT 1 FROM "
                    "alert_outbox r WHERE r.dedup_key = f.dedup_key AND r.sink = f.sink AND "
                    "r.action = 'resolve')",
                    (sink, DELIVERED),
                ).fetchall()
            ]

    def _resend_due_in(self, sink: str, interval: float) -> float | None:
        firing = self._firing(sink)
        if not firing:
            return None
        return max(0.0, min(sent for _, sent, _ in firing) + interval - self._clock())

    async def _resend(self, sink: Sink, interval: float) -> None:
        """Re-send still-firing alerts: an Alertmanager that restarted gets them back."""
        now = self._clock()
        for row_id, sent, text in self._firing(sink.name):
            if sent + interval > now:
                continue
            try:
                await sink.send(_load(text))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.warning("sidecar.alert.resend_failed", sink=sink.name, error=error)
                # Try again next interval; the first delivery already succeeded.
            with self._lock:
                self._db.execute(
                    "UPDATE alert_outbox SET last_sent_at = ? WHERE id = ?", (self._clock(), row_id)
                )


def _load(text: str) -> AlertEvent:
    return AlertEvent.from_dict(json.loads(text))


def describe_routing(routing: Routing, sinks: Sequence[Sink]) -> list[str]:
    """Warnings about routes that send a severity nowhere (logged at startup)."""
    if routing.routes is None:
        return []
    kinds = {s.kind for s in sinks}
    problems = []
    for severity in ("critical", "warning"):
        routed = routing.routes.get(severity, frozenset()) & kinds
        if not routed:
            problems.append(
                f"alerts of severity {severity} go to no sink: add e.g. "
                f"--route {severity}={next(iter(sorted(kinds)), 'log')}"
            )
    for severity, wanted in routing.routes.items():
        missing = wanted - kinds
        if missing:
            problems.append(
                f"--route {severity}={','.join(sorted(wanted))} names sink(s) "
                f"{sorted(missing)} that are not configured: configure them or drop them "
                "from the route"
            )
    return problems


class AlertHistoryRow(NamedTuple):
    """One outbox row as a run page shows it: an alert event on one sink."""

    created_at: float
    alertname: str
    action: str
    sink: str
    state: str
    attempts: int
    last_error: str | None
    summary: str


def alert_history(db_path: Path | str, run_id: str) -> list[AlertHistoryRow]:
    """The alert rows of one run, oldest first, read on a connection of their own.

    Empty when alerting never wrote to this database (no outbox table yet).
    """
    try:
        db = sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the alert outbox in {db_path}: {exc}") from exc
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
        raise StoreError(f"cannot read the alert outbox in {db_path}: {exc}") from exc
    finally:
        db.close()
    out = []
    for created, alertname, action, sink, state, attempts, error, event in rows:
        try:
            summary = str(json.loads(event)["annotations"].get("summary", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            summary = ""
        out.append(
            AlertHistoryRow(
                float(created),
                str(alertname),
                str(action),
                str(sink),
                str(state),
                int(attempts),
                error,
                summary,
            )
        )
    return out
