"""The Sidecar service object: store, state, listeners, orphan ticker and the servers.

One asyncio loop runs everything. On SQLite intake runs on the loop (decode in the
request handler; screening, one SQLite transaction, the fold and the listeners in
one loop callback per group), which keeps a change, its commit and its listeners in
one order with no locks.
On PostgreSQL (``store.inline`` False) every database call runs on one worker
thread of the sidecar, in submission order, and intake holds an asyncio lock
from screening to folding: the same order, without the loop waiting on the
network. Across replicas a request is screened and stored in one transaction
holding its runs' owner row locks (``Store.write_screened``), so one run's
requests are taken one at a time whichever replicas they reach. Concurrent requests
share a transaction (group commit: the policy is ``_groups.py``; ``_commit_inline``
and ``_take_groups`` are its SQLite and PostgreSQL drivers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from aiohttp import web
from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from saga_otel import semconv as sc
from saga_otel.records import backoff_seconds, describe_error

from ._backends import hold_database, open_store
from ._connections import FD_RESERVE, PORTS, CappedSite, connection_cap, fd_limit
from ._errors import SidecarError, StoreError
from ._forward import Forwarder, cancel
from ._groups import GROUPS_IN_A_ROW, Groups, Pending, Screened, deliver, screen_in_order, settle
from ._grpc import start_grpc
from ._http import OtlpHandler, build_api_app, build_otlp_handler
from ._leases import (
    Lease,
    LeaseAction,
    LeaseRefusal,
    LeaseRequest,
    Liveness,
    Owner,
    SpanRefusal,
    grant,
    parse_request,
    release,
    renew,
    screen_span,
)
from ._log import get_logger
from ._metrics import SidecarMetrics
from ._otlp import MAX_ERROR_MESSAGES, Decoded, span_from_stored
from ._putaway import fold_stored, matches, summary_key
from ._redact import Redactor
from ._settings import DEFAULT_MAX_CONNECTIONS, LINGERING_TIME, Settings
from ._state import RunState, Transition
from ._storage import (
    EVICT_BATCH,
    PRUNE_BATCH,
    Changes,
    DbTarget,
    HeartbeatRow,
    IntakeRows,
    PutAway,
    Resolution,
    RunQuery,
    Screening,
    SpanRow,
    Store,
    heartbeat_row,
)
from ._views import RunSummary, RunView

T = TypeVar("T")

# The orphan rule judges silence; the sidecar must not take its own deafness for the
# agents' silence. A tick that wakes late means its loop was blocked (a GC pause, a slow
# SQLite commit on the loop, a stopped or starved process), so what agents sent
# meanwhile is still unread: such a tick does not judge; the next one does, once the
# backlog is read. A request still waiting for its commit (a locked or slow database)
# was heard at its arrival and its agent waits for the answer: ticks judge only up to
# the oldest such arrival (and, on replicas, the start of the last read of the others'
# writes), never further back than this: a sidecar deaf for longer still orphans the
# dead, a little later.
MAX_DEAF_DEFER_S = 5.0
# Replicas: the leader (the one replica that judges orphans) asks the database every
# tick; one that has not asked for this long (paused, cut off without a FIN, its loop
# blocked) loses the lead on the database's clock, and another replica takes it. Longer
# than a slow sync, short beside the orphan window.
LEADER_HOLD_S = 10.0
# Orphan marks the store refused are written again at a tick, after a backoff from the
# tick interval up to this: on SQLite each try may wait out the busy timeout on the loop.
MARKS_RETRY_MAX_S = 15.0


class TickGate:
    """Whether an orphan tick may judge (pure: the driver passes the loop's times).

    ``admit(asked, woke)``: the tick asked to wake at ``asked`` and woke at ``woke``.
    Later by more than ``slack`` (at least one tick interval): the loop did not run in
    between, so the tick defers, at most ``MAX_DEAF_DEFER_S`` in a row."""

    __slots__ = ("_deferred_at", "slack")

    def __init__(self, slack: float) -> None:
        self.slack = slack
        self._deferred_at: float | None = None

    def admit(self, asked: float, woke: float) -> bool:
        if woke - asked > self.slack:
            if self._deferred_at is None:
                self._deferred_at = woke
            if woke - self._deferred_at < MAX_DEAF_DEFER_S:
                return False
        self._deferred_at = None
        return True


# The orphan rule measures silence on the sidecar's clock: now minus the moment a span or
# heartbeat was received. A step of that clock (NTP stepping it, a VM resumed) is no
# silence: forward, every live agent would look dead at once; back, a dead one would look
# alive until the clock caught up. Each reading of the clock is compared with a steady
# clock that is never stepped (time.monotonic); when they part by more than this between
# two readings, the receipt times the state keeps move by the step before the reading is
# used (RunState.clock_stepped), so every silence is what it was. Below it a step is less
# than one heartbeat interval at saga_otel's default (1 s), against windows of three; and a
# reading delayed between the two clocks (a GC pause) is not taken for one.
#
# Why move the kept times, not keep them on the steady clock: they are wall times to
# everything else (stored, shown, compared with other replicas' rows, with leases and
# resolutions), and a step is rare: one event to the pure state, not a second time base
# through every rule.
STEP_SLACK_S = 1.0


class ClockSteps:
    """How far the sidecar's clock was stepped (pure: the driver passes each reading of it
    and of a steady clock, ``read(wall, steady)``): the step since the previous reading,
    signed, 0.0 within ``STEP_SLACK_S``. Each reading is the next one's reference, so a
    clock slewed (moved gradually, as NTP does below its step threshold) is never taken
    for a step, however long it slews."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None

    def read(self, wall: float, steady: float) -> float:
        last, self._last = self._last, (wall, steady)
        if last is None:
            return 0.0
        step = (wall - last[0]) - (steady - last[1])
        return step if abs(step) > STEP_SLACK_S else 0.0


def judged_as_of(now: float, waiting_since: float, read_from: float) -> float:
    """The moment an orphan tick judges as of (sidecar clock): ``now``, or earlier while
    a request that arrived at ``waiting_since`` waits for its commit, or (replicas) the
    last read of the others' writes began at ``read_from``; never before ``now -
    MAX_DEAF_DEFER_S``."""
    return max(now - MAX_DEAF_DEFER_S, min(now, waiting_since, read_from))


log = get_logger("sidecar")

Listener = Callable[[RunView | None, RunView, float], None]
"""``fn(before, after, now)``: called after each committed change to a run view."""
BackgroundFactory = Callable[[], Awaitable[None]]


def task_name(factory: BackgroundFactory) -> str:
    """A background task's name as logs and ``/healthz`` show it: where it is defined
    (``Sidecar._tick_loop``, ``install_alerting.deliver``)."""
    return str(getattr(factory, "__qualname__", factory)).replace("<locals>.", "")


_Taken = tuple[Decoded, dict[str, Owner], set[tuple[str, str]]]
"""A screened member of a group: its accepted spans, the runs it opens, its resends."""


@dataclass(frozen=True, slots=True)
class _Request:
    """A request in a group commit (``_groups.py``), answered through ``answer``."""

    decoded: Decoded
    transport: str
    body: bytes | None
    content_type: str
    answer: asyncio.Future[Decoded]


class Sidecar:
    """The service. Use ``async with Sidecar(settings) as sidecar:`` in process, or the CLI.

    Ports of ``settings`` may be 0; after start the bound ones are
    ``otlp_http_port``, ``otlp_grpc_port`` and ``api_port``. ``clock`` is the wall
    clock (seconds since the epoch); ``steady``, one that is never stepped, against
    which a step of ``clock`` is told (see ``ClockSteps``).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        steady: Callable[[], float] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings if settings is not None else Settings()
        self.clock = clock
        # The clock steps of ``clock`` are told against (ClockSteps): time.monotonic with
        # the system's clock; with another (a test's), that clock itself, which then moves
        # only as time passes, unless its steady partner is given too.
        if steady is None:
            steady = time.monotonic if clock is time.time else clock
        self._steady = steady
        self._steps = ClockSteps()
        self._stepped = 0.0  # the sum of the steps told so far (seconds)
        self.metrics = SidecarMetrics(registry)
        self.state = RunState(self.settings.idle_timeout)
        self.store: Store | None = None
        self.forwarder: Forwarder | None = None
        self.otlp_http_port: int | None = None
        self.otlp_grpc_port: int | None = None
        self.api_port: int | None = None
        self.in_flight = 0
        # Masks tool arguments in API views; install_alerting sets the configured one.
        self.redactor = Redactor()
        # --public-url (install_alerting sets it): the pages' links and the Host check.
        self.public_url: str | None = None
        # The alert sinks as their names are shown (kind and URL without its path, never a
        # key): install_alerting sets them, ``sidecar.started`` lists them.
        self.alert_sinks: list[str] | None = None
        # (fn, facts_only): see add_listener.
        self._listeners: list[tuple[Listener, bool]] = []
        self._background: list[BackgroundFactory] = []
        self._api_routes: list[web.AbstractRouteDef] = []
        self._tasks: list[asyncio.Task[None]] = []
        # Background tasks that ended by an error since start (their names): /healthz.
        self.failed_tasks: list[str] = []
        self._runners: list[web.BaseRunner] = []
        self._grpc: aio.Server | None = None
        self._started = False
        self._span_counters: dict[tuple[str, str], Counter] = {}
        # Live connections per agent instance (saga_otel's presence streams).
        self._presence: dict[str, int] = {}
        # A store that is not inline (PostgreSQL): its calls, one at a time, in order.
        self._db_thread: ThreadPoolExecutor | None = None
        self._held: int | None = None  # the SQLite file's lock while serving it
        self._intake = asyncio.Lock()
        # Group commit (_groups.py): the requests waiting, in groups, for their
        # transaction; on PostgreSQL the task taking them (_take_groups).
        self._groups: Groups[_Request] = Groups()
        self._taking: asyncio.Task[None] | None = None
        # Requests heard and not yet answered: their answer future -> clock at arrival (in
        # arrival order: the first is the oldest). The orphan tick judges up to it.
        self._unfolded: dict[asyncio.Future[Decoded], float] = {}
        # Requests answered 503 since the store last failed (0: it is not failing): the
        # failure is logged when it begins and when it ends, not once per request.
        self._store_refusals = 0
        # Replicas: the clock when the last read of the others' writes began (sync).
        self._read_from = float("inf")
        self.leading = False  # replicas: whether this one detects orphans (see _tick_loop)
        self._resolving = asyncio.Lock()
        # Orphan marks the store refused (run -> mark), written again at a later tick
        # (_store_marks_again): a restart, and the other replicas, know an orphaning only
        # by its stored mark. One per run; those no longer their runs' are dropped.
        self._unstored: dict[str, float] = {}
        self._marks_failures = 0  # tries in a row the store refused (the backoff's)
        self._marks_due = 0.0  # time.monotonic() of the next try

    # --- hooks for the alerting side --------------------------------------------

    @property
    def db_path(self) -> Path:
        """The SQLite file (see :attr:`database` for PostgreSQL)."""
        return self.settings.resolved_db_path

    @property
    def database(self) -> DbTarget:
        return self.settings.database

    def add_listener(self, fn: Listener, *, facts_only: bool = False) -> None:
        """Call ``fn(before, after, now)`` after every committed change to a run view.

        With ``facts_only``, intake calls ``fn`` only for runs whose alert-relevant
        facts changed (``_state._facts``: status, unwind start, escalation, pivot,
        compensation failures, resolution; a new run counts as changed when its facts
        differ from a fresh running run's), which saves building two views per run
        and batch. Orphaning and resolution always call it.
        """
        self._listeners.append((fn, facts_only))

    def add_background(self, factory: BackgroundFactory) -> None:
        """Run ``factory()`` as a task from start to stop (cancelled on stop)."""
        self._background.append(factory)
        if self._started:
            self._spawn(factory)

    def add_api_routes(self, routes: Iterable[web.AbstractRouteDef]) -> None:
        """Extra aiohttp routes on the API port; add them before start."""
        if self._started:
            raise SidecarError("add_api_routes() after start(): add routes before starting")
        self._api_routes.extend(routes)

    @property
    def api_routes(self) -> list[web.AbstractRouteDef]:
        return list(self._api_routes)

    def listening(self) -> dict[str, str | int | None]:
        return {
            "event": "sidecar.listening",
            "host": self.settings.host,
            "otlp_http": self.otlp_http_port,
            "otlp_grpc": self.otlp_grpc_port,
            "api": self.api_port,
            "db": self.database.shown,
        }

    # --- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> Sidecar:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._started:
            return
        target = self.database
        try:
            self.settings.validate()
            self.hold_database()
            if target.backend == "sqlite":
                self.store = open_store(target)
                self._rebuild()
            else:
                self.store = await asyncio.to_thread(open_store, target)
                self._db_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saga-db")
                # Nothing listens yet: the state is ours alone while the thread folds it.
                await self._call(self._rebuild)
        except BaseException:
            self._release()
            raise
        self._started = True
        self.failed_tasks = []
        self.metrics.tasks_failed.set(0)
        cap = self._connection_cap()
        try:
            host = self.settings.host
            self.otlp_http_port = await self._serve_app(
                build_otlp_handler(self), host, self.settings.otlp_http_port, cap, "otlp_http"
            )
            self.api_port = await self._serve_app(
                build_api_app(self), host, self.settings.api_port, cap, "api"
            )
            self._grpc, self.otlp_grpc_port = await start_grpc(
                self, host, self.settings.otlp_grpc_port, cap
            )
            if self.settings.forward:
                self.forwarder = Forwarder(
                    self.settings.forward,
                    queue_size=self.settings.forward_queue,
                    on_drop=self.metrics.forward_dropped.inc,
                )
                self._spawn(self.forwarder.run)
            self._spawn(self._tick_loop)
            self._spawn(self._prune_loop)
            self._spawn(self._evict_loop)
            for factory in self._background:
                self._spawn(factory)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "sidecar.started",
            **{k: v for k, v in self.listening().items() if k != "event"},
            max_connections=cap,
            **({} if self.alert_sinks is None else {"alert_sinks": self.alert_sinks}),
        )

    def _connection_cap(self) -> int:
        """The connections each port holds (--max-connections, or fewer: see _connections).
        The default is lowered in silence (``sidecar.started`` shows it, and a port that
        fills says so with the fix); a number given is lowered with a warning."""
        asked, limit = self.settings.max_connections, fd_limit()
        wanted = asked if asked is not None else DEFAULT_MAX_CONNECTIONS
        cap = connection_cap(wanted, limit)
        if asked is not None and cap < asked:
            log.warning(
                "sidecar.connections.capped",
                max_connections=cap,
                asked=wanted,
                fd_limit=limit,
                fix=f"this process may open {limit} files: raise the limit (ulimit -n, "
                f"LimitNOFILE= in a systemd unit) to at least {wanted * PORTS + FD_RESERVE} "
                f"for {wanted} connections on each of the {PORTS} ports",
            )
        return cap

    async def _serve_app(
        self, app: web.Application | OtlpHandler, host: str, port: int, cap: int, name: str
    ) -> int:
        # auto_decompress=False: the OTLP handler inflates gzip itself, with a bound
        # (a gzip bomb must cost a 413, not memory).
        # lingering_time: after an answer to a request whose body was not read (401, 408,
        # 413, 429, 503), drain and drop the rest for at most this long before closing
        # (aiohttp's default, 10 s, keeps a stalled client's connection that much longer).
        # keepalive_timeout: aiohttp arms it when a connection opens and after each answer,
        # and closes the connection if no whole request head (request line and headers)
        # has arrived when it fires, however many bytes of one did: one timer bounds the
        # idle wait before the first request and between requests, and the head's arrival
        # (aiohttp's default is an hour; up to 3.14.3 it was not armed before a first
        # request at all). The body then has its own deadline (_http._read_bounded).
        options: dict[str, Any] = {
            "access_log": None,
            "auto_decompress": False,
            "lingering_time": LINGERING_TIME,
            "keepalive_timeout": self.settings.keepalive_timeout,
        }
        # The OTLP port is a bare handler on aiohttp's low-level server (no router).
        runner: web.BaseRunner = (
            web.AppRunner(app, **options)
            if isinstance(app, web.Application)
            else web.ServerRunner(web.Server(app, **options))
        )
        await runner.setup()
        self._runners.append(runner)
        # aiohttp's TCPSite with a connection cap (aiohttp has none: _connections.py).
        refused = self.metrics.connections_refused.labels(port=name).inc
        site = CappedSite(runner, host, port, limit=cap, name=name, refused=refused)
        try:
            await site.start()
        except OSError as exc:
            raise SidecarError(
                f"cannot listen on {host}:{port}: {exc}; pick a free port (or 0 for any)"
            ) from exc
        # One site per runner: its first address is ours (public API, no private attribute).
        addresses = runner.addresses
        return int(addresses[0][1]) if addresses else port

    def _spawn(self, factory: BackgroundFactory) -> None:
        async def guarded() -> None:
            try:
                await factory()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._task_failed(task_name(factory), exc)

        self._tasks.append(asyncio.create_task(guarded()))

    def _task_failed(self, task: str, exc: Exception) -> None:
        """A background task ended by an error: what it did (deliver alerts, judge
        orphans, prune) has stopped for good, so the sidecar says so where it is watched
        (``/healthz`` answers 503, ``saga_sidecar_tasks_failed``), not only in one log
        line. Not restarted here: a fault that killed it once would again, in a loop."""
        self.failed_tasks.append(task)
        self.metrics.tasks_failed.set(len(self.failed_tasks))
        log.error(
            "sidecar.task.failed",
            task=task,
            error=describe_error(exc),
            exc_info=exc,
            fix="what this task does has stopped until the sidecar restarts (the state and "
            "the alert outbox are stored: a restart raises every alert owed); report the "
            "error with this line",
        )

    async def stop(self) -> None:
        if not self._started:
            self._release()  # a hold taken before start (install_alerting)
            return
        self._started = False
        for task in self._tasks:
            await cancel(task)
        self._tasks.clear()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
            self._grpc = None
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        async with self._intake:
            if self._db_thread is not None:
                # Orphan marks and prunes submitted without waiting commit first.
                await asyncio.to_thread(self._db_thread.shutdown, wait=True)
                self._db_thread = None
            if self.store is not None:
                self.store.close()
                self.store = None
        self._release()

    def hold_database(self) -> None:
        """Claim the database for this process (a SQLite file's lock, ``hold_file``; nothing
        on PostgreSQL) before anything in it opens the database: ``start`` does, and
        ``install_alerting`` before its outbox opens the file, so a second sidecar refused
        (StoreError) never opened it. Once is enough; ``stop`` lets go."""
        if self._held is None:
            self._held = hold_database(self.database)

    def _release(self) -> None:
        if self._held is not None:
            os.close(self._held)  # the file's lock goes with it (see hold_file)
            self._held = None

    # --- the database, inline or on its thread -----------------------------------

    async def flush(self) -> None:
        """Wait until every database write submitted so far is committed (see _submit)."""
        await self._call(_nothing)

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` inline (SQLite) or on the database thread (PostgreSQL)."""
        if self._db_thread is None:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db_thread, functools.partial(fn, *args))

    def _submit(
        self,
        what: str,
        fn: Callable[..., object],
        *args: object,
        fix: str | None = None,
        failed: Callable[[], None] | None = None,
    ) -> None:
        """``fn(*args)`` without waiting for it on PostgreSQL (in order with every other
        call); at once on SQLite. Failures are logged (``what`` failed): only for writes
        the state re-derives after a restart (prunes), that ``failed`` writes again (it
        is called on the loop), or whose loss ``fix`` says what it costs."""
        if self._db_thread is None:
            fn(*args)
            return
        loop = None
        if failed is not None:
            with contextlib.suppress(RuntimeError):  # no loop: nothing to hand it to
                loop = asyncio.get_running_loop()

        def done(future: Future[object]) -> None:
            exc = future.exception()
            if exc is not None:
                if fix is None:
                    log.error("sidecar.db.write_failed", what=what, error=str(exc), rederived=True)
                else:
                    log.error("sidecar.db.write_failed", what=what, error=str(exc), fix=fix)
                if failed is not None and loop is not None and isinstance(exc, StoreError):
                    with contextlib.suppress(RuntimeError):  # the loop closed: stopping
                        loop.call_soon_threadsafe(failed)

        self._db_thread.submit(fn, *args).add_done_callback(done)

    def _write_later(
        self,
        what: str,
        fn: Callable[..., object],
        arg: object,
        *,
        event: str,
        fix: str,
        failed: Callable[[], None] | None = None,
    ) -> None:
        """:meth:`_submit` from intake or the tick, which must go on whatever the store
        says: a store error is logged as ``event``, with what it costs (``fix``), whether
        it comes at once (SQLite) or later (PostgreSQL's thread), and ``failed`` is called."""
        try:
            self._submit(what, fn, arg, fix=fix, failed=failed)
        except StoreError:
            log.exception(event, fix=fix)
            if failed is not None:
                failed()

    def _rebuild(self) -> None:
        """Fold the stored runs not put away back into the state (clocks restart now: we
        were deaf); finished ones found among them leave memory at the next evict_async()."""
        assert self.store is not None
        now = self._now()
        store = self.store
        count = fold_stored(
            self.state, store.spans(), store.owners(), store.marks(), store.leases(now), now
        )
        for instance, _at, interval in store.instances():
            self.state.restore_instance(instance, now, interval)
        if count:
            log.info("sidecar.rebuilt", runs=len(self.state), spans=count)

    # --- finished runs: put away from memory, served from the store (_putaway.py) ------

    async def evict_async(self) -> list[str]:
        """Put the settled runs (ended, needing no person) away: index them in the store,
        then forget them here; ``EVICT_BATCH`` runs at a time, with a loop turn between
        batches (under a saturated intake ~40,000 runs settle in an evict interval: in
        one pass on SQLite they held the loop ~0.8 s, every request and tick waiting).
        On a store that is not inline each batch goes between two intakes. A run that
        stopped being settled before its batch (a late span) stays.

        A group waiting for its commit does not hold this off: nothing of it has been
        screened yet, and its commit finds a span of a run put away here through the
        store (``_commit_inline``: ``put_away_of``, then the run read back whole), as it
        finds any late span."""
        store = self.store
        if store is None:
            return []
        candidates = self.state.settled()
        gone: list[str] = []
        for start in range(0, len(candidates), EVICT_BATCH):
            if start:
                await asyncio.sleep(0)  # the requests and ticks due go first
            batch = candidates[start : start + EVICT_BATCH]
            if store.inline:
                rows = self._index_rows(batch)
                if rows:
                    store.put_away(rows)
            else:
                async with self._resolving, self._intake:  # resolve's order
                    rows = self._index_rows(batch)
                    if rows:
                        await self._call(store.put_away, rows)
            self.state.forget(r.run_id for r in rows)
            gone += [r.run_id for r in rows]
        return gone

    def _index_rows(self, candidates: list[str]) -> list[PutAway]:
        """The index rows of those of ``candidates`` still settled."""
        state = self.state
        rows = []
        for run_id in state.settled(candidates):
            row = state.index_row(run_id)
            if row is not None:
                rows.append(PutAway(run_id, *row))
        return rows

    async def _evict_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.evict_interval)
            try:
                gone = await self.evict_async()
            except StoreError as exc:
                log.warning("sidecar.evict.failed", error=str(exc), fix="retried next interval")
                continue
            if gone:
                log.debug("sidecar.evicted", runs=len(gone))

    def _restored(self, loaded: Changes) -> None:
        """Runs read back from the store (``reopen``) into the live state."""
        known = self.state
        fresh = {s.run_id for s in loaded.spans} | {r for r, _ in loaded.owners}
        fresh = {r for r in fresh if r not in known}
        if not fresh:
            return
        fold_stored(
            known,
            (s for s in loaded.spans if s.run_id in fresh),
            [(r, o) for r, o in loaded.owners if r in fresh],
            [m for m in loaded.marks if m.run_id in fresh],
            [lease for lease in loaded.leases if lease.run_id in fresh],
            self._now(),
        )
        log.debug("sidecar.runs.reopened", runs=len(fresh))

    async def _reopen(self, run_ids: Iterable[str]) -> None:
        """Bring put-away runs among ``run_ids`` back into memory (a late span, a lease
        or a resolution is about to change them). Callers hold the intake lock."""
        store = self.store
        missing = sorted({r for r in run_ids if r not in self.state})
        if store is None or not missing:
            return
        away = await self._call(store.put_away_of, missing)
        if away:
            await self._bring_back(store, sorted(away))

    async def _bring_back(self, store: Store, run_ids: list[str]) -> None:
        """Read the put-away ``run_ids`` back from the store into the live state."""
        now, stepped = self._now(), self._stepped
        loaded = await self._call(_load_reopen, store, run_ids, now)
        self._restored(loaded._replace(leases=self._caught_up(loaded.leases, stepped)))

    def _caught_up(self, leases: Iterable[Lease], stepped: float) -> list[Lease]:
        """``leases`` read on this sidecar's clock when the sum of its steps was
        ``stepped``, moved by any step told since (``_clock_stepped`` moved those the
        state held meanwhile, not these)."""
        by = self._stepped - stepped
        return [lease.moved(by) for lease in leases]

    async def lookup(self, run_id: str) -> RunState:
        """The state that knows ``run_id``: ours, or for a run put away, a scratch state
        folded from the store (answers only; nothing in it is kept). Raises StoreError."""
        store = self.store
        if run_id in self.state or store is None:
            return self.state
        return await self._scratch([run_id])

    async def views(self, run_ids: list[str]) -> dict[str, RunView]:
        """The views of ``run_ids`` that are known: ours, or for runs put away, folded from
        the store into one scratch state (answers only, as :meth:`lookup`). Raises
        StoreError. Callers bound ``run_ids``: the put-away ones are read at once."""
        state, store = self.state, self.store
        found = {r: v for r in run_ids if (v := state.view(r)) is not None}
        away = [r for r in run_ids if r not in found]
        if away and store is not None:
            scratch = await self._scratch(away)
            found.update((r, v) for r in away if (v := scratch.view(r)) is not None)
        return found

    async def _scratch(self, run_ids: list[str]) -> RunState:
        assert self.store is not None
        now, stepped = self._now(), self._stepped
        loaded = await self._call(self.store.load_runs, run_ids, now)
        loaded = loaded._replace(leases=self._caught_up(loaded.leases, stepped))
        scratch = RunState(self.settings.idle_timeout)
        fold_stored(scratch, loaded.spans, loaded.owners, loaded.marks, loaded.leases, self._now())
        return scratch

    async def runs_page(
        self, query: RunQuery, limit: int, *, needs_person: bool = False
    ) -> tuple[list[tuple[RunSummary, RunView | None]], bool]:
        """One page of ``GET /runs``: the runs in memory and those put away (from the
        store's index), merged newest first; each with its view; and whether more follow.
        """
        state = self.state
        found = [
            (r, state)
            for r in state.summaries(
                status=query.status,
                saga=query.saga,
                since=query.since,
                until=query.until,
                needs_person=needs_person,
                id_prefix=query.id_prefix,
            )
            if query.before is None or summary_key(r) < query.before
        ]
        store = self.store
        # Put-away runs are settled: none needs a person.
        if store is not None and not needs_person:
            cursor = query
            while True:
                rows = await self._call(store.put_away_page, cursor, limit + 1)
                fresh = [r for r, _ in rows if r not in state]
                if fresh:
                    scratch = await self._scratch(fresh)
                    found += [(s, scratch) for s in scratch.summaries()]
                if len(rows) <= limit or len(fresh) == len(rows):
                    break
                # Some are in memory (listed from there already): read on past them.
                cursor = cursor._replace(before=(rows[-1][1], rows[-1][0]))
        found = [(s, st) for s, st in found if matches(s, query)]
        found.sort(key=lambda p: summary_key(p[0]), reverse=True)
        page = found[:limit]
        return [(s, st.view(s["run_id"])) for s, st in page], len(found) > limit

    # --- intake ---------------------------------------------------------------------

    def enter(self) -> bool:
        """Take an in-flight slot; False when the sidecar is at its bound (answer 429)."""
        if self.in_flight >= self.settings.max_in_flight:
            return False
        self.in_flight += 1
        return True

    def leave(self) -> None:
        self.in_flight -= 1

    async def ingest(
        self, decoded: Decoded, transport: str, body: bytes | None = None, content_type: str = ""
    ) -> Decoded:
        """Screen, store, fold and announce one request's spans. Raises StoreError (503).

        Returns ``decoded`` less the spans the ownership, fencing and id rules refused
        (counted in its ``rejected`` and ``errors``: answer with those). The spans are
        committed before this returns; spans not stored (StoreError) are counted
        ``unavailable``, so a failing database shows on /metrics, not only in the log.

        Group commit (the policy: ``_groups.py``): the request joins the newest group;
        SQLite commits each group in a loop callback (``_commit_inline``), PostgreSQL
        takes them under the intake lock (``_take_groups``).
        """
        store = self.store
        if store is None:
            self._spans_counter(transport, "unavailable").inc(len(decoded.spans))
            raise StoreError("the sidecar is not running: start it before sending spans")
        if not decoded.spans:  # nothing to screen or store: answered at once
            return self._fold(decoded, transport, body, content_type, {}, self._now(), set())
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Decoded] = loop.create_future()
        request = _Request(decoded, transport, body, content_type, answer)
        if self._groups.join(request, len(decoded.spans)):
            if store.inline:
                loop.call_soon(self._commit_inline)
            elif self._taking is None:
                self._taking = asyncio.create_task(self._take_groups())
        unfolded = self._unfolded
        unfolded[answer] = self._now()
        try:
            stored = await answer
        except StoreError as exc:  # not stored: the exporter resends after our 503
            self._spans_counter(transport, "unavailable").inc(len(decoded.spans))
            if not self._store_refusals:
                log.error(
                    "sidecar.intake.store_failed",
                    error=str(exc),
                    fix="agents resend after the 503; look at the database (disk full, "
                    "permissions, PostgreSQL down or locked)",
                )
            self._store_refusals += 1
            raise
        finally:
            del unfolded[answer]
        if self._store_refusals:
            log.warning("sidecar.intake.store_recovered", refused_requests=self._store_refusals)
            self._store_refusals = 0
        return stored

    def _commit_inline(self) -> None:
        """SQLite's driver of the group commit: the oldest group, screened in arrival
        order against memory and the store, written in one transaction on the loop, then
        folded in order (a change, its commit and its listeners keep one order without
        locks). Runs as a loop callback after the requests that joined the group."""
        groups = self._groups
        if groups and not groups.due():  # still growing: look again after a loop turn
            asyncio.get_running_loop().call_soon(self._commit_inline)
            return
        group = groups.take()
        if group is None:
            return
        outcomes: list[_Taken | Exception] | Exception
        now = self._now()
        try:
            store = self.store
            if store is None:
                raise StoreError("the sidecar is stopping: retry against another replica")
            unknown = self._unknown_runs(group)
            if unknown:
                away = store.put_away_of(unknown)
                if away:  # late spans of finished runs: fold them onto the whole run
                    self._restored(store.load_runs(sorted(away), now, reopen=True))
            prior = store.stored_spans([k for r in group for k in self._known_keys(r.decoded)])
            screen = functools.partial(self._screen_member, now, prior, None)
            rows, outcomes = screen_in_order(group, screen)
            if rows.spans or rows.heartbeats:
                store.write(rows.spans, rows.heartbeats, rows.owners)
        except Exception as exc:  # nothing of the group stored
            outcomes = exc
        # Folded as of now, not as of the screening: a COMMIT that waited on a lock kept
        # the agents waiting for their answers too, and their silence meanwhile is ours.
        settle(group, outcomes, functools.partial(self._fold_taken, self._now(), None, 0), _answer)

    async def _take_groups(self) -> None:
        """PostgreSQL's driver of the group commit: the groups, oldest first, each in one
        transaction, under ``_intake``. While one group's transaction runs on the database
        thread, the group committed before it is folded (transactions commit in submission
        order and the folds follow them). At most GROUPS_IN_A_ROW groups per hold of the
        lock, so eviction, sync and leases get their turn."""
        try:
            while self._groups:
                async with self._intake:
                    committed: Callable[[], None] | None = None
                    for _ in range(GROUPS_IN_A_ROW):
                        group = self._groups.take()
                        if group is None:
                            break
                        running: Coroutine[object, object, Callable[[], None]] | None = None
                        try:
                            running = await self._start_group(group)
                        except Exception as exc:  # nothing of the group stored
                            settle(group, exc, _never, _answer)
                        if committed is not None:  # the group before, while this one runs
                            committed()
                            committed = None
                        if running is None:
                            continue
                        try:
                            committed = await running
                        except Exception as exc:  # the whole group failed: none folded
                            settle(group, exc, _never, _answer)
                    if committed is not None:
                        committed()
        finally:
            self._taking = None

    async def _start_group(
        self, group: list[_Request]
    ) -> Coroutine[object, object, Callable[[], None]]:
        """Submit one transaction for every request of ``group`` to the database thread:
        the union of their runs' owner rows locked in run id order, the requests screened
        in arrival order (``_decide_group``), one COMMIT. Returns what to await for it
        (then call, to fold each request in order and answer it). Awaiting raises if the
        transaction failed (503 for every member: nothing of theirs stored or folded)."""
        store = self.store
        if store is None:
            raise StoreError("the sidecar is stopping: retry against another replica")
        # Late spans of runs put away finished: fold them onto the whole run, read
        # back from the store before the group's spans are screened and stored.
        unknown = self._unknown_runs(group)
        if unknown:
            away = await self._call(store.put_away_of, unknown)
            if away:
                await self._bring_back(store, sorted(away))
        now, stepped = self._now(), self._stepped
        keys = list(
            dict.fromkeys(k for r in group for k in self._known_keys(r.decoded, every=True))
        )
        openers: dict[str, Owner] = {}
        for request in group:
            for run_id, owner in self._openers(request.decoded):
                openers.setdefault(run_id, owner)
        call = functools.partial(
            store.write_screened,
            keys,
            sorted(openers.items()),
            now,
            functools.partial(self._decide_group, group, now),
        )
        loop = asyncio.get_running_loop()
        tx: asyncio.Future[tuple[tuple[list[_Taken | Exception], Screening], int]]
        if self._db_thread is None:  # a store opened without start(): at once, as _call
            tx = loop.create_future()
            try:
                tx.set_result(call())
            except Exception as exc:
                tx.set_exception(exc)
        else:  # submitted now, not when awaited: it runs while the group before is folded
            tx = loop.run_in_executor(self._db_thread, call)
        return self._committed(tx, group, stepped)

    async def _committed(
        self,
        tx: asyncio.Future[tuple[tuple[list[_Taken | Exception], Screening], int]],
        group: list[_Request],
        stepped: float,
    ) -> Callable[[], None]:
        (outcomes, found), change = await tx
        return functools.partial(self._fold_group, group, outcomes, found, change, stepped)

    def _fold_group(
        self,
        group: list[_Request],
        outcomes: list[_Taken | Exception],
        found: Screening,
        change: int,
        stepped: float,
    ) -> None:
        """Fold a committed PostgreSQL group's requests in order and answer each, as of
        now (as SQLite's: a transaction that waited kept its agents waiting), with the
        change number the transaction gave their rows (orphan marks are ordered by it).
        ``stepped``: the sum of the clock's steps when its leases were read."""
        # The runs this group opened are new to the state (apply opens them with their
        # owner); the others' owners and leases may be news from other replicas.
        opened = {r: o for r, o in found.owners.items() if r in found.opened}
        self._learn(
            {r: o for r, o in found.owners.items() if r not in opened},
            self._caught_up(found.leases.values(), stepped),
        )
        now = self._now()
        fold = functools.partial(self._fold_taken, now, opened, change)
        settle(group, outcomes, fold, _answer)

    def _decide_group(
        self, group: list[_Request], now: float, found: Screening
    ) -> tuple[IntakeRows, tuple[list[_Taken | Exception], Screening]]:
        """Screen a PostgreSQL group in arrival order against the store's owners, leases and
        spans of its runs, read under their row locks (on the database thread, inside
        ``write_screened``: another replica may have opened, leased or written these runs
        since our last sync)."""
        screen = functools.partial(self._screen_member, now, found.stored, found)
        rows, outcomes = screen_in_order(group, screen)
        return rows, (outcomes, found)

    def _screen_member(
        self,
        now: float,
        stored: dict[tuple[str, str], bytes],
        known: Screening | None,
        request: _Request,
        pending: Pending,
    ) -> Screened[_Taken]:
        """One member of a group screened (``_screen``) and its rows to store."""
        decoded, owners, resent = self._screen(
            request.decoded, request.transport, stored, known, pending
        )
        rows, heartbeats = self._rows(decoded, now)
        return Screened(
            IntakeRows(rows, heartbeats, list(owners.items())), (decoded, owners, resent)
        )

    def _fold_taken(
        self,
        now: float,
        opened: dict[str, Owner] | None,
        change: int,
        request: _Request,
        taken: _Taken,
    ) -> Decoded:
        """Fold one committed member (``opened``: the runs its group opened, PostgreSQL;
        else the ones it opened; ``change``: its transaction's change number, or 0)."""
        decoded, owners, resent = taken
        try:
            return self._fold(
                decoded, request.transport, request.body, request.content_type,
                owners if opened is None else opened, now, resent, change,
            )  # fmt: skip
        except Exception:  # a bug: the spans are committed, say so in the log
            log.exception("sidecar.fold.failed", spans=len(decoded.spans))
            raise

    def _openers(self, decoded: Decoded) -> list[tuple[str, Owner]]:
        """The owner each run of the request gets if it is new: its first span's that may
        open it (a valid run id, no recovery token), as ``_screen`` would pick. Runs this
        replica knows have their owner row already (skipped: one insert less each)."""
        first: dict[str, Owner] = {}
        bad: set[str] = set()
        state = self.state
        for span in decoded.spans:
            attrs = span.attributes
            if attrs.get(sc.SAGA_PHASE) == sc.PHASE_HEARTBEAT:
                continue
            run_id = attrs[sc.SAGA_RUN_ID]
            if run_id in first or run_id in bad or attrs.get(sc.SAGA_RECOVERY_TOKEN) is not None:
                continue
            if state.owner(run_id) is not None:
                bad.add(run_id)
                continue
            if sc.run_id_problem(run_id) is not None:
                bad.add(run_id)
                continue
            first[run_id] = Owner(span.trace_id, span.instance, span.service)
        return list(first.items())

    def _unknown_runs(self, group: list[_Request]) -> list[str]:
        """Run ids of a group's saga spans not in memory (new runs, or runs put away)."""
        state = self.state
        out: dict[str, None] = {}
        for request in group:
            for span in request.decoded.spans:
                run_id = span.attributes.get(sc.SAGA_RUN_ID)
                if isinstance(run_id, str) and run_id not in state:
                    out[run_id] = None
        return list(out)

    def _known_keys(self, decoded: Decoded, every: bool = False) -> list[tuple[str, str]]:
        """(run_id, span_id) of saga spans of runs already owned (``every``: of all runs):
        their duplicates are checked against the stored bytes."""
        state = self.state
        keys = []
        for span in decoded.spans:
            attrs = span.attributes
            if attrs.get(sc.SAGA_PHASE) == sc.PHASE_HEARTBEAT:
                continue
            run_id = attrs[sc.SAGA_RUN_ID]
            if every or state.owner(run_id) is not None:
                keys.append((run_id, span.span_id))
        return keys

    def _learn(self, owners: dict[str, Owner], leases: Iterable[Lease]) -> None:
        """Owners and leases from the store (other replicas') into the state."""
        state = self.state
        for run_id, owner in owners.items():
            if state.owner(run_id) is None:
                state.set_owner(run_id, owner)
        for lease in leases:
            current = state.lease(lease.run_id)
            if current is None or _lease_order(lease) > _lease_order(current):
                state.set_lease(lease)

    @staticmethod
    def _rows(decoded: Decoded, now: float) -> tuple[list[SpanRow], list[HeartbeatRow]]:
        rows: list[SpanRow] = []
        heartbeats: list[HeartbeatRow] = []
        for span, raw in zip(decoded.spans, decoded.raw, strict=True):
            attrs = span.attributes
            if attrs.get(sc.SAGA_PHASE) == sc.PHASE_HEARTBEAT:
                heartbeats.append(
                    heartbeat_row(
                        span.instance,
                        now,
                        float(attrs.get(sc.SAGA_HEARTBEAT_INTERVAL_S, 1.0)),
                        attrs.get(sc.SAGA_HEARTBEAT_OPEN_RUNS, ()),
                        attrs.get(sc.SAGA_HEARTBEAT_BEAT),
                        attrs.get(sc.SAGA_HEARTBEAT_PARTS, 1),
                    )
                )
            else:
                rows.append(
                    (attrs[sc.SAGA_RUN_ID], span.span_id, now, span.service, span.instance, raw)
                )
        return rows, heartbeats

    def _fold(
        self,
        decoded: Decoded,
        transport: str,
        body: bytes | None,
        content_type: str,
        owners: dict[str, Owner],
        now: float,
        resent: set[tuple[str, str]],
        change: int = 0,
    ) -> Decoded:
        """Fold committed spans into the state, count them, tell the listeners, forward."""
        listeners = self._listeners
        every = any(not facts_only for _, facts_only in listeners)
        applied = self.state.apply(
            decoded.spans, now, keep_before=bool(listeners), owners=owners, change=change
        )
        stream = self.metrics.stream
        counted = decoded.spans
        if resent:  # counted once: a resend is not a new span
            counted = tuple(s for s in counted if (s.run_id, s.span_id) not in resent)
        stream.spans(counted, self.state)
        stream.transitions(applied.transitions, self.state)
        self._lapsed(applied.transitions)
        self._unmarked(applied.transitions)
        self._spans_counter(transport, "accepted").inc(len(decoded.spans))
        if decoded.ignored:
            self._spans_counter(transport, "ignored").inc(decoded.ignored)
        if decoded.rejected:
            self._spans_counter(transport, "rejected").inc(decoded.rejected)
        if listeners:
            state = self.state
            # Views are most of the cost of a batch: build them (once per run) only for
            # the runs some listener will hear of.
            facts_changed = set(applied.facts_changed)
            for run_id in applied.changed if every else applied.facts_changed:
                after = state.view(run_id)
                if after is not None:
                    before = state.view_before(applied, run_id)
                    self._notify(before, after, now, run_id in facts_changed)
        if self.forwarder is not None and body is not None and decoded.total:
            self.forwarder.offer(body, content_type, decoded.total)
        return decoded

    def _screen(
        self,
        decoded: Decoded,
        transport: str,
        stored: dict[tuple[str, str], bytes],
        known: Screening | None = None,
        pending: Pending | None = None,
    ) -> tuple[Decoded, dict[str, Owner], set[tuple[str, str]]]:
        """Apply the run id, ownership, fencing and duplicate rules (``_leases.py``) to each
        saga span; refused spans are left out, so nothing stored changes because of them.
        Also returns the (run id, span id) of the accepted resends (counted once only).
        With ``known`` (a shared store's, read under the runs' locks) owners and leases
        come from it alone, not from memory (and the state is not read: this may run on
        the database thread).

        Duplicates: a span id already stored for the run is taken again only with the
        same bytes (a resend); other content is refused, so the first stored wins, live
        and after a restart alike.

        ``pending``: runs opened and spans taken by the members of its group screened
        before this one (group commit, ``_groups.py``): they count as if committed.
        """
        state = self.state
        pending_owners = pending.owners if pending is not None else {}
        pending_seen = pending.seen if pending is not None else {}
        owners: dict[str, Owner] = {}
        seen: dict[tuple[str, str], bytes] = {}
        spans, raws = [], []
        errors = list(decoded.errors)
        refused = 0
        resent: set[tuple[str, str]] = set()
        for span, raw in zip(decoded.spans, decoded.raw, strict=True):
            attrs = span.attributes
            if attrs.get(sc.SAGA_PHASE) == sc.PHASE_HEARTBEAT:
                spans.append(span)
                raws.append(raw)
                continue
            run_id = attrs[sc.SAGA_RUN_ID]
            refusal: SpanRefusal | None = None
            problem = sc.run_id_problem(run_id)
            if known is None:
                owner = owners.get(run_id) or pending_owners.get(run_id) or state.owner(run_id)
                lease = state.lease(run_id)
            else:
                owner = owners.get(run_id) or pending_owners.get(run_id) or known.owners.get(run_id)
                lease = known.leases.get(run_id)
            if problem is not None:
                refusal = SpanRefusal("bad_run_id", f"{problem}; the span was not stored")
            else:
                refusal = screen_span(
                    run_id,
                    owner,
                    lease,
                    span.trace_id,
                    span.instance,
                    attrs.get(sc.SAGA_RECOVERY_TOKEN),
                )
            key = (run_id, span.span_id)
            if refusal is None:
                prior = seen.get(key)
                if prior is None:
                    prior = pending_seen.get(key)
                if prior is None and owner is not None and run_id not in owners:
                    prior = stored.get(key)
                if prior is not None and prior == raw:
                    resent.add(key)
                elif prior is not None:
                    refusal = SpanRefusal(
                        "conflicting_duplicate",
                        f"run {run_id!r}: span {span.span_id} was already received with other "
                        "content; the first one stands. Give every span a new id",
                    )
            if refusal is not None:
                refused += 1
                self.metrics.spans_refused.labels(transport=transport, reason=refusal.reason).inc()
                if len(errors) < MAX_ERROR_MESSAGES and refusal.message not in errors:
                    errors.append(refusal.message)
                continue
            if owner is None:
                owners[run_id] = Owner(span.trace_id, span.instance, span.service)
            seen[key] = raw
            spans.append(span)
            raws.append(raw)
        if not refused:
            return decoded, owners, resent
        log.warning("sidecar.spans.refused", count=refused, errors=errors[-refused:])
        return (
            replace(
                decoded,
                spans=tuple(spans),
                raw=tuple(raws),
                rejected=decoded.rejected + refused,
                errors=tuple(errors),
            ),
            owners,
            resent,
        )

    def _unmarked(self, transitions: Iterable[Transition], *, told: bool = True) -> None:
        """Clear in the store the orphan marks these transitions ended (each only while it
        is the run's mark: a later orphaning stands). Late, not dead: their agent spoke
        again after the orphan mark. Or a recoverer took the run up (its agent is still
        dead): the mark goes either way. ``told``: say so in the log (a replica folding
        another's spans or heartbeats does not repeat it)."""
        ended = [(t.run_id, t.unmarked) for t in transitions if t.unmarked is not None]
        if not ended:
            return
        if told:
            taken = [r for r, _ in ended if self.state.recovering(r)]
            late = [r for r, _ in ended if r not in taken]
            if late:
                log.warning("sidecar.runs.revived", count=len(late), run_ids=late[:5])
            if taken:
                log.info("sidecar.runs.recovery_began", count=len(taken), run_ids=taken[:5])
        if self.store is not None:
            self._write_later(
                "clear orphan marks", self.store.clear_orphaned, ended,
                event="sidecar.orphan_marks.not_cleared",
                fix="they come back at restart, until the agent is heard from again",
            )  # fmt: skip

    def _spans_counter(self, transport: str, outcome: str) -> Counter:
        # labels() costs more than the increment: keep the children.
        key = (transport, outcome)
        child = self._span_counters.get(key)
        if child is None:
            child = self.metrics.spans_received.labels(transport=transport, outcome=outcome)
            self._span_counters[key] = child
        return child

    def _notify(
        self,
        before: RunView | None,
        after: RunView,
        now: float,
        facts_changed: bool = True,
    ) -> None:
        for fn, facts_only in self._listeners:
            if facts_only and not facts_changed:
                continue
            try:
                fn(before, after, now)
            except Exception:
                # A listener bug must never cost intake: the change is already stored.
                log.exception(
                    "sidecar.listener.failed",
                    listener=getattr(fn, "__qualname__", str(fn)),
                    run_id=after["run_id"],
                )

    # --- presence: a live connection per agent process ----------------------------------

    def presence_opened(self, instance: str) -> bool:
        """An agent process opened its live connection; False at the bound (answer 429)."""
        if len(self._presence) >= self.settings.max_presence and instance not in self._presence:
            return False
        self._presence[instance] = self._presence.get(instance, 0) + 1
        self.state.presence_opened(instance)
        return True

    def presence_closed(self, instance: str, clean: bool) -> None:
        """It closed: with a goodbye (the process is shutting down), or not (it died, or its
        connection broke); the orphan rule confirms a death with the heartbeats."""
        left = self._presence.get(instance, 0) - 1
        if left > 0:
            self._presence[instance] = left
            return
        self._presence.pop(instance, None)
        if not clean:
            self.state.presence_lost(instance, self._now())

    # --- orphans, resolution, retention ---------------------------------------------

    def _now(self) -> float:
        """The clock, read for the state: a step of it since the last reading (``ClockSteps``)
        first moves every receipt time kept, so a time taken after a step is never moved
        by it. Every reading in this module goes through here (the tick reads it each time
        it wakes, so a step is told within a tick, judging or not)."""
        now = self.clock()
        step = self._steps.read(now, self._steady())
        if step:
            self._clock_stepped(step)
        return now

    def _clock_stepped(self, step: float) -> None:
        """Move the receipt times by ``step``: the state's (``RunState.clock_stepped``, its
        leases too) and the arrivals of requests waiting for their commit and the start
        of the last sync read (what the tick judges up to); and the store's leases
        (``Store.clock_stepped``: SQLite's, on this clock; PostgreSQL judges them on the
        database's), so a lease's remaining time is what it was: a step forward ends no
        recovery early (a second recoverer would be let in beside the first), a step
        back lengthens none."""
        self._stepped += step
        self.state.clock_stepped(step)
        unfolded = self._unfolded
        for answer in unfolded:
            unfolded[answer] += step
        self._read_from += step
        if self.store is not None:
            self._write_later(
                "move the recovery leases across a clock step", self.store.clock_stepped, step,
                event="sidecar.leases.not_moved",
                fix="the stored leases kept the clock before the step, so one may end early "
                "(a step forward) or late: before recovering a run again, check that no "
                "recovery of it is under way (`saga-sidecar runs show`)",
            )  # fmt: skip
        log.warning(
            "sidecar.clock.stepped",
            step_s=round(step, 3),
            fix="silences and recovery leases were kept as they were, not counted across "
            "the step: keep the host's clock synchronised so that it is slewed, not stepped",
        )

    def tick(self, as_of: float | None = None) -> list[Transition]:
        """Apply the orphan rule now, or ``as_of`` an earlier moment (replicas: the start
        of the last read of the others' heartbeats, the latest moment fully known)."""
        now = self._now() if as_of is None else min(as_of, self._now())
        transitions = self.state.tick(now)
        if not transitions:
            return transitions
        self.metrics.stream.transitions(transitions, self.state)
        self._lapsed(transitions)
        if self.store is not None:
            marks = [(t.run_id, t.at) for t in transitions]
            self._write_later(
                "store orphan marks", self.store.mark_orphaned, marks,
                event="sidecar.orphan_marks.not_stored",
                fix="they are written again once the store answers (while still the runs' "
                "marks); until then a restart or another replica does not see them",
                failed=functools.partial(self._marks_refused, marks),
            )  # fmt: skip
        self._announce(transitions, now)
        return transitions

    def _marks_refused(self, marks: list[tuple[str, float]]) -> None:
        """Keep orphan marks the store refused for :meth:`_store_marks_again` (on the loop)."""
        self._unstored.update(marks)
        self._marks_failures += 1
        interval = max(self.settings.tick_interval, 0.1)
        self._marks_due = time.monotonic() + backoff_seconds(
            self._marks_failures, initial=interval, maximum=MARKS_RETRY_MAX_S, jitter_ratio=0.5
        )

    async def _store_marks_again(self) -> None:
        """Write again the orphan marks the store refused, once their backoff is over:
        those still their runs' own (a run heard from since, taken up by a recoverer or
        forgotten has none, or a later one, written on its own). Without them a restart
        folds the run back as running (its alert resolved, then paged anew once quiet
        again) and the other replicas never see it orphaned."""
        store = self.store
        if not self._unstored or store is None:
            return
        if time.monotonic() < self._marks_due:
            return
        marks = self.state.marked(self._unstored.items())
        self._unstored = {}
        if not marks:
            return
        try:
            await self._call(store.mark_orphaned, marks)
        except StoreError:
            self._marks_refused(marks)
            return
        log.warning(
            "sidecar.orphan_marks.stored_late",
            count=len(marks),
            run_ids=[r for r, _ in marks[:5]],
            attempts=self._marks_failures + 1,
        )
        self._marks_failures = 0

    def _announce(self, transitions: Iterable[Transition], now: float) -> None:
        """Tell the listeners of status changes no span made (an orphaning, here or read
        from another replica): the view before is the view after with the status before."""
        if not self._listeners:
            return
        for t in transitions:
            after = self.state.view(t.run_id)
            if after is not None and t.before is not None:  # a known run
                before = after.copy()
                before["status"] = t.before
                self._notify(before, after, now)

    def _lapsed(self, transitions: Iterable[Transition]) -> None:
        """Forget, in the store too, the resolutions that lapsed (``_state._lapse``): a
        restart must not bring back a resolution that would hide the run again."""
        # Each cleared only while it stands: a resolution made since, through another
        # replica that folded the change first, is not this lapse's to clear.
        lapsed = [(t.run_id, t.lapsed.at) for t in transitions if t.lapsed is not None]
        if not lapsed:
            return
        log.warning(
            "sidecar.runs.resolution_lapsed",
            count=len(lapsed),
            run_ids=[r for r, _ in lapsed[:5]],
        )
        if self.store is not None:
            self._write_later(
                "clear lapsed resolutions", self.store.clear_resolutions, lapsed,
                event="sidecar.resolutions.not_cleared",
                fix="a restart restores them (an orphaned run's excepted): the run is "
                "hidden again until re-resolved",
            )  # fmt: skip

    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.settings.tick_interval
        gate = TickGate(slack=max(interval, 0.1))
        # A leader silent this long (paused, cut off) hands on orphan detection.
        hold = max(LEADER_HOLD_S, 10 * interval)
        judge, stalled = True, False
        while True:
            asked = loop.time() + interval
            await asyncio.sleep(interval)
            woke = loop.time()
            self._now()  # a step of the clock is told within a tick (ClockSteps)
            if self._db_thread is not None:
                # Replicas on one database: fold in what the others stored, then let one
                # of them (the holder of the leader lock) decide which runs are orphaned.
                try:
                    await self.sync()
                    self.leading = await self._call(self._require_store().try_lead, hold)
                except StoreError as exc:
                    log.warning("sidecar.sync.failed", error=str(exc))
                    continue
            judged, judge = judge, gate.admit(asked, woke)
            if judged and not judge:  # once per stall, not per deferred tick
                log.warning(
                    "sidecar.loop.stalled",
                    late_s=round(woke - asked, 3),
                    fix="orphans are judged once what arrived meanwhile is read; if this "
                    "repeats, give the sidecar more CPU or a faster disk",
                )
            if self._db_thread is None or self.leading:  # the marking replica's
                await self._store_marks_again()
            if not judge or (self._db_thread is not None and not self.leading):
                continue
            now = self._now()
            waiting_since = self.oldest_waiting(now)
            read_from = now if self._db_thread is None else self._read_from
            waiting = now - waiting_since > gate.slack
            if waiting and not stalled:  # once per episode
                log.warning(
                    "sidecar.intake.stalled",
                    waiting_s=round(now - waiting_since, 3),
                    fix="orphans are judged up to the oldest request still waiting for its "
                    "commit; if this repeats, look for locks or slowness in the database",
                )
            stalled = waiting
            self.tick(as_of=judged_as_of(now, waiting_since, read_from))

    def oldest_waiting(self, now: float) -> float:
        """When the oldest request still waiting for its commit arrived (``now``: none):
        what the orphan tick judges up to, and how long the intake has been stalled
        (``/healthz``, the intake gauge)."""
        return next(iter(self._unfolded.values()), now)

    def _require_store(self) -> Store:
        if self.store is None:
            raise StoreError("the sidecar is not running")
        return self.store

    async def sync(self) -> int:
        """Fold in the spans, heartbeats, marks and leases other replicas committed; the
        number of spans read. Nothing to do on a store of one process (SQLite)."""
        store = self.store
        if store is None or store.inline:
            return 0
        async with self._intake:  # between two intakes: the state moves in commit order
            read_from = self._now()
            stepped = self._stepped
            changes = await self._call(store.changes, read_from)
            # The fold's own moment: a prune may have run while the read was in flight,
            # and what it forgot must be judged stale against now, not the read's start.
            # Other replicas' heartbeats count as heard now (RunState.heard).
            now = self._now()
            read_from += self._stepped - stepped  # a step told meanwhile moves it too
            # Late spans of runs put away here: fold them onto the whole run.
            await self._reopen(s.run_id for s in changes.spans)
            changes = changes._replace(leases=self._caught_up(changes.leases, stepped))
            self._fold_changes(changes, now)
            # What other replicas committed after the read began is not read yet (the read
            # may have waited for a lock): the orphan tick judges as of then.
            self._read_from = read_from
        return len(changes.spans)

    def _fold_changes(self, changes: Changes, now: float) -> None:
        state = self.state
        owners = {r: o for r, o in changes.owners if state.owner(r) is None}
        records = []
        changed: dict[str, int] = {}  # run -> the newest change number of its spans read
        for stored in changes.spans:
            try:
                records.append(span_from_stored(stored.data, stored.service, stored.instance))
            except SidecarError as exc:
                log.warning("sidecar.sync.span_skipped", span_id=stored.span_id, error=str(exc))
                continue
            if stored.changed > changed.get(stored.run_id, 0):
                changed[stored.run_id] = stored.changed
        if records:
            listeners = self._listeners
            applied = state.apply(
                records, now, keep_before=bool(listeners), owners=owners, change=changed
            )
            # The writing replica may not have held the orphan mark its spans ended.
            self._unmarked(applied.transitions, told=False)
            # Alerts the writing replica raised are raised here too: the outbox keeps
            # one row per dedup key, action and sink, whoever inserts it first.
            for run_id in applied.facts_changed:
                after = state.view(run_id)
                if after is not None:
                    self._notify(state.view_before(applied, run_id), after, now)
        # Heartbeats revive the orphaned runs they name, as when received here.
        revived: list[Transition] = []
        retention = self.settings.retention
        for instance, at, interval, open_runs, number in changes.instances:
            try:
                named = [str(r) for r in json.loads(open_runs)]
            except (ValueError, TypeError):
                named = []
            revived += state.heard(instance, at, interval, named, now, retention, number)
        self._unmarked(revived, told=False)
        marked: list[Transition] = []
        for mark in changes.marks:
            moved = None
            if mark.orphaned_at is not None:  # ordered by change number (read_orphaned)
                moved = state.read_orphaned(mark.run_id, mark.orphaned_at, mark.changed)
            elif mark.cleared is not None:
                moved = state.read_unmarked(mark.run_id, mark.cleared, now)
            if moved is not None:
                marked.append(moved)
            # The row as it stands now: a replacement made through another replica takes
            # the place of the note held here, and a lapse there clears it here too.
            resolution = None
            if mark.resolution_at is not None:
                resolution = Resolution(
                    mark.resolution_note or "", mark.resolution_at, mark.resolution_by
                )
            state.read_resolution(mark.run_id, resolution)
        self._learn({}, changes.leases)
        # The leader raised the alert of its mark after storing the mark (in another
        # transaction: it may have died in between); every replica that folds the mark
        # raises it too, and the outbox keeps one row per dedup key, action and sink.
        self._lapsed(marked)
        self._announce([*revived, *marked], now)

    def prune(self) -> list[str]:
        """Forget finished runs past the retention, in memory and in the store, and of the
        runs put away the oldest batch (``PRUNE_BATCH``; :meth:`prune_async` takes them
        all). Synchronous: the tests' path.

        Replicas each prune what they hold: deleting a run twice is the same as once.
        """
        now = self._now()
        run_ids = self._prune_held(now)
        if self.store is not None:
            before = now - self.settings.retention
            self._submit("prune runs put away", self.store.prune_put_away, before)
        return run_ids

    async def prune_async(self) -> tuple[list[str], int]:
        """:meth:`prune` with every run put away past the retention, a batch a transaction
        and the loop free between batches (on SQLite the store runs on the loop: one
        transaction of 60,000 runs held it ~3 s, every request and tick waiting); the
        runs forgotten in memory, and how many put away were deleted."""
        now = self._now()
        run_ids = self._prune_held(now)
        deleted = 0
        if self.store is not None:
            before = now - self.settings.retention
            while True:
                batch = await self._call(self.store.prune_put_away, before, PRUNE_BATCH)
                deleted += batch
                if batch < PRUNE_BATCH:
                    break
                await asyncio.sleep(0)  # the requests and ticks due go first
        return run_ids, deleted

    def _prune_held(self, now: float) -> list[str]:
        """The runs in memory and the instances past the retention, here and in the store."""
        run_ids = self.state.prunable(now, self.settings.retention)
        if run_ids and self.store is not None:
            self._submit("prune runs", self.store.delete_runs, run_ids)
            self.state.forget(run_ids)
        self.prune_instances(now)
        return run_ids

    def prune_instances(self, now: float) -> list[str]:
        """Forget agent instances silent for longer than the retention (memory and table)."""
        stale = self.state.stale_instances(now, self.settings.retention)
        if stale and self.store is not None:
            self._submit("prune instances", self.store.delete_instances, stale)
            self.state.forget_instances(stale)
        return stale

    async def _prune_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.prune_interval)
            with contextlib.suppress(StoreError):
                pruned, put_away = await self.prune_async()
                if pruned or put_away:
                    log.info("sidecar.pruned", runs=len(pruned), put_away=put_away)

    async def lease(self, run_id: str, action: LeaseAction, data: object) -> Lease | LeaseRefusal:
        """Grant, renew or release ``run_id``'s recovery lease (rules: ``_leases.py``).

        Raises StoreError (answer 503). Each answer is counted by action and outcome.
        """
        outcome = await self._lease(run_id, action, data)
        if isinstance(outcome, Lease):
            label = {"grant": "granted", "renew": "renewed", "release": "released"}[action]
            if action == "grant" and outcome.forced():
                label = "forced"
                assert outcome.override is not None  # forced() says so
                log.warning(
                    "sidecar.lease.forced",
                    run_id=run_id,
                    holder=outcome.holder,
                    reason=outcome.override.reason,
                )
        else:
            label = outcome.reason
            if action == "renew" and outcome.reason == "agent_alive":
                # Its agent came back mid-recovery: the recoverer stops before its next undo.
                log.warning(
                    "sidecar.lease.agent_returned",
                    run_id=run_id,
                    holder=outcome.holder,
                    heard_at=outcome.last_heard,
                )
        self.metrics.lease_requests.labels(action=action, outcome=label).inc()
        return outcome

    async def _lease(self, run_id: str, action: LeaseAction, data: object) -> Lease | LeaseRefusal:
        req = parse_request(data, action)
        if isinstance(req, LeaseRefusal):
            return req
        if self.store is None:
            raise StoreError("the sidecar is not running: start it before taking leases")
        if run_id not in self.state:
            async with self._intake:
                await self._reopen([run_id])
        now, stepped = self._now(), self._stepped
        owner = self.state.liveness(run_id, now)
        if owner is None:
            return LeaseRefusal(
                "unknown_run",
                f"no run {run_id!r} is known here: list runs with `saga-sidecar runs list`",
            )
        decide: Callable[[Lease | None], Lease | LeaseRefusal]
        if action == "grant":
            decide = functools.partial(_grant, run_id, owner, req, now)
        elif action == "renew":
            decide = functools.partial(_renew, run_id, owner, req, now)
        else:
            decide = functools.partial(_release, run_id, req, now)
        outcome = await self._call(self.store.decide_lease, run_id, now, decide)
        if isinstance(outcome, Lease):
            (outcome,) = self._caught_up([outcome], stepped)
            before = self.state.view(run_id)
            self.state.set_lease(outcome)
            after = self.state.view(run_id)
            if action == "grant" and after is not None:
                self._notify(before, after, now)
        return outcome

    async def resolve(
        self, run_id: str, note: str, *, first: bool = False, by: str | None = None
    ) -> RunView | None:
        """Record a person's resolution; the new view, or None for an unknown run.

        ``by`` is the name the person gave (None: they gave none; nothing is made up).
        With ``first``, a run resolved already keeps its note and its ``by``: its view
        comes back with the resolution that stands. The store decides (``Store.resolve``),
        not this sidecar's memory: another replica's resolution may not be read here yet.
        """
        async with self._resolving:
            return await self._resolve(run_id, note, first, by)

    async def _resolve(self, run_id: str, note: str, first: bool, by: str | None) -> RunView | None:
        # Under the intake lock: a sync reads the store and folds what it read in one
        # turn, so what it read never lands after (and over) the answer below.
        async with self._intake:
            if run_id not in self.state:
                await self._reopen([run_id])
            before = self.state.view(run_id)
            if before is None:
                return None
            now = self._now()
            at = self.state.resolution_time(run_id, now)
            wanted = Resolution(note, at, by)
            if self.store is None:  # not started: memory is all there is
                if not first or before["resolution"] is None:
                    self.state.resolve(run_id, note, at, by)
            else:
                decide = functools.partial(self.store.resolve, replace=not first)
                standing = await self._call(decide, run_id, wanted)
                if standing == wanted:  # made here, after what this sidecar showed the person
                    self.state.resolve(run_id, note, at, by)
                else:  # another's, as the other replicas read it
                    self.state.read_resolution(run_id, standing)
            after = self.state.view(run_id)
        assert after is not None
        if after["resolution"] != before["resolution"]:
            self._notify(before, after, now)
        return after


def _lease_order(lease: Lease) -> tuple[int, bool, float]:
    """Which of two versions of a run's lease is the later: a new grant has a larger token,
    a release ends its token (it lowers the expiry, so the expiry alone would keep the
    lease live here), and a renewal extends the expiry of its grant. Not the grant's time:
    one grant read twice is moved onto this clock by two readings of the database's
    (``_pgstore._to_replica``), a hair apart, which would order a renewal before it."""
    return (lease.token, lease.released, lease.expires_at)


def _grant(
    run_id: str, owner: Liveness, req: LeaseRequest, now: float, current: Lease | None
) -> Lease | LeaseRefusal:
    return grant(run_id, current, owner, req, now)


def _renew(
    run_id: str, owner: Liveness, req: LeaseRequest, now: float, current: Lease | None
) -> Lease | LeaseRefusal:
    return renew(run_id, current, owner, req, now)


def _release(
    run_id: str, req: LeaseRequest, now: float, current: Lease | None
) -> Lease | LeaseRefusal:
    return release(run_id, current, req, now)


def _answer(request: _Request, outcome: Decoded | Exception) -> None:
    deliver(request.answer, outcome)


def _never(request: _Request, taken: _Taken) -> Decoded:  # noqa: ARG001 (settle's fold)
    raise AssertionError("a failed group is never folded")


def _nothing() -> None:
    return None


def _load_reopen(store: Store, run_ids: list[str], now: float) -> Changes:
    return store.load_runs(run_ids, now, reopen=True)
