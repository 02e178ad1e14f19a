"""Heartbeats: the runs open in this process, and the one thread that names them.

While at least one run is open, a ``saga.heartbeat`` span (its own trace root)
is emitted every ``heartbeat_interval`` seconds listing the open run ids; the
sidecar pages a run as orphaned when its instance's heartbeats stop.

A beat whose run list would make the span larger than ``max_span_bytes`` (the
processor drops such a span, and a heartbeat has no marker) is sent as several
``saga.heartbeat`` spans, its parts, each within the bound: they carry the beat's
number and how many parts it has, and the sidecar unions a beat's parts.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext
from prometheus_client import CollectorRegistry

from saga_otel import semconv as sc
from saga_otel._logging import Logger
from saga_otel._metrics import metrics_for
from saga_otel._presence import Presence
from saga_otel._processor import DEFAULT_MAX_SPAN_BYTES
from saga_otel._state import STATE
from saga_otel._wire import encode, string_item_bytes
from saga_otel.records import describe_error

__all__ = [
    "Heartbeat",
    "open_run_ids",
    "register_open_run",
    "split_open_runs",
    "unregister_open_run",
]

_TRACER_NAME: Final = "saga_otel"
# What a part's size leaves out (string_item_bytes counts the items alone): the length
# prefixes of the fields around its run list, a varint each, that grow as the list does.
_PREFIX_SLACK: Final = 64
# The parts count as the size probe writes it: a varint as long as any real count's.
_PROBE_PARTS: Final = 1 << 20


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


def split_open_runs(runs: Sequence[str], room: int) -> list[list[str]]:
    """``runs`` in order, cut into as few parts as fit: each part's ids take at most
    ``room`` bytes encoded (:func:`saga_otel._wire.string_item_bytes`); an id larger
    than ``room`` on its own gets a part of its own. Always at least one part."""
    parts: list[list[str]] = []
    part: list[str] = []
    used = 0
    for run_id in runs:
        size = string_item_bytes(run_id)
        if part and used + size > room:
            parts.append(part)
            part, used = [], 0
        part.append(run_id)
        used += size
    parts.append(part)
    return parts


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
        max_span_bytes: int = DEFAULT_MAX_SPAN_BYTES,
    ) -> None:
        self._provider = provider
        self._errors = metrics_for(registry).telemetry_errors
        # The live connection whose close tells the sidecar this process died.
        self._presence = presence
        self._tracer = provider.get_tracer(_TRACER_NAME)
        self._interval = float(interval)
        self._max_span_bytes = max_span_bytes
        # The number of the last beat: its parts carry it, so the sidecar unions them
        # (and tells them from the next beat's). Only the heartbeat thread moves it.
        self._beat = 0
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
        self._tracer = self._provider.get_tracer(_TRACER_NAME)
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
        """One beat: a ``saga.heartbeat`` span naming ``runs``, or several (its parts)
        when one would be larger than ``max_span_bytes``; all sent at once."""
        try:
            self._beat += 1
            at = time.time_ns()  # one moment for every part: they are one beat
            attributes: dict[str, Any] = {
                sc.SAGA_PHASE: sc.PHASE_HEARTBEAT,
                sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
                sc.SAGA_HEARTBEAT_OPEN_RUNS: [],
                sc.SAGA_HEARTBEAT_INTERVAL_S: self._interval,
                sc.SAGA_HEARTBEAT_BEAT: self._beat,
                sc.SAGA_HEARTBEAT_PARTS: _PROBE_PARTS,
            }
            parts = self._parts(runs, attributes, at)
            attributes[sc.SAGA_HEARTBEAT_PARTS] = len(parts)
            for part in parts:
                span = self._tracer.start_span(
                    sc.HEARTBEAT_SPAN_NAME,
                    # A root of its own: a heartbeat belongs to no run's trace.
                    context=otel_context.Context(),
                    attributes={**attributes, sc.SAGA_HEARTBEAT_OPEN_RUNS: part},
                    start_time=at,
                )
                span.end(end_time=at)
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

    def _parts(self, runs: list[str], attributes: dict[str, Any], at: int) -> list[list[str]]:
        """``runs`` cut so that each part's span, encoded as the processor measures it
        (the whole request: resource and scope included), is within ``max_span_bytes``."""
        # The span with no run named, as the processor would encode it.
        probe = ReadableSpan(
            name=sc.HEARTBEAT_SPAN_NAME,
            context=SpanContext(1, 1, is_remote=False),
            resource=self._provider.resource,
            attributes=attributes,
            instrumentation_scope=InstrumentationScope(_TRACER_NAME),
            start_time=at,
            end_time=at,
        )
        room = self._max_span_bytes - len(encode([probe])) - _PREFIX_SLACK
        # At most 4 bytes a character and 6 of prefixes an id: most beats stop here.
        if room <= 0 or 4 * sum(map(len, runs)) + 6 * len(runs) <= room:
            # room <= 0: the resource alone is too large; the processor says so.
            return [runs]
        return split_open_runs(runs, room)
