"""configure(): the saga span processor, durable export to the sidecar, heartbeats.

Saga spans (those carrying ``saga.phase``) are sent to the sidecar at once over
OTLP/HTTP protobuf by one sender thread per processor. In durable mode every
sent span gets a ticket (a ``concurrent.futures.Future``) that resolves when the
sidecar answered 2xx for the request that carried it; the engine waits on it
with :func:`wait_for_ack` / :func:`wait_for_ack_async`, bounded by
``ack_timeout``. Nothing here ever raises into the agent: failures are logged
(``saga.export.failed``) and counted (``saga_export_failures_total{reason}``).

Counting rule, one increment per event: ``timeout`` counts durable waits that
passed their bound (the span may still arrive later); ``queue_full``,
``rejected`` (a 4xx other than 429, or spans the sidecar reported as rejected)
and ``error`` (encoding failure, spans still unsent at shutdown, a hook error)
count spans lost. A wait that finds its span already lost logs but does not
count it a second time.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import http.client
import os
import random
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.util.re import parse_env_headers
from prometheus_client import CollectorRegistry, Counter

from saga_otel import semconv as sc
from saga_otel._errors import ConfigurationError
from saga_otel._logging import default_logger

__all__ = [
    "ENV_SIDECAR_ENDPOINT",
    "SagaSpanProcessor",
    "SidecarExport",
    "configure",
    "export_failures_counter",
    "instance_id",
    "register_open_run",
    "unregister_open_run",
    "wait_for_ack",
    "wait_for_ack_async",
]

ENV_SIDECAR_ENDPOINT: Final = "SAGA_OTEL_SIDECAR_ENDPOINT"
_ENV_OTLP_HEADERS: Final = "OTEL_EXPORTER_OTLP_HEADERS"
_ENV_OTLP_TRACES_HEADERS: Final = "OTEL_EXPORTER_OTLP_TRACES_HEADERS"
_TRACES_PATH: Final = "/v1/traces"

REASON_TIMEOUT: Final = "timeout"
REASON_ERROR: Final = "error"
REASON_QUEUE_FULL: Final = "queue_full"
REASON_REJECTED: Final = "rejected"
_REASONS: Final = (REASON_TIMEOUT, REASON_ERROR, REASON_QUEUE_FULL, REASON_REJECTED)

# Failed tickets nobody has waited for yet are kept so a late wait still sees
# the failure; this caps them (successes are removed at once).
_MAX_FAILED_TICKETS: Final = 4096

Logger = Any  # structlog's BoundLogger protocol is loose; anything with .error/.warning/.info


# --------------------------------------------------------------------------
# metrics


def export_failures_counter(registry: CollectorRegistry | None = None) -> Counter:
    """``saga_export_failures_total{reason}`` in ``registry`` (default: the global one).

    The counter belongs to the library's metric set (``_metrics.metrics_for``),
    which caches one set per registry, so the engine and the exporter share one
    collector and prometheus-client never sees the name registered twice.
    """
    from saga_otel._metrics import metrics_for  # local: keeps import order loose

    return metrics_for(registry).export_failures


# --------------------------------------------------------------------------
# durable tickets (module level: the engine asks by span, not by processor)


@dataclass(frozen=True, slots=True)
class _Ticket:
    """One durable span awaiting its acknowledgement.

    The future's result is None once the sidecar answered 2xx, else the reason
    the span was lost. It is marked running at creation so that an asyncio
    wrapper cancelled by ``wait_for`` cannot cancel it under the sender.
    """

    span_id: int
    future: concurrent.futures.Future[str | None]
    owner: SagaSpanProcessor


_tickets_lock = threading.Lock()
_tickets: dict[int, _Ticket] = {}
_failed_order: deque[int] = deque()


def _new_ticket(span_id: int, owner: SagaSpanProcessor) -> _Ticket:
    fut: concurrent.futures.Future[str | None] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    ticket = _Ticket(span_id, fut, owner)
    with _tickets_lock:
        _tickets[span_id] = ticket
    return ticket


def _resolve(ticket: _Ticket, reason: str | None) -> None:
    try:
        ticket.future.set_result(reason)
    except concurrent.futures.InvalidStateError:
        return  # already resolved (shutdown raced the sender); first answer stands
    with _tickets_lock:
        if _tickets.get(ticket.span_id) is not ticket:
            return  # already waited for
        if reason is None:
            del _tickets[ticket.span_id]
            return
        _failed_order.append(ticket.span_id)
        while len(_failed_order) > _MAX_FAILED_TICKETS:
            old = _failed_order.popleft()
            stale = _tickets.get(old)
            if stale is not None and stale.future.done():
                del _tickets[old]


def _span_id_of(span: object) -> int | None:
    get = getattr(span, "get_span_context", None)
    if get is None:
        return None
    ctx = get()
    return None if ctx is None else int(ctx.span_id)


def _take_ticket(span: object) -> _Ticket | None:
    try:
        span_id = _span_id_of(span)
    except Exception:
        return None
    if span_id is None:
        return None
    with _tickets_lock:
        return _tickets.get(span_id)


def _forget(ticket: _Ticket) -> None:
    with _tickets_lock:
        if _tickets.get(ticket.span_id) is ticket:
            del _tickets[ticket.span_id]


def _judge(ticket: _Ticket, reason: str | None, span: object) -> bool:
    """Log/count the outcome of a durable wait; True when acknowledged."""
    _forget(ticket)
    if reason is None:
        return True
    owner = ticket.owner
    if reason == REASON_TIMEOUT:
        owner._count(REASON_TIMEOUT)
    # Other reasons were counted when the span was lost; log the step's view only.
    owner._log_failure(
        reason,
        "span not acknowledged by the sidecar before the step went on",
        span_name=getattr(span, "name", None),
        span_id=f"{ticket.span_id:016x}",
        ack_timeout_s=owner.ack_timeout,
    )
    return False


def wait_for_ack(span: ReadableSpan | trace.Span) -> bool:
    """Block until the sidecar acknowledged ``span``, at most the processor's ack_timeout.

    True when acknowledged, or when no durable processor took the span (cheap).
    False on timeout or loss, after logging and counting. Never raises.
    """
    ticket = _take_ticket(span)
    if ticket is None:
        return True
    try:
        try:
            reason = ticket.future.result(timeout=ticket.owner.ack_timeout)
        except concurrent.futures.TimeoutError:
            reason = REASON_TIMEOUT
        return _judge(ticket, reason, span)
    except Exception:  # never raise into the step
        return False


async def wait_for_ack_async(span: ReadableSpan | trace.Span) -> bool:
    """:func:`wait_for_ack` for coroutines: awaits without blocking the event loop."""
    ticket = _take_ticket(span)
    if ticket is None:
        return True
    try:
        try:
            reason = await asyncio.wait_for(
                asyncio.wrap_future(ticket.future), timeout=ticket.owner.ack_timeout
            )
        except TimeoutError:
            reason = REASON_TIMEOUT
        return _judge(ticket, reason, span)
    except asyncio.CancelledError:
        _forget(ticket)
        raise  # the caller's own cancellation is not ours to swallow
    except Exception:
        return False


# --------------------------------------------------------------------------
# the processor


def _is_saga_span(span: ReadableSpan) -> bool:
    attrs = span.attributes
    return attrs is not None and sc.SAGA_PHASE in attrs


class SagaSpanProcessor(SpanProcessor):
    """Sends saga spans to the sidecar at once, retrying until it answers.

    Why not ``OTLPSpanExporter.export``: its retry loop blocks the caller for up
    to its whole timeout with 1 s, 2 s, 4 s sleeps, does not retry a plain 500,
    and reports only SUCCESS/FAILURE, so a 400 (drop: configuration error) and
    a refused connection (keep: sidecar restarting) look the same. We reuse its
    encoder (``encode_spans``) and do the HTTP ourselves on one keep-alive
    connection, so each attempt is one bounded request and the buffer, not the
    thread, waits out the backoff. ``http.client`` rather than httpx/requests:
    on loopback it costs about half as much per request, and the wait for the
    ack is on every compensable step's path.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        durable: bool = True,
        ack_timeout: float = 0.5,
        headers: Mapping[str, str] | None = None,
        registry: CollectorRegistry | None = None,
        logger: Logger | None = None,
        max_queue_size: int = 10_000,
        max_batch_size: int = 512,
        request_timeout: float = 5.0,
        retry_initial: float = 0.1,
        retry_max: float = 5.0,
    ) -> None:
        if max_queue_size < 1 or max_batch_size < 1:
            raise ConfigurationError(
                f"max_queue_size={max_queue_size} / max_batch_size={max_batch_size}: "
                "both must be at least 1"
            )
        if ack_timeout <= 0:
            raise ConfigurationError(f"ack_timeout={ack_timeout!r} must be > 0 seconds")
        self.endpoint = endpoint
        self.durable = durable
        self.ack_timeout = float(ack_timeout)
        self._log = logger if logger is not None else default_logger()
        counter = export_failures_counter(registry)
        self._counters = {r: counter.labels(reason=r) for r in _REASONS}
        self._max_queue = max_queue_size
        self._max_batch = max_batch_size
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._poster = _Poster(endpoint, headers or {}, request_timeout)
        # Guarded by _cond: spans waiting to be sent (fresh and retried) and
        # the count of those in the request now in flight.
        self._cond = threading.Condition()
        self._queue: deque[tuple[ReadableSpan, _Ticket | None]] = deque()
        self._inflight = 0
        self._stopping = False
        self._closed = False
        self._kick = threading.Event()  # cuts a backoff short (flush/shutdown)
        self._overflow_logged = False
        self._down_logged = False
        self._thread = threading.Thread(target=self._run, name="saga-otel-export", daemon=True)
        self._thread.start()

    # -- SpanProcessor -----------------------------------------------------

    def on_end(self, span: ReadableSpan) -> None:
        try:
            if self._closed or not _is_saga_span(span):
                return
            attrs = span.attributes or {}
            ticket: _Ticket | None = None
            # Heartbeats are never waited on; the rest get a ticket in durable mode.
            if self.durable and attrs.get(sc.SAGA_PHASE) != sc.PHASE_HEARTBEAT:
                ctx = span.context
                if ctx is not None:
                    ticket = _new_ticket(ctx.span_id, self)
            with self._cond:
                if len(self._queue) + self._inflight >= self._max_queue:
                    full = True
                else:
                    full = False
                    self._queue.append((span, ticket))
                    self._cond.notify()
            if full:
                self._count(REASON_QUEUE_FULL)
                if ticket is not None:
                    _resolve(ticket, REASON_QUEUE_FULL)
                if not self._overflow_logged:
                    self._overflow_logged = True  # once per episode: a full queue is loud enough
                    self._log_failure(
                        REASON_QUEUE_FULL,
                        "export queue full; saga spans are being dropped",
                        max_queue_size=self._max_queue,
                    )
        except Exception as exc:  # never raise into span.end()
            self._hook_error("on_end", exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until everything queued was sent (or given up), bounded."""
        try:
            deadline = time.monotonic() + timeout_millis / 1000.0
            self._kick.set()
            with self._cond:
                while self._queue or self._inflight:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._cond.wait(min(left, 0.05))
                    self._kick.set()
            return True
        except Exception as exc:
            self._hook_error("force_flush", exc)
            return False

    def shutdown(self, timeout: float = 2.0) -> None:
        """Flush with a bound, stop the sender, count what is still unsent."""
        try:
            if self._closed:
                return
            self._closed = True  # new spans are ignored from here on
            self.force_flush(int(timeout * 1000))
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._kick.set()
            self._thread.join(timeout=max(0.1, timeout / 4))
            with self._cond:
                left = list(self._queue)
                self._queue.clear()
            if left:
                self._lose(left, REASON_ERROR, "sidecar unreachable at shutdown")
            self._poster.close()
        except Exception as exc:
            self._hook_error("shutdown", exc)

    # -- the sender thread ---------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    left = list(self._queue)
                    self._queue.clear()
                else:
                    left = None
            if left is not None:
                if left:
                    self._lose(left, REASON_ERROR, "sidecar unreachable at shutdown")
                return
            with self._cond:
                n = min(len(self._queue), self._max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
                self._inflight = n
            try:
                outcome, delay = self._send(batch, failures)
            except Exception as exc:  # belt and braces: the thread must not die
                self._hook_error("send", exc)
                outcome, delay = "retry", None
            if outcome == "retry":
                failures += 1
                kept = _prune_heartbeats(batch)
                with self._cond:
                    self._queue.extendleft(reversed(kept))
                    self._inflight = 0
                    self._cond.notify_all()
                wait = delay if delay is not None else self._backoff(failures)
                self._kick.wait(wait)
                self._kick.clear()
            else:
                failures = 0
                with self._cond:
                    self._inflight = 0
                    self._cond.notify_all()

    def _backoff(self, failures: int) -> float:
        # Exponential with "equal jitter": spreads agents that lost the same sidecar.
        cap = min(self._retry_max, self._retry_initial * 2.0 ** min(failures - 1, 30))
        return cap / 2 + random.uniform(0, cap / 2)

    def _send(
        self, batch: list[tuple[ReadableSpan, _Ticket | None]], failures: int
    ) -> tuple[str, float | None]:
        """One attempt; returns ("ok" | "drop" | "retry", retry delay or None)."""
        try:
            body = encode_spans([s for s, _ in batch]).SerializeToString()
        except Exception as exc:
            self._lose(batch, REASON_ERROR, f"could not encode spans: {exc!r}")
            return "drop", None
        try:
            resp = self._poster.post(body)
        except Exception as exc:  # refused, reset, timed out: the sidecar may come back
            self._note_down(f"{type(exc).__name__}: {exc}", failures)
            return "retry", None
        code = resp.status
        if 200 <= code < 300:
            if self._down_logged:
                self._down_logged = False
                self._safe_log("info", "saga.export.recovered", endpoint=self.endpoint)
            self._overflow_logged = False
            rejected = _partial_rejections(resp.body)
            if rejected:
                self._count(REASON_REJECTED, rejected)
                self._log_failure(
                    REASON_REJECTED,
                    "sidecar accepted the request but rejected some spans",
                    rejected_spans=rejected,
                )
            for _, ticket in batch:
                if ticket is not None:
                    _resolve(ticket, None)
            return "ok", None
        if code == 429 or code >= 500:
            self._note_down(f"HTTP {code}", failures)
            return "retry", _retry_after(resp.retry_after, self._retry_max)
        # 4xx (or a redirect): resending cannot help; it is a configuration error.
        self._lose(
            batch,
            REASON_REJECTED,
            f"sidecar answered HTTP {code}; check the endpoint path and the "
            f"Authorization header (OTEL_EXPORTER_OTLP_HEADERS)",
            status=code,
            body=resp.body[:200].decode("utf-8", "replace"),
        )
        return "drop", None

    # -- failure bookkeeping -------------------------------------------------

    def _lose(
        self,
        batch: Sequence[tuple[ReadableSpan, _Ticket | None]],
        reason: str,
        message: str,
        **kw: object,
    ) -> None:
        self._count(reason, len(batch))
        for _, ticket in batch:
            if ticket is not None:
                _resolve(ticket, reason)
        self._log_failure(reason, message, spans=len(batch), **kw)

    def _note_down(self, what: str, failures: int) -> None:
        if not self._down_logged:
            self._down_logged = True  # once per outage; retries are silent until recovery
            self._log_failure(
                REASON_ERROR,
                "sidecar unreachable; keeping saga spans and retrying",
                cause=what,
                queued=len(self._queue),
            )

    def _count(self, reason: str, n: int = 1) -> None:
        with contextlib.suppress(Exception):  # a metrics failure must not hurt the agent
            self._counters[reason].inc(n)

    def _log_failure(self, reason: str, message: str, **kw: object) -> None:
        self._safe_log(
            "error",
            sc.EV_EXPORT_FAILED,
            reason=reason,
            message=message,
            endpoint=self.endpoint,
            **kw,
        )

    def _safe_log(self, level: str, event: str, **kw: object) -> None:
        with contextlib.suppress(Exception):  # a broken logging setup must not hurt the agent
            getattr(self._log, level)(event, **kw)

    def _hook_error(self, where: str, exc: BaseException) -> None:
        self._count(REASON_ERROR)
        self._log_failure(REASON_ERROR, f"saga span processor error in {where}", error=repr(exc))


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    retry_after: str | None
    body: bytes


# A keep-alive connection the server has closed fails on first use this way;
# one immediate retry on a fresh connection is the cure (a resent request is
# harmless: the receiver deduplicates by span id).
_STALE: Final = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class _Poster:
    """One keep-alive HTTP/1.1 connection to the sidecar, used by the sender thread only."""

    def __init__(self, endpoint: str, headers: Mapping[str, str], timeout: float) -> None:
        parts = urlsplit(endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._headers = {**dict(headers), "Content-Type": "application/x-protobuf"}
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def post(self, body: bytes) -> _Answer:
        reused = self._conn is not None
        try:
            return self._once(body)
        except _STALE:
            if not reused:
                raise
            return self._once(body)

    def _once(self, body: bytes) -> _Answer:
        if self._conn is None:
            if self._https:
                self._conn = http.client.HTTPSConnection(
                    self._host,
                    self._port,
                    timeout=self._timeout,
                    context=ssl.create_default_context(),
                )
            else:
                self._conn = http.client.HTTPConnection(
                    self._host, self._port, timeout=self._timeout
                )
        try:
            self._conn.request("POST", self._path, body=body, headers=self._headers)
            resp = self._conn.getresponse()
            data = resp.read()
        except BaseException:
            self.close()
            raise
        if resp.will_close:
            self.close()
        return _Answer(resp.status, resp.getheader("retry-after"), data)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


def _prune_heartbeats(
    batch: list[tuple[ReadableSpan, _Ticket | None]],
) -> list[tuple[ReadableSpan, _Ticket | None]]:
    """Keep only the newest heartbeat of a batch being retried: older ones say nothing more."""
    last = -1
    for i, (span, _) in enumerate(batch):
        if (span.attributes or {}).get(sc.SAGA_PHASE) == sc.PHASE_HEARTBEAT:
            last = i
    return [
        item
        for i, item in enumerate(batch)
        if i == last or (item[0].attributes or {}).get(sc.SAGA_PHASE) != sc.PHASE_HEARTBEAT
    ]


def _partial_rejections(body: bytes) -> int:
    if not body:
        return 0
    try:
        msg = ExportTraceServiceResponse.FromString(body)
        return int(msg.partial_success.rejected_spans)
    except Exception:
        return 0  # a body we cannot read is not a reason to resend


def _retry_after(value: str | None, cap: float) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), cap)


# --------------------------------------------------------------------------
# heartbeats


_runs_cond = threading.Condition()
_open_runs: set[str] = set()


def register_open_run(run_id: str) -> None:
    """Mark ``run_id`` open in this process; heartbeats name it until unregistered."""
    with _runs_cond:
        _open_runs.add(run_id)
        _runs_cond.notify_all()
    active = _active
    if active is not None:
        active._ensure_heartbeat()


def unregister_open_run(run_id: str) -> None:
    with _runs_cond:
        _open_runs.discard(run_id)


def _open_run_ids() -> list[str]:
    with _runs_cond:
        return sorted(_open_runs)


class _Heartbeat:
    """The one thread that emits ``saga.heartbeat`` while runs are open."""

    def __init__(
        self,
        provider: TracerProvider,
        interval: float,
        logger: Logger,
        wait: Callable[[threading.Event, float], bool] | None = None,
    ) -> None:
        self._tracer = provider.get_tracer("saga_otel")
        self._interval = float(interval)
        self._log = logger
        self._stop = threading.Event()
        self._wait = wait if wait is not None else (lambda ev, s: ev.wait(s))
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

    def stop(self, timeout: float) -> None:
        self._stop.set()
        with _runs_cond:
            _runs_cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            with _runs_cond:
                while not _open_runs and not self._stop.is_set():
                    _runs_cond.wait()
                runs = sorted(_open_runs)
            if self._stop.is_set():
                return
            self.emit(runs)
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
            with contextlib.suppress(Exception):
                self._log.error(
                    sc.EV_TELEMETRY_ERROR, message="heartbeat not emitted", error=repr(exc)
                )


# --------------------------------------------------------------------------
# configure()


_INSTANCE_ID = str(uuid.uuid4())


def _new_instance_id() -> None:
    global _INSTANCE_ID
    _INSTANCE_ID = str(uuid.uuid4())  # a forked child is another process


os.register_at_fork(after_in_child=_new_instance_id)


def instance_id() -> str:
    """This process's ``service.instance.id`` when saga_otel made the resource."""
    return _INSTANCE_ID


def _resolve_endpoint(value: str) -> str:
    raw = value.strip()
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigurationError(
            f"sidecar endpoint {value!r} is not an http(s) URL; pass sidecar_endpoint= or set "
            f"{ENV_SIDECAR_ENDPOINT} to the sidecar's OTLP/HTTP base URL, "
            "e.g. http://127.0.0.1:4318"
        )
    path = parts.path if parts.path not in ("", "/") else _TRACES_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def _resolve_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    # The standard variables: generic first, the traces-specific one overrides it.
    for var in (_ENV_OTLP_HEADERS, _ENV_OTLP_TRACES_HEADERS):
        raw = os.environ.get(var)
        if raw:
            out.update(parse_env_headers(raw, liberal=True))
    if headers:
        out.update({k.lower(): v for k, v in headers.items()})
    return out


def _own_provider() -> TracerProvider:
    resource = Resource.create()
    if sc.SERVICE_INSTANCE_ID not in resource.attributes:
        resource = resource.merge(Resource({sc.SERVICE_INSTANCE_ID: _INSTANCE_ID}))
    return TracerProvider(resource=resource)


class SidecarExport:
    """What :func:`configure` set up; ``shutdown()`` stops it."""

    __slots__ = ("_heartbeat", "_shutdown_lock", "_stopped", "processor", "tracer_provider")

    def __init__(
        self,
        tracer_provider: TracerProvider,
        processor: SagaSpanProcessor | None,
        heartbeat: _Heartbeat,
    ) -> None:
        self.tracer_provider = tracer_provider
        self.processor = processor
        self._heartbeat = heartbeat
        self._stopped = False
        self._shutdown_lock = threading.Lock()

    @property
    def endpoint(self) -> str | None:
        return None if self.processor is None else self.processor.endpoint

    @property
    def durable(self) -> bool:
        return self.processor is not None and self.processor.durable

    def _ensure_heartbeat(self) -> None:
        if not self._stopped:
            self._heartbeat.ensure_started()

    def force_flush(self, timeout: float = 2.0) -> bool:
        return True if self.processor is None else self.processor.force_flush(int(timeout * 1000))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop heartbeats and the sender, flushing pending spans within ``timeout`` seconds."""
        global _active
        with self._shutdown_lock:
            if self._stopped:
                return
            self._stopped = True
        self._heartbeat.stop(timeout=max(0.1, timeout / 4))
        if self.processor is not None:
            self.processor.shutdown(timeout)
        if _active is self:
            _active = None


_active: SidecarExport | None = None
_atexit_registered = False
_configure_lock = threading.Lock()


def _at_exit() -> None:
    active = _active
    if active is not None:
        active.shutdown()


def configure(
    sidecar_endpoint: str | None = None,
    *,
    tracer_provider: TracerProvider | None = None,
    durable: bool | None = None,
    ack_timeout: float = 0.5,
    heartbeat_interval: float = 1.0,
    headers: Mapping[str, str] | None = None,
    registry: CollectorRegistry | None = None,
    logger: Logger | None = None,
    max_queue_size: int = 10_000,
    request_timeout: float = 5.0,
    retry_initial: float = 0.1,
    retry_max: float = 5.0,
) -> SidecarExport:
    """Send this process's saga spans to the sidecar and emit heartbeats.

    The endpoint is ``sidecar_endpoint`` or ``$SAGA_OTEL_SIDECAR_ENDPOINT`` (a
    base URL gets ``/v1/traces``). Without one no processor is added (spans
    reach the sidecar through the user's own pipeline, if any) and durable
    waits return at once. Calling again replaces the previous setup.
    """
    global _active, _atexit_registered
    log = logger if logger is not None else default_logger()
    raw = sidecar_endpoint if sidecar_endpoint is not None else os.environ.get(ENV_SIDECAR_ENDPOINT)
    endpoint = _resolve_endpoint(raw) if raw else None
    if durable is None:
        durable = endpoint is not None
    if durable and endpoint is None:
        raise ConfigurationError(
            "durable=True needs a sidecar endpoint: pass sidecar_endpoint= or set "
            f"{ENV_SIDECAR_ENDPOINT} (e.g. http://127.0.0.1:4318), or leave durable unset"
        )
    if heartbeat_interval <= 0:
        raise ConfigurationError(
            f"heartbeat_interval={heartbeat_interval!r} must be > 0 seconds (default 1.0)"
        )

    if tracer_provider is not None:
        if not isinstance(tracer_provider, TracerProvider):
            raise ConfigurationError(
                f"tracer_provider {tracer_provider!r} is not an OpenTelemetry SDK "
                "TracerProvider; pass opentelemetry.sdk.trace.TracerProvider or None"
            )
        provider = tracer_provider
    else:
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            provider = current  # the user's: we only add our processor to it
        else:
            provider = _own_provider()
            trace.set_tracer_provider(provider)

    processor: SagaSpanProcessor | None = None
    if endpoint is not None:
        processor = SagaSpanProcessor(
            endpoint,
            durable=durable,
            ack_timeout=ack_timeout,
            headers=_resolve_headers(headers),
            registry=registry,
            logger=log,
            max_queue_size=max_queue_size,
            request_timeout=request_timeout,
            retry_initial=retry_initial,
            retry_max=retry_max,
        )

    with _configure_lock:
        previous = _active
        if previous is not None:
            previous.shutdown()
        if processor is not None:
            provider.add_span_processor(processor)
        export = SidecarExport(provider, processor, _Heartbeat(provider, heartbeat_interval, log))
        _active = export
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
    if _open_run_ids():
        export._ensure_heartbeat()
    return export
