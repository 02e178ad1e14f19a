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

The rows live in the sidecar's database beside the span store, under their own
connection (SQLite) or pool (PostgreSQL), behind the :class:`AlertStore` interface
of ``_storage.py``. On SQLite the outbox calls it inline, as before; on
PostgreSQL every database call of a running outbox goes through one worker
thread of its own, in order (a resolve is never written before its fire), so
the event loop never waits on the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, NamedTuple, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from saga_otel import semconv as sc
from saga_otel.records import backoff_seconds

from ._alerting import Action, AlertEvent, episode_of
from ._backends import alert_rows, open_alert_store
from ._errors import ConfigError, StoreError
from ._log import get_logger
from ._outbox_sql import DELIVERED, FAILED, HELD, PENDING, REHOMED
from ._sinks import (
    DEFAULT_TIMEOUT,
    SINK_KINDS,
    DeliveryRejected,
    DeliveryRetry,
    Sink,
    shown_sink,
    shown_url,
)
from ._storage import (
    AlertStore,
    AlertTx,
    DbTarget,
    HistoryRecord,
    NewAlert,
    OutboxRecord,
    parse_db,
)

T = TypeVar("T")

# Operational logs go with the sidecar's own (stdlib, stderr); alerts use the log sink.
log = get_logger("sidecar.alerts")

POLL_S: Final = 1.0  # shared stores: how often an idle worker looks for others' rows
# How often a started outbox counts what is pending for its depth gauge: as often as a
# worker looks for others' rows. Replicas share the rows, and one that writes or delivers
# a row tells no other: without this, a replica's gauge kept the count of its own last
# write or delivery (a backlog long drained, paging SagaSidecarOutboxBacklog). One COUNT
# on the state index (alert_outbox_state), costing what is pending.
DEPTH_REFRESH_S: Final = POLL_S
# On a shared store a row is held for its send (AlertStore.sending) this long past the
# send's limit, at which the outbox cuts it: the hold begins before the send does.
SEND_MARGIN_S: Final = 5.0
# The sink column of an alert no configured sink takes (no sink, or routed nowhere): the
# row is kept in state HELD and handed to the sinks of a later start that route it.
NO_SINK: Final = "(none)"
# Alerts whose write the database refused (a write lock held past the busy timeout, a full
# disk, PostgreSQL failing) wait in memory, in the order raised, and are written once it
# answers (Outbox._rewrite): at most this many, and this many bytes of their JSON. Past
# either, newer ones are dropped (logged, counted); the next start's re-evaluation raises
# those still open.
MAX_UNWRITTEN: Final = 10_000
MAX_UNWRITTEN_BYTES: Final = 64 * 1024 * 1024

OUTCOME_DELIVERED: Final = "delivered"
OUTCOME_RETRIED: Final = "retried"
OUTCOME_FAILED: Final = "failed"

_DELAY_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before retry number ``failures`` (from 1): exponential, capped, with jitter.

    A sink's Retry-After lengthens the computed delay, never shortens it (a
    ``Retry-After: 0`` or a date in the past must not turn retries into a busy loop),
    and is capped at ``max_retry_after`` so a bad header cannot park alerts for a day.
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
        computed = backoff_seconds(
            failures,
            initial=self.initial,
            multiplier=self.multiplier,
            maximum=self.maximum,
            jitter_ratio=self.jitter,
            rng=rng,
        )
        if retry_after is None:
            return computed
        return max(computed, min(retry_after, self.max_retry_after))


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
    evaluation_failures: Counter
    unwritten: Gauge
    dropped: Counter

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
            evaluation_failures=Counter(
                sc.M_SIDECAR_ALERT_EVALUATION_FAILURES,
                "Run views the alert rules failed on (a fault, logged as "
                "sidecar.alerts.evaluation_failed naming the run): that run's alerts were not "
                "raised; the other runs' were.",
                registry=registry,
            ),
            unwritten=Gauge(
                sc.M_SIDECAR_ALERTS_UNWRITTEN,
                "Alerts raised whose write to the outbox the database refused, held in "
                "memory until it answers.",
                registry=registry,
            ),
            dropped=Counter(
                sc.M_SIDECAR_ALERTS_DROPPED,
                "Alerts lost unwritten (past the bound on those held, or at a stop while the "
                "database refused); the next start raises those still open.",
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


@dataclass(frozen=True, slots=True)
class Unwritten:
    """Alerts whose write the database refused, oldest first, to be written again in that
    order (a resolve after its fire, an episode after the last). Pure: :meth:`keep` answers
    the next value; the outbox holds one."""

    events: tuple[AlertEvent, ...] = ()
    size: int = 0  # bytes of their JSON, as a row holds it

    def keep(
        self, events: Iterable[AlertEvent], most: int, most_bytes: int
    ) -> tuple[Unwritten, int]:
        """These alerts and ``events`` after them, each unless it repeats one before it (the
        outbox's insert-or-ignore key would drop it, see :func:`_written_as`), within
        ``most`` alerts and ``most_bytes``; and how many new ones did not fit (the newest:
        what is kept keeps its order)."""
        kept, size, dropped = list(self.events), self.size, 0
        seen: set[tuple[str, str, int]] = set()
        last: dict[tuple[str, str], tuple[str, int]] = {}  # per alert of a run
        for event in self.events:
            seen.add(_written_as(event, last))
        for event in events:
            key = _written_as(event, last, look=True)
            if key in seen:
                continue
            grown = size + len(_text(event))
            if len(kept) >= most or grown > most_bytes:
                dropped += 1
                continue
            seen.add(_written_as(event, last))
            kept.append(event)
            size = grown
        return Unwritten(tuple(kept), size), dropped


def _written_as(
    event: AlertEvent, last: dict[tuple[str, str], tuple[str, int]], *, look: bool = False
) -> tuple[str, str, int]:
    """The row key ``event`` gets after the events ``last`` has seen: its dedup key, action
    and, for an alert a run raises again once resolved (``_EPISODIC``), which episode from
    the first (a fire after a resolve opens the next, as :func:`_episode` numbers it when
    written). A second event with one key adds no row. ``last`` takes ``event`` in, unless
    ``look``."""
    run = (event.alertname, event.run_id)
    action, episode = last.get(run, ("", 0))
    if event.alertname in _EPISODIC and event.action is Action.FIRE and action == "resolve":
        episode += 1
    if not look:
        last[run] = (event.action.value, episode)
    return (event.dedup_key, event.action.value, episode)


class Outbox:
    """Durable alert delivery to a set of sinks. Call :meth:`start` inside the event loop."""

    def __init__(
        self,
        db: DbTarget | Path | str,
        sinks: Sequence[Sink],
        routing: Routing | None = None,
        *,
        metrics: AlertMetrics | None = None,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        send_timeout: float = DEFAULT_TIMEOUT,
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
        self._monotonic = monotonic
        # Per sink: each firing row's stored send time as last read, and since when (this
        # process's monotonic clock) it has read that one (see _resend_plan).
        self._read_sent: dict[str, dict[int, tuple[float, float]]] = {}
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._send_limit = send_timeout  # the HTTP sinks' own; a backstop for any other
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._deferred: list[AlertEvent] = []  # add_soon on SQLite: written two turns later
        # Alerts the database refused, written again once it answers (write, _rewrite):
        # touched only where the outbox writes (the loop on SQLite, its thread on
        # PostgreSQL). _dropping: past the bound since they were last written (logged once).
        self._unwritten = Unwritten()
        self._dropping = False
        self._rewrite_wake: asyncio.Event | None = None
        target = db if isinstance(db, DbTarget) or str(db) == ":memory:" else parse_db(db)
        self._store: AlertStore = open_alert_store(
            target if isinstance(target, DbTarget) else DbTarget("sqlite", path=Path(target))
        )
        # PostgreSQL: the database calls of a running outbox, one at a time and in order.
        self._io_thread: ThreadPoolExecutor | None = (
            None
            if self._store.inline
            else ThreadPoolExecutor(max_workers=1, thread_name_prefix="saga-outbox-db")
        )
        self._update_depth()

    @property
    def target(self) -> DbTarget:
        return self._store.target

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``: inline on SQLite, on the outbox's database thread otherwise."""
        if self._io_thread is None:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io_thread, functools.partial(fn, *args))

    # --- writing ------------------------------------------------------------------

    def add(self, events: Iterable[AlertEvent]) -> int:
        """Record deliveries of ``events`` for every routed sink; returns rows inserted.

        Synchronous and committed on return: once this returns the alerts survive a crash.
        A resolve goes to exactly the sinks its fire went to, with the fire's labels.
        """
        inserted = 0
        woken: set[str] = set()
        now = self._clock()
        if self._closed:
            # Only while the sidecar stops: the next start's re-evaluation raises it.
            raise StoreError(
                "the alert outbox is closed (the sidecar is stopping): the alert is "
                "raised again when it starts"
            )
        with self._store.transaction() as tx:
            for event in events:
                if event.alertname in _EPISODIC:
                    event = _episode(tx, event)
                for sink_name, row_event in self._targets(tx, event):
                    if self._insert(tx, sink_name, row_event, now):
                        inserted += 1
                        woken.add(sink_name)
        if inserted:
            self._update_depth()
            for name in woken:
                self._wake_sink(name)
        return inserted

    def write(self, events: Sequence[AlertEvent]) -> int:
        """:meth:`add`, after the alerts the database refused before; rows inserted.

        A refusal (StoreError: a write lock held past the busy timeout, a full disk,
        PostgreSQL failing) loses no alert: they wait in memory, in order
        (:class:`Unwritten`), and :meth:`_rewrite` writes them once the database answers.
        Meanwhile new ones wait behind them without asking the database (the retry's
        backoff paces the asking). Where the outbox writes: inline on SQLite, on its
        database thread on PostgreSQL.
        """
        if not events:
            return 0
        if self._unwritten.events:
            self._hold(events)
            return 0
        try:
            return self.add(events)
        except StoreError as exc:
            self._hold(events)
            log.error(
                "sidecar.alerts.write_failed",
                error=str(exc),
                alerts=len(events),
                unwritten=len(self._unwritten.events),
                fix="free the database (a lock held, a full disk, PostgreSQL down): the "
                "alerts are written and sent once it answers, without a restart",
            )
            return 0

    def _hold(self, events: Iterable[AlertEvent]) -> None:
        """Keep ``events`` behind the alerts waiting to be written (bounded: past it, the
        newest are dropped, logged once and counted) and wake :meth:`_rewrite`."""
        self._unwritten, dropped = self._unwritten.keep(events, MAX_UNWRITTEN, MAX_UNWRITTEN_BYTES)
        if self.metrics is not None:
            self.metrics.unwritten.set(len(self._unwritten.events))
        if dropped:
            if not self._dropping:
                log.error(
                    "sidecar.alerts.dropped",
                    alerts=dropped,
                    reason=f"{len(self._unwritten.events)} alerts ({self._unwritten.size} "
                    f"bytes) wait for the database already, the most held (at most "
                    f"{MAX_UNWRITTEN}, {MAX_UNWRITTEN_BYTES} bytes)",
                    fix="free the database, then restart the sidecar: its start raises "
                    "again the alerts still open; those held are written once it answers",
                )
            self._dropping = True
            self._count_dropped(dropped)
        self._wake_rewrite()

    def _count_dropped(self, alerts: int) -> None:
        if self.metrics is not None:
            self.metrics.dropped.inc(alerts)

    def _write_again(self, attempts: int) -> int:
        """Write the alerts held (:meth:`write`), in one transaction; rows inserted. Raises
        StoreError while the database refuses."""
        held = self._unwritten
        if not held.events:
            return 0
        try:
            inserted = self.add(held.events)
        except StoreError:
            raise
        except Exception as exc:  # not the database: a bug, which would hold every alert after
            self._written(Unwritten())
            self._lost(exc, len(held.events))
            return 0
        self._written(Unwritten())
        log.warning(
            "sidecar.alerts.written_late",
            alerts=len(held.events),
            deliveries_added=inserted,
            attempts=attempts,
        )
        return inserted

    def _written(self, left: Unwritten) -> None:
        self._unwritten, self._dropping = left, False
        if self.metrics is not None:
            self.metrics.unwritten.set(len(left.events))

    async def _rewrite(self) -> None:
        """Write the alerts the database refused once it answers: asked again after the
        outbox's backoff (as a sink is), for as long as it refuses. No loss meanwhile: a
        crash is covered by the next start's re-evaluation, as for any write."""
        wake = self._rewrite_wake
        assert wake is not None
        failures = 0
        while True:
            wake.clear()
            if not self._unwritten.events:  # read across threads: one reference, replaced
                failures = 0
                await wake.wait()
                continue
            failures += 1
            await self._sleep(self.backoff.delay(failures, self._rng))
            with contextlib.suppress(StoreError):
                await self.call(self._write_again, failures)

    def _wake_rewrite(self) -> None:
        wake, loop = self._rewrite_wake, self._loop
        if wake is None or loop is None:
            return  # not started yet: start() looks at what is held
        if threading.get_ident() == self._loop_thread:
            wake.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: the outbox closes too
                loop.call_soon_threadsafe(wake.set)

    def add_soon(self, events: list[AlertEvent]) -> Future[int] | None:
        """:meth:`write` without waiting: on the database thread on PostgreSQL (in order
        with every other write of this outbox); on SQLite two loop turns later (at once when
        no loop runs), so the intake answers its sender before the outbox's own COMMIT
        (see :meth:`_add_deferred`). What the database refuses waits to be written again
        (:meth:`write`); an alert lost to a crash meanwhile is raised again by the next
        start's re-evaluation.
        """
        if self._closed:
            self.add(events)  # raises StoreError
            return None
        if self._io_thread is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: nothing to answer first
                self.add(events)
                return None
            if not self._deferred:
                # Two hops: the answers the current callback set wake their handlers in
                # the next turn; the write follows them (they send without awaiting).
                loop.call_soon(loop.call_soon, self._add_deferred)
            self._deferred += events
            return None
        future = self._io_thread.submit(self.write, events)
        future.add_done_callback(functools.partial(self._failed, len(events)))
        return future

    def _add_deferred(self) -> None:
        """The events :meth:`add_soon` held on SQLite, in order, in one transaction."""
        events, self._deferred = self._deferred, []
        if not events:
            return
        try:
            self.write(events)
        except Exception as exc:  # not the database (write keeps those): a bug, log it loudly
            self._lost(exc, len(events))

    def _failed(self, alerts: int, future: Future[int]) -> None:
        exc = future.exception()
        if exc is not None:
            self._lost(exc, alerts)

    def _lost(self, exc: BaseException, alerts: int) -> None:
        """Alerts a write lost to something other than the database's refusal (no caller
        left to tell): loud, counted, and what happens next."""
        self._count_dropped(alerts)
        log.error(
            "sidecar.alerts.dropped",
            error=f"{type(exc).__name__}: {exc}",
            alerts=alerts,
            fix="the next start raises again the alerts still open",
        )

    async def flush(self) -> None:
        """Wait until every :meth:`add_soon` so far is committed (tests, shutdown)."""
        self._add_deferred()
        await self.call(_nothing)

    def _targets(self, tx: AlertTx, event: AlertEvent) -> list[tuple[str, AlertEvent]]:
        if event.action is Action.FIRE:
            routed = [
                (s.name, event) for s in self.sinks if self.routing.allows(event.severity, s.kind)
            ]
            # No sink takes it: keep it held rather than drop it (see NO_SINK).
            return routed or [(NO_SINK, event)]
        # Resolve: only where the fire went, repeating the fire's labels and start; or
        # where it waits for a sink: held (NO_SINK), or pending for a sink this process
        # does not configure (a corrected URL: the resolve moves with it, see rehome).
        live = {s.name for s in self.sinks}
        return [
            (sink, event.resolving_with(AlertEvent.from_dict(json.loads(text))))
            for sink, text, state in tx.fires(event.dedup_key)
            if sink in live or state in (PENDING, HELD)
        ]

    def _insert(self, tx: AlertTx, sink_name: str, event: AlertEvent, now: float) -> bool:
        if event.action is Action.RESOLVE:  # the fire stops firing (and being re-sent)
            tx.resolve_fire(event.dedup_key, sink_name, now)
        return tx.insert(
            NewAlert(
                event.dedup_key,
                event.action.value,
                sink_name,
                event.alertname,
                event.run_id,
                _text(event),
                HELD if sink_name == NO_SINK else PENDING,
                now,
            )
        )

    def rehome(self) -> int:
        """Hand the alerts waiting for no configured sink to the sinks that route them now,
        in the order they were written (a resolve after its fire); rows added.

        Held alerts (NO_SINK), and those pending for a sink this start does not configure:
        rows are keyed by the sink's full name, so a corrected URL or a removed sink left
        them waiting for a worker that never starts (and in the depth gauge for good).
        Each goes where :meth:`add` would send it now (a fire no configured sink routes
        is held; a resolve follows its fire, and with no fire on a configured sink there
        is nothing to resolve there); the old row is retired as REHOMED, saying where it
        went. Replicas starting at once write the same rows: the unique key keeps one.
        """
        names = [s.name for s in self.sinks]
        stranded = self._store.stranded(names, NO_SINK)
        if not stranded:
            return 0
        added = 0
        now = self._clock()
        moved: dict[str, list[list[str]]] = {}  # an unconfigured sink: where each row went
        with self._store.transaction() as tx:
            for row_id, sink, text in stranded:
                event = _load(text)
                # Not its own sink again (a held row whose alert still goes nowhere).
                targets = [t for t in self._targets(tx, event) if t[0] != sink]
                if sink == NO_SINK and not targets:
                    continue  # it stays held
                for sink_name, row_event in targets:
                    if self._insert(tx, sink_name, row_event, now):
                        added += 1
                    elif sink_name == NO_SINK:  # held before, then handed to a sink now gone
                        tx.hold_again(event.dedup_key, event.action.value, NO_SINK)
                went = [name for name, _ in targets]
                tx.retire(row_id, REHOMED, _rehomed_note(sink, went), now)
                if sink != NO_SINK:
                    moved.setdefault(sink, []).append(went)
        for sink, rows in moved.items():
            log.warning(
                "sidecar.outbox.rehomed",
                sink=shown_sink(sink),
                alerts=len(rows),
                to=sorted({shown_sink(n) for went in rows for n in went if n != NO_SINK}),
                held=sum(went == [NO_SINK] for went in rows),
                nothing_to_resolve=sum(not went for went in rows),
                meaning="this sink is no longer configured (a corrected URL, a removed "
                "sink): the alerts that waited for it go to the sinks configured now that "
                "route them, or are held for a later start's; its rows are marked rehomed",
            )
        self._update_depth()
        return added

    def to_leave(self) -> list[tuple[int, str]]:
        """(row id, run id) of every row whose event may still be sent: those waiting, and
        the fires still firing on the sinks configured (re-sent to an Alertmanager; their
        resolves repeat their labels)."""
        return self._store.to_leave([s.name for s in self.sinks])

    def events(self, ids: Sequence[int]) -> list[tuple[int, AlertEvent]]:
        """(row id, event) of the rows ``ids``, oldest first."""
        return [(row_id, _load(text)) for row_id, text in self._store.events(ids)]

    def rewrite(self, events: Iterable[tuple[int, AlertEvent]]) -> int:
        """Replace the events of rows (masked again: AlertService.remask); rows rewritten."""
        changed = 0
        with self._store.transaction() as tx:
            for row_id, event in events:
                tx.set_event(row_id, _text(event))
                changed += 1
        return changed

    # --- reading ------------------------------------------------------------------

    def open_alerts(self) -> dict[str, list[str]]:
        """run_id -> alert names fired and not yet resolved (on any sink)."""
        out: dict[str, list[str]] = {}
        for run_id, alertname in self._store.open_alerts():
            out.setdefault(run_id, []).append(alertname)
        return out

    def rows(self, sink: str | None = None) -> list[OutboxRow]:
        return [_row(r) for r in self._store.rows(sink)]

    def depth(self) -> int:
        return self._store.count(PENDING)

    def _update_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.outbox_depth.set(self.depth())

    # --- delivering -----------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        await self.call(self.rehome)
        for sink in self.sinks:
            self._wake[sink.name] = asyncio.Event()
            self._tasks.append(
                asyncio.create_task(self._worker(sink), name=f"alert-outbox {sink.name}")
            )
        if self.metrics is not None and not self._store.inline:  # one process: add and _mark
            self._tasks.append(asyncio.create_task(self._refresh_depth(), name="outbox-depth"))
        self._rewrite_wake = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._rewrite(), name="outbox-rewrite"))

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
        # What add_soon still holds, and what the database refused before, commits before
        # the store closes (and before the closed flag, which add checks: a write queued on
        # PostgreSQL's thread failed as "closed" when the flag came first).
        if self._closed:
            return
        if self._io_thread is not None:
            self._io_thread.submit(self._write_last, [])
            self._io_thread.shutdown(wait=True)
        else:
            events, self._deferred = self._deferred, []
            self._write_last(events)
        self._closed = True
        self._store.close()

    def _write_last(self, events: list[AlertEvent]) -> None:
        """At close: the alerts held and then ``events``, asked once. What the database
        still refuses is lost to this process (logged, counted): the next start's
        re-evaluation raises again the alerts still open."""
        try:
            if self._unwritten.events:
                self._unwritten, dropped = self._unwritten.keep(
                    events, MAX_UNWRITTEN, MAX_UNWRITTEN_BYTES
                )
                self._count_dropped(dropped)
                self._write_again(0)
            elif events:
                self.add(events)
        except Exception as exc:
            self._lost(exc, len(self._unwritten.events) or len(events))
            self._written(Unwritten())

    async def wait_idle(self, limit: float = 10.0) -> bool:
        """True once nothing is pending (tests and benchmarks), False after ``limit`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        await self.flush()
        while await self.call(self.depth):
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
        row = self._store.next_row(sink, PENDING)
        return None if row is None else _row(row)

    def _mark(
        self, row: OutboxRow, state: str, error: str | None, sent: bool, hold: float = 0.0
    ) -> None:
        if not self._store.mark(row.id, state, error, sent, self._clock(), hold):
            # The send outlived its claim (a paused process) and another replica took the
            # row over: that one records the row, and ours may have been a second delivery.
            log.warning(
                "sidecar.alert.claim_lost",
                sink=shown_sink(row.sink),
                action=row.action,
                dedup_key=row.dedup_key,
                outcome=state,
            )
        if state != PENDING:
            self._update_depth()

    async def _refresh_depth(self) -> None:
        """Keep the depth gauge true to the rows every replica shares: counted again each
        DEPTH_REFRESH_S, on a shared store (on SQLite one process writes every row, and
        add and _mark set the gauge). A timer, not the injected sleep, which is the
        backoff's."""
        while True:
            await asyncio.sleep(DEPTH_REFRESH_S)
            # The database down: the workers log it; the gauge keeps its last count
            # until the database answers again.
            with contextlib.suppress(StoreError):
                await self.call(self._update_depth)

    def _count(self, alertname: str, kind: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.alerts.labels(alertname=alertname, sink=kind, outcome=outcome).inc()

    async def _worker(self, sink: Sink) -> None:
        wake = self._wake[sink.name]
        failures = 0  # the sink's, in a row
        outage = 0  # the database's, in a row
        while True:
            try:
                failures = await self._deliver_next(sink, wake, failures)
            except StoreError as exc:
                # The database is down or unreachable (a restart, a failover): nothing is
                # lost, the rows wait in it. Keep looking, backing off, as for a sink.
                outage += 1
                delay = self.backoff.delay(outage, self._rng)
                if outage == 1:
                    log.error(
                        "sidecar.outbox.store_failed",
                        sink=shown_sink(sink.name),
                        error=str(exc),
                        retry_in_s=round(delay, 3),
                    )
                await self._sleep(delay)
                continue
            if outage:
                log.info(
                    "sidecar.outbox.store_recovered",
                    sink=shown_sink(sink.name),
                    failed_attempts=outage,
                )
                outage = 0

    async def _deliver_next(self, sink: Sink, wake: asyncio.Event, failures: int) -> int:
        """Deliver ``sink``'s next row, or wait for one; the sink's failures in a row
        after it. Raises StoreError when the database fails."""
        wake.clear()
        row = await self.call(self._next, sink.name)
        if row is None:
            await self._idle(sink, wake)
            return failures
        # Still ours, and held for the whole send: a claim that ran out while this
        # replica was paused was taken over, and the replica that took it sends it.
        if not await self.call(self._store.sending, row.id, self._send_limit + SEND_MARGIN_S):
            return failures
        try:
            await self._send(sink, row.event)
        except DeliveryRejected as exc:
            failures = 0
            # Counted and logged before it is recorded: once the row is no longer
            # pending, a waiter (wait_idle, then stop) may cancel this worker at its
            # next await.
            self._count(row.event.alertname, sink.kind, OUTCOME_FAILED)
            log.error(
                "sidecar.alert.rejected",
                sink=shown_sink(sink.name),
                action=row.action,
                dedup_key=row.dedup_key,
                error=str(exc),
                fix="a configuration error (routing key, URL, token): fix the sink's "
                "settings; this alert is not retried",
            )
            await self._settle(row, FAILED, str(exc), False)
        except Exception as exc:
            # DeliveryRetry, or a bug in a sink: keep the row, never lose the alert.
            failures += 1
            retry_after = exc.retry_after if isinstance(exc, DeliveryRetry) else None
            delay = self.backoff.delay(failures, self._rng, retry_after)
            # Held for the delay: another replica must not retry it sooner.
            await self._settle(row, PENDING, f"{type(exc).__name__}: {exc}", False, delay)
            self._count(row.event.alertname, sink.kind, OUTCOME_RETRIED)
            if failures == 1:
                # Once per outage (and once when it ends): the retries are counted
                # in saga_sidecar_alerts_total{outcome="retried"}.
                log.warning(
                    "sidecar.sink.down",
                    sink=shown_sink(sink.name),
                    action=row.action,
                    dedup_key=row.dedup_key,
                    error=f"{type(exc).__name__}: {exc}",
                    retry_in_s=round(delay, 3),
                    exc_info=not isinstance(exc, DeliveryRetry),
                )
            await self._sleep(delay)
        else:
            if failures:
                log.info("sidecar.sink.up", sink=shown_sink(sink.name), failed_attempts=failures)
            failures = 0
            self._count(row.event.alertname, sink.kind, OUTCOME_DELIVERED)  # as above
            if self.metrics is not None:
                delay_s = max(0.0, self._clock() - row.event.at)
                self.metrics.delay.labels(sink=sink.kind).observe(delay_s)
            await self._settle(row, DELIVERED, None, True)
        return failures

    async def _send(self, sink: Sink, event: AlertEvent) -> None:
        """``sink.send(event)``, cut at the send's limit (a retry): no send outlives the
        hold on its row (see SEND_MARGIN_S)."""
        cut = asyncio.timeout(self._send_limit)
        try:
            async with cut:
                await sink.send(event)
        except TimeoutError:
            if not cut.expired():
                raise
            raise DeliveryRetry(f"no answer within {self._send_limit:g} s") from None

    async def _settle(
        self, row: OutboxRow, state: str, error: str | None, sent: bool, hold: float = 0.0
    ) -> None:
        """Record what a send did, even when the sidecar stops meanwhile: a delivered
        alert left pending would page again after the restart. Shielded, the write
        still runs on the database thread, and `close` waits for it."""
        await asyncio.shield(self.call(self._mark, row, state, error, sent, hold))

    async def _idle(self, sink: Sink, wake: asyncio.Event) -> None:
        interval = sink.resend_interval
        # A shared store (replicas): rows other replicas wrote, or left when they died,
        # wake no event here: look again every POLL_S.
        poll = None if self._store.inline else POLL_S
        if interval is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=poll)
            return
        due_in = await self.call(self._resend_due_in, sink.name, interval)
        if poll is not None:
            due_in = poll if due_in is None else min(due_in, poll)
        if due_in is None or due_in > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=due_in)
            if wake.is_set():
                return
        await self._resend(sink, interval)

    def _firing(self, sink: str) -> list[tuple[int, float, str]]:
        return self._store.firing(sink, DELIVERED)

    def _resend_due_in(self, sink: str, interval: float) -> float | None:
        plan = self._resend_plan(sink, self._firing(sink), interval)
        if not plan:
            return None
        return max(0.0, min(due_in for _, _, due_in, _ in plan))

    def _resend_plan(
        self, sink: str, firing: list[tuple[int, float, str]], interval: float
    ) -> list[tuple[int, str, float, float]]:
        """(row id, event, seconds until its re-send is due, the claim's bound) per firing
        row; due when <= 0, claimed while not re-sent since the bound (``resending``).

        Due an interval after its stored send time (wall clock, shared by replicas), or
        once this process has read that same stored time for an interval (monotonic): a
        time in the future, our clock stepped back or written by a replica whose clock is
        ahead, would otherwise hold the re-sends off (and Alertmanager would end the alert
        after its resolve_timeout) until the clock caught up. A re-send stores a new time,
        read as new, so replicas still re-send each alert once an interval.
        """
        now, mono = self._clock(), self._monotonic()
        seen = self._read_sent.get(sink, {})
        kept: dict[int, tuple[float, float]] = {}
        plan = []
        for row_id, sent, text in firing:
            first = seen.get(row_id)
            since = first[1] if first is not None and first[0] == sent else mono
            kept[row_id] = (sent, since)
            by_wall, by_reading = sent + interval - now, since + interval - mono
            # Claimed while its stored time is still the one read, when only that says due.
            bound = now - interval if by_wall <= 0 else sent
            plan.append((row_id, text, min(by_wall, by_reading), bound))
        self._read_sent[sink] = kept  # the rows still firing: bounded as they are
        return plan

    async def _resend(self, sink: Sink, interval: float) -> None:
        """Re-send still-firing alerts: an Alertmanager that restarted gets them back.

        Each is claimed first (``resending``), checking it still fires and is due: the
        list was read before, and meanwhile another replica may have delivered its
        resolve (a fire re-sent after it pages again) or re-sent it. Its resolve waits
        while the claim lives."""
        hold = self._send_limit + SEND_MARGIN_S
        firing = await self.call(self._firing, sink.name)
        for row_id, text, due_in, bound in self._resend_plan(sink.name, firing, interval):
            if due_in > 0:
                continue
            if not await self.call(self._store.resending, row_id, bound, hold):
                continue
            try:
                await self._send(sink, _load(text))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.warning("sidecar.alert.resend_failed", sink=shown_sink(sink.name), error=error)
                # Try again next interval; the first delivery already succeeded.
            sent = self._clock()
            await self.call(self._store.touch_sent, row_id, sent)
            # Read as sent now, even if the clock did not move since the last one.
            self._read_sent.setdefault(sink.name, {})[row_id] = (sent, self._monotonic())


# Alerts a run may raise again once resolved: an orphaned run whose agent was heard
# from (late, not dead) resolves, and if that agent then dies the run is orphaned anew,
# a death that must page. Every other alert pages a run once.
_EPISODIC: Final = frozenset({sc.ALERT_RUN_ORPHANED})


def _episode(tx: AlertTx, event: AlertEvent) -> AlertEvent:
    """``event`` numbered by what the outbox holds for its run: a fire after the last
    episode resolved opens the next; a fire while it is open (a re-evaluation, a
    restart) and a resolve belong to it. In the transaction that inserts it, so two
    replicas number alike (the unique key drops the second copy)."""
    actions: dict[int, set[str]] = {}
    for key, action in tx.keys(event.alertname, event.run_id):
        actions.setdefault(episode_of(key), set()).add(action)
    last = max(actions, default=0)
    if event.action is Action.FIRE and last and Action.RESOLVE.value in actions[last]:
        return replace(event, episode=last + 1)
    return replace(event, episode=last) if last > 1 else event


def _rehomed_note(sink: str, went: list[str]) -> str:
    """A rehomed row's last error, for the run page (sink names as shown to people)."""
    why = "held for no sink" if sink == NO_SINK else "its sink is no longer configured"
    if not went:
        return f"rehomed: {why}, and its fire reached none configured now: nothing to resolve"
    if went == [NO_SINK]:
        return f"rehomed: {why}, and none configured now routes it: held for a later start's"
    return f"rehomed: {why}; handed to {', '.join(sorted(shown_sink(n) for n in went))}"


def _nothing() -> None:
    return None


def _text(event: AlertEvent) -> str:
    """An event as its row holds it."""
    return json.dumps(event.to_dict(), sort_keys=True)


def _row(r: OutboxRecord) -> OutboxRow:
    return OutboxRow(
        r.id, r.dedup_key, r.action, r.sink, r.state, r.attempts, r.last_error, _load(r.event)
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


def alert_history(db: DbTarget | Path | str, run_id: str) -> list[AlertHistoryRow]:
    """The alert rows of one run, oldest first, read on a connection of their own.

    Empty when alerting never wrote to this database (no outbox table yet). Blocks:
    on PostgreSQL call it from a worker thread.
    """
    target = db if isinstance(db, DbTarget) else parse_db(db)
    return [_history_row(r) for r in alert_rows(target, run_id)]


def _history_row(r: HistoryRecord) -> AlertHistoryRow:
    try:
        summary = str(json.loads(r.event)["annotations"].get("summary", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        summary = ""
    # For people: a webhook's URL can hold its secret (rows written before errors hid it
    # quote it in full too).
    sink = str(r.sink)
    url = sink.partition(":")[2]
    error = r.last_error
    if error and "://" in url:
        error = error.replace(url, shown_url(url))
    return AlertHistoryRow(
        float(r.created_at),
        str(r.alertname),
        str(r.action),
        shown_sink(sink),
        str(r.state),
        int(r.attempts),
        error,
        summary,
    )
