"""Alerting wired to a sidecar: rules on every committed view change, the outbox behind them.

``install_alerting(sidecar, settings)`` is the whole integration: it registers
the listener, re-evaluates the stored views once (an alert whose span was
acknowledged just before a crash is still raised), and runs the delivery loop
as one of the sidecar's background tasks.
"""

from __future__ import annotations

import asyncio
import random
import shlex
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry

from saga_otel.records import describe_error

from ._alert_settings import AlertSettings
from ._alerting import AlertEvent, View, evaluate, resolve_stale
from ._errors import SidecarError
from ._log import get_logger
from ._outbox import AlertMetrics, Outbox, describe_routing
from ._settings import http_url
from ._sinks import Sink, shown_sink
from ._state import RunState
from ._storage import DbTarget

if TYPE_CHECKING:
    from ._server import Sidecar

log = get_logger("sidecar.alerts")

# Runs whose views AlertService.remask reads at once (the put-away ones from the store).
REMASK_RUNS: Final = 100


class AlertService:
    """The rules and the outbox of one sidecar."""

    def __init__(
        self,
        db: DbTarget | Path | str,
        settings: AlertSettings | None = None,
        *,
        registry: CollectorRegistry | None = None,
        sinks: Sequence[Sink] | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings or AlertSettings()
        self.rules = self.settings.rule_config()
        self.redactor = self.settings.redactor()
        chosen = list(sinks) if sinks is not None else self.settings.sinks()
        routing = self.settings.routing()
        for problem in describe_routing(routing, chosen):
            log.warning("sidecar.alert_routing.problem", problem=problem)
        # Set once the startup re-evaluation has been written (install_alerting).
        self.reevaluated = asyncio.Event()
        self.metrics = AlertMetrics.create(registry) if registry is not None else None
        # Runs whose alerts the rules failed on since start (also counted in metrics).
        self.evaluation_failures = 0
        self.outbox = Outbox(
            db,
            chosen,
            routing,
            metrics=self.metrics,
            backoff=self.settings.backoff(),
            clock=clock,
            sleep=sleep,
            rng=rng,
            send_timeout=self.settings.timeout,  # the HTTP sinks' own, see SEND_MARGIN_S
        )

    def on_change(self, before: View | None, after: View, now: float) -> list[AlertEvent]:
        """Listener for committed view changes. Never raises into the caller's commit path."""
        try:
            events = self._masked(evaluate(before, after, now, self.rules), before, after)
        except Exception as exc:
            self._evaluation_failed(after.get("run_id"), exc)
            return []
        try:
            if events:
                # On PostgreSQL on the outbox's database thread, in order (the loop never
                # waits on it). One the database refuses is written once it answers
                # (Outbox.write); one lost to a crash meanwhile is raised again at start.
                self.outbox.add_soon(events)
            return events
        except SidecarError as exc:
            # The startup re-evaluation raises it again after the store is fixed.
            log.error(
                "sidecar.alerts.not_written",
                run_id=after.get("run_id"),
                error=str(exc),
                fix="the alerts are evaluated again at the next start, once the store is fixed",
            )
            return []

    def _evaluation_failed(self, run_id: object, exc: Exception) -> None:
        """The rules (or the masking of their alerts) raised on one run's view: a fault in
        the sidecar meeting a view it did not foresee. That run's alerts are lost for now,
        so say so loudly (log, metric, rule); every other run's still go out."""
        self.evaluation_failures += 1
        if self.metrics is not None:
            self.metrics.evaluation_failures.inc()
        log.error(
            "sidecar.alerts.evaluation_failed",
            run_id=str(run_id),
            error=describe_error(exc),
            exc_info=exc,
            fix=f"this run's alerts were not raised: look at it (`saga-sidecar runs show "
            f"{shlex.quote(str(run_id))}`) and report the error with this line; the alerts "
            "are evaluated again at every start",
        )

    def _masked(self, events: list[AlertEvent], *views: View | None) -> list[AlertEvent]:
        """``events`` with every field masked by the secrets of the run's whole view.

        The view holds every compensation's arguments, succeeded or failed; the event
        only some of them, yet its card and texts may quote any (see _redact).
        """
        if not events or not self.redactor.active:
            return events
        secrets = self.redactor.secrets_in(*(v for v in views if v is not None))
        redact = self.redactor.redact
        return [
            replace(
                e,
                labels=redact(dict(e.labels), secrets),
                annotations=redact(dict(e.annotations), secrets),
                details=redact(dict(e.details), secrets),
            )
            for e in events
        ]

    def listener(self, before: View | None, after: View, now: float) -> None:
        """:meth:`on_change` in the shape ``Sidecar.add_listener`` takes."""
        self.on_change(before, after, now)

    async def remask(self, views_of: Callable[[list[str]], Awaitable[Mapping[str, View]]]) -> int:
        """Mask again, as :meth:`on_change` does, every alert still to be sent; rows changed.

        A row holds the masking in force when it was written, and the sinks send what the
        rows hold (their own pass sees the event only, not the compensations that
        succeeded, whose arguments a card may quote): alerts written before a
        ``--redact-key`` or ``--redact-pattern`` was added would leave with the secret. At
        start, before the re-evaluation (whose masked events the rows' keys ignore), with
        each run's whole view from ``views_of`` (a batch of run ids at a time). Without
        a redactor, nothing to do."""
        if not self.redactor.active:
            return 0
        outbox = self.outbox
        rows: dict[str, list[int]] = {}  # ids only: the events are read a batch at a time
        for row_id, run_id in await outbox.call(outbox.to_leave):
            rows.setdefault(run_id, []).append(row_id)
        runs = sorted(rows)
        changed = 0
        for start in range(0, len(runs), REMASK_RUNS):
            batch = runs[start : start + REMASK_RUNS]
            views = await views_of(batch)
            ids = [row_id for run_id in batch for row_id in rows[run_id]]
            masked = []
            for row_id, event in await outbox.call(outbox.events, ids):
                (again,) = self._masked([event], views.get(event.run_id))
                if again.to_dict() != event.to_dict():
                    masked.append((row_id, again))
            if masked:
                changed += await outbox.call(outbox.rewrite, masked)
        return changed

    def reevaluate(self, views: Iterable[View], now: float) -> int:
        """Raise what stored views hold open, resolve what they no longer do; rows inserted
        (none when the database refuses the write: then written once it answers).

        Run by run: a view the rules fail on is logged and counted, and costs only its own
        run's alerts (it ran before delivery starts, so one bad view stopped every run's).
        """
        fired = self.outbox.open_alerts()
        events: list[AlertEvent] = []
        for view in views:
            run_id = str(view.get("run_id"))
            try:
                raised = evaluate(None, view, now, self.rules, replay=True)
                raised += resolve_stale(fired.get(run_id, []), view, now, self.rules)
                events += self._masked(raised, view)
            except Exception as exc:
                self._evaluation_failed(run_id, exc)
        return self.outbox.write(events)

    def stored_views(self, state: RunState) -> list[View]:
        """The view of every run ``state`` holds, for :meth:`reevaluate`; a run whose view
        cannot be built is logged and counted as its evaluation failing."""
        views: list[View] = []
        for run_id in list(state.run_ids()):
            try:
                view = state.view(run_id)
            except Exception as exc:
                self._evaluation_failed(run_id, exc)
                continue
            if view:
                views.append(view)
        return views

    async def start(self) -> None:
        await self.outbox.start()

    async def run(self) -> None:
        await self.outbox.run()

    async def stop(self) -> None:
        await self.outbox.stop()

    def close(self) -> None:
        self.outbox.close()


def install_alerting(
    sidecar: Sidecar,
    settings: AlertSettings | None = None,
    **kwargs: Any,
) -> AlertService:
    """Hook alerting into a :class:`sidecar._server.Sidecar` before it starts.

    Alert metrics join the sidecar's registry (its ``/metrics``); the outbox tables
    join its database (file or PostgreSQL), which the sidecar claims first
    (``Sidecar.hold_database``: StoreError if another sidecar serves the file; its
    ``stop`` lets go). ``kwargs`` go to :class:`AlertService` (sinks, clock, ...).
    """
    kwargs.setdefault("registry", sidecar.metrics.registry)
    # The outbox opens the database now: claim it first (a SQLite file is one sidecar's),
    # so a second sidecar on the file stops here without having opened it.
    sidecar.hold_database()
    service = AlertService(sidecar.database, settings, **kwargs)
    settings = service.settings
    if settings.public_url is None:
        # Links follow the API as bound: the port is known once it listens (0 = any);
        # until then (a span racing startup) the configured one.
        host, configured = sidecar.settings.host, sidecar.settings.api_port
        service.rules = (
            settings.rule_config(http_url(host, configured)) if configured else service.rules
        )

        async def follow_bound_api() -> None:
            if sidecar.api_port is not None:
                service.rules = settings.rule_config(http_url(host, sidecar.api_port))

        sidecar.add_background(follow_bound_api)
    # The same masks on the API's views (and so the CLI's output) as on alerts.
    sidecar.redactor = service.redactor
    # The pages name the address alerts link to; the HTTP ports answer to its name.
    sidecar.public_url = settings.public_url
    # Which sinks are on, in the start line: a sink left out by its flags shows by absence.
    sidecar.alert_sinks = [shown_sink(s.name) for s in service.outbox.sinks]
    # The rules read only a run's facts: equal facts before and after fire nothing.
    sidecar.add_listener(service.listener, facts_only=True)

    async def deliver() -> None:
        # Runs after the sidecar rebuilt its state from the store: raise what a crash
        # between an acknowledged span and its alert left unsaid, then deliver.
        masked = await service.remask(sidecar.views)
        if masked:
            log.info("sidecar.alerts.masked_again", deliveries=masked)
        views = service.stored_views(sidecar.state)
        added = await service.outbox.call(service.reevaluate, views, sidecar.clock())
        if added:
            log.info("sidecar.alerts.reevaluated", runs=len(views), deliveries_added=added)
        service.reevaluated.set()
        try:
            await service.run()
        finally:
            service.close()

    sidecar.add_background(deliver)
    return service
