"""Heartbeats: the runs open in this process, and the one thread that names them.

While at least one run is open, a ``saga.heartbeat`` span (its own trace root)
is emitted every ``heartbeat_interval`` seconds listing the open run ids; the
sidecar pages a run as orphaned when its instance's heartbeats stop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from saga_otel import semconv as sc
from saga_otel._logging import Logger
from saga_otel._metrics import metrics_for
from saga_otel._presence import Presence
from saga_otel._state import STATE
from saga_otel.records import describe_error

__all__ = ["Heartbeat", "open_run_ids", "register_open_run", "unregister_open_run"]


def register_open_run(run_id: str) -> None:
    """Mark ``run_id`` open in this process; heartbeats name it until unregistered."""
    with STATE.runs_cond:
        STATE.open_runs.add(run_id)
        STATE.runs_cond.notify_all()
    active = STATE.active
    if active is not None:
        active.ensure_heartbeat()


def unregister_open_run(run_id: str) -> None:
    with STATE.runs_cond:
        STATE.open_runs.discard(run_id)


def open_run_ids() -> list[str]:
    with STATE.runs_cond:
        return sorted(STATE.open_runs)


class Heartbeat:
    """The one thread that emits ``saga.heartbeat`` while runs are open."""

    def __init__(
        self,
        provider: TracerProvider,
        interval: float,
        logger: Logger,
        wait: Callable[[threading.Event, float], bool] | None = None,
        presence: Presence | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._provider = provider
        self._errors = metrics_for(registry).telemetry_errors
        # The live connection whose close tells the sidecar this process died.
        self._presence = presence
        self._tracer = provider.get_tracer("saga_otel")
        self._interval = float(interval)
        self._log = logger
        self._wait = wait if wait is not None else (lambda ev, s: ev.wait(s))
        self._fresh()

    def _fresh(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._run, name="saga-otel-heartbeat", daemon=True
            )
            self._thread.start()

    def after_fork_in_child(self) -> None:
        """Fork copies no thread: forget the parent's; the child starts one with its first run."""
        stopped = self._stop.is_set()
        self._fresh()
        if stopped:
            self._stop.set()
        # A tracer caches the provider's resource; take a new one (see _config's fork hook).
        self._tracer = self._provider.get_tracer("saga_otel")
        if self._presence is not None:
            self._presence.forget_after_fork()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        with STATE.runs_cond:
            STATE.runs_cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if self._presence is not None and (thread is None or not thread.is_alive()):
            self._presence.close()  # a goodbye: shutting down is not dying

    def _run(self) -> None:
        while not self._stop.is_set():
            with STATE.runs_cond:
                while not STATE.open_runs and not self._stop.is_set():
                    STATE.runs_cond.wait()
                runs = sorted(STATE.open_runs)
            if self._stop.is_set():
                return
            self.emit(runs)
            if self._presence is not None:
                try:
                    self._presence.beat()
                except Exception as exc:  # a dead heartbeat thread pages every open run
                    self._swallowed("presence", "presence beat failed", exc)
            self._wait(self._stop, self._interval)

    def emit(self, runs: list[str]) -> None:
        try:
            span = self._tracer.start_span(
                sc.HEARTBEAT_SPAN_NAME,
                # A root of its own: a heartbeat belongs to no run's trace.
                context=otel_context.Context(),
                attributes={
                    sc.SAGA_PHASE: sc.PHASE_HEARTBEAT,
                    sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
                    sc.SAGA_HEARTBEAT_OPEN_RUNS: runs,
                    sc.SAGA_HEARTBEAT_INTERVAL_S: self._interval,
                },
            )
            span.end()
        except Exception as exc:
            self._swallowed("heartbeat", "heartbeat not emitted", exc)

    def _swallowed(self, kind: str, message: str, exc: Exception) -> None:
        """Count and log an error of the heartbeat thread's; it goes on beating."""
        with contextlib.suppress(Exception):
            self._errors.labels(kind=kind).inc()
        with contextlib.suppress(Exception):
            self._log.error(
                sc.EV_TELEMETRY_ERROR, kind=kind, message=message, error=describe_error(exc)
            )
