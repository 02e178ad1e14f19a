"""The saga span processor: one sender thread per processor, posting to the sidecar.

Saga spans (those carrying ``saga.phase``) are queued at ``on_end`` and sent at
once over OTLP/HTTP protobuf by the processor's sender thread; while the
sidecar is down they wait in the queue and the thread retries with backoff.
Nothing here ever raises into the agent: failures are logged
(``saga.export.failed``) and counted (``saga_export_failures_total{reason}``,
see :mod:`saga_otel._acks` for the counting rule).

One bad span never costs another run its spans: a request refused as a whole
(413 or another 4xx), or answered with rejected spans (OTLP partial success, which
counts them but does not say which), that carried several spans is retried span
by span. A span too large to send (413 alone, or over ``max_span_bytes`` once
encoded), or rejected on its own, is never acknowledged: it is replaced by a small
marker span of the same run and trace, carrying ``saga.export.dropped`` (see
``docs/semantic-conventions.md``), after an error log naming the run, the step,
the size and, for a rejected span, the sidecar's message. A heartbeat gets no
marker (one without its run list would say nothing is open): ``_heartbeat`` cuts
a beat into spans that fit, and one that cannot fit is dropped, logged as such.

Several endpoints (sidecar replicas on one database): requests take them in
turn; one that refuses, resets, times out or answers 429/5xx is skipped for
``retry_max`` seconds and the unacknowledged spans go at once to the next
(the receiver deduplicates a resend by span id). The sidecar counts as down
(the circuit below) only when every endpoint failed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanContext
from prometheus_client import CollectorRegistry, Counter

from saga_otel import semconv as sc
from saga_otel._acks import (
    REASON_ERROR,
    REASON_QUEUE_FULL,
    REASON_REJECTED,
    REASON_SIDECAR_DOWN,
    REASON_TOO_LARGE,
    REASONS,
    Ticket,
    new_ticket,
    resolve,
)
from saga_otel._errors import ConfigurationError
from saga_otel._frozen import fast_init
from saga_otel._logging import Logger, default_logger
from saga_otel._transport import Poster, TransportSettings, partial_rejections, retry_after
from saga_otel._wire import encode
from saga_otel.records import backoff_seconds, describe_error

__all__ = ["DEFAULT_MAX_SPAN_BYTES", "SagaSpanProcessor", "export_failures_counter"]

# Well under the sidecar's default --max-body (16 MiB): a span this big is
# replaced by a marker before it is ever posted.
DEFAULT_MAX_SPAN_BYTES: Final = 4 * 1024 * 1024
# A marker keeps an attribute only if its value is about this small.
_MARKER_VALUE_BYTES: Final = 256
# Attributes that say which run and step a marker stands for: always kept.
_IDENTITY: Final = frozenset(
    {
        sc.SAGA_RUN_ID,
        sc.SAGA_NAME,
        sc.SAGA_CONTRACT_VERSION,
        sc.SAGA_PHASE,
        sc.SAGA_STEP_NAME,
        sc.SAGA_STEP_INDEX,
        sc.SAGA_STEP_CLASS,
        sc.SAGA_RUN_STATUS,
    }
)

Outcome = Literal["ok", "drop", "retry", "split"]


def export_failures_counter(registry: CollectorRegistry | None = None) -> Counter:
    """``saga_export_failures_total{reason}`` in ``registry`` (default: the global one).

    The counter belongs to the library's metric set (``_metrics.metrics_for``),
    which caches one set per registry, so the engine and the exporter share one
    collector and prometheus-client never sees the name registered twice.
    """
    from saga_otel._metrics import metrics_for  # local: keeps import order loose

    return metrics_for(registry).export_failures


@fast_init
@dataclass(frozen=True, slots=True)
class _Item:
    """A queued span: its ticket (durable mode), and whether it must travel alone."""

    span: ReadableSpan
    ticket: Ticket | None
    alone: bool = False  # set after its batch was refused as a whole
    marker: bool = False  # a marker is never replaced by another marker
    # A marker carries the ticket of the span it replaces, released with this reason
    # (not acknowledged) once the marker was answered.
    failed: str | None = None
    beat: int | None = None  # a heartbeat's beat number (saga.heartbeat.beat), if any


def _is_saga_span(span: ReadableSpan) -> bool:
    attrs = span.attributes
    return attrs is not None and sc.SAGA_PHASE in attrs


def _is_heartbeat(span: ReadableSpan) -> bool:
    return (span.attributes or {}).get(sc.SAGA_PHASE) == sc.PHASE_HEARTBEAT


def _beat_of(span: ReadableSpan) -> int | None:
    beat = (span.attributes or {}).get(sc.SAGA_HEARTBEAT_BEAT)
    return beat if isinstance(beat, int) and not isinstance(beat, bool) else None


class SagaSpanProcessor(SpanProcessor):
    """Sends saga spans to the sidecar at once, retrying until it answers.

    Why not ``OTLPSpanExporter.export``: its retry loop blocks the caller for up
    to its whole timeout with 1 s, 2 s, 4 s sleeps, does not retry a plain 500,
    and reports only SUCCESS/FAILURE, so a 400 (drop: configuration error) and
    a refused connection (keep: sidecar restarting) look the same. The request
    bytes are the SDK encoder's, written directly (:mod:`saga_otel._wire`: the
    step waits for them), and we do the HTTP ourselves (:mod:`saga_otel._transport`),
    so each attempt is one bounded request and the queue, not the thread,
    waits out the backoff.
    """

    def __init__(
        self,
        endpoint: str | Sequence[str],
        *,
        durable: bool = True,
        ack_timeout: float = 0.5,
        transport: TransportSettings | None = None,
        registry: CollectorRegistry | None = None,
        logger: Logger | None = None,
        max_queue_size: int = 10_000,
        max_batch_size: int = 512,
        max_span_bytes: int = DEFAULT_MAX_SPAN_BYTES,
        retry_initial: float = 0.1,
        retry_max: float = 5.0,
        shutdown_timeout: float = 2.0,
    ) -> None:
        if max_queue_size < 1 or max_batch_size < 1:
            raise ConfigurationError(
                f"max_queue_size={max_queue_size} / max_batch_size={max_batch_size}: "
                "both must be at least 1"
            )
        if ack_timeout <= 0:
            raise ConfigurationError(f"ack_timeout={ack_timeout!r} must be > 0 seconds")
        if max_span_bytes < 1024:
            raise ConfigurationError(
                f"max_span_bytes={max_span_bytes!r} is too small: use at least 1024 "
                f"(default {DEFAULT_MAX_SPAN_BYTES})"
            )
        if shutdown_timeout <= 0:
            raise ConfigurationError(
                f"shutdown_timeout={shutdown_timeout!r} must be > 0 seconds (default 2.0)"
            )
        self.endpoints = (endpoint,) if isinstance(endpoint, str) else tuple(endpoint)
        if not self.endpoints:
            raise ConfigurationError(
                "no sidecar endpoint given: pass one URL or a list of them, "
                "e.g. ['http://10.0.0.1:4318', 'http://10.0.0.2:4318']"
            )
        self.durable = durable
        self.ack_timeout = float(ack_timeout)
        self.shutdown_timeout = float(shutdown_timeout)
        self._log = logger if logger is not None else default_logger()
        counter = export_failures_counter(registry)
        self._counters = {r: counter.labels(reason=r) for r in REASONS}
        self._max_queue = max_queue_size
        self._max_batch = max_batch_size
        self._max_span_bytes = max_span_bytes
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._ids = RandomIdGenerator()
        settings = transport or TransportSettings(headers={})
        self._posters = [Poster(e, settings) for e in self.endpoints]
        self._at = 0  # the endpoint of the request in flight (or the last one)
        self._next = 0  # the endpoint the next request tries first (round robin)
        self._cooling = [0.0] * len(self._posters)  # failed endpoints: skipped until then
        self._closed = False
        self._start()

    def _start(self) -> None:
        """Fresh queue, locks and sender thread (at creation, and in a forked child)."""
        # Guarded by _cond: spans waiting to be sent (fresh and retried) and
        # the count of those in the request now in flight.
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._inflight = 0
        # The newest beat number queued: a heartbeat of an older beat is dropped when its
        # turn comes (the newer one names every run open now), with all of its parts.
        self._newest_beat = 0
        self._stopping = False
        self._kick = threading.Event()  # cuts a backoff short (flush/shutdown)
        self._overflow_logged = False
        # The circuit: open once the sidecar is known down (unreachable: refused,
        # reset, timed out; or answering 429/5xx for longer than the ack bound)
        # until the next 2xx. While open, durable waits return at once; the
        # sender's retries, spaced by its backoff, are the half-open probes.
        self._down = False
        self._failing_since: float | None = None  # start of the current failure streak
        self._thread = threading.Thread(target=self._run, name="saga-otel-export", daemon=True)
        self._thread.start()

    def after_fork_in_child(self) -> None:
        """Fork copied the queue but not the sender thread: start over in the child.

        The queued spans are the parent's (its sender still delivers them) and
        their tickets were resolved as lost by ``ProcessState.after_fork_in_child``.
        """
        for poster in self._posters:
            poster.forget_after_fork()
        if not self._closed:
            self._start()

    @property
    def endpoint(self) -> str:
        """The endpoint of the request in flight, or of the last one."""
        return self.endpoints[self._at]

    # -- SpanProcessor -----------------------------------------------------

    def on_end(self, span: ReadableSpan) -> None:
        try:
            if self._closed or not _is_saga_span(span):
                return
            ticket: Ticket | None = None
            if _is_heartbeat(span):  # never waited on
                self._enqueue(_Item(span, None, beat=_beat_of(span)))
                return
            # The rest get a ticket in durable mode.
            if self.durable:
                ctx = span.context
                if ctx is not None:
                    ticket = new_ticket(ctx.span_id, self)
                    if self._down:
                        resolve(ticket, REASON_SIDECAR_DOWN)  # queued; nothing to wait for
            self._enqueue(_Item(span, ticket))
        except Exception as exc:  # never raise into span.end()
            self._hook_error("on_end", exc)

    def _enqueue(self, item: _Item) -> None:
        with self._cond:
            full = len(self._queue) + self._inflight >= self._max_queue
            if not full:
                self._queue.append(item)
                if item.beat is not None and item.beat > self._newest_beat:
                    self._newest_beat = item.beat
                self._cond.notify()
        if not full:
            return
        self.count(REASON_QUEUE_FULL)
        if item.ticket is not None:
            resolve(item.ticket, REASON_QUEUE_FULL)
        if not self._overflow_logged:
            self._overflow_logged = True  # once per episode: a full queue is loud enough
            self.log_failure(
                REASON_QUEUE_FULL,
                "export queue full; saga spans are being dropped",
                max_queue_size=self._max_queue,
            )

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

    def shutdown(self, timeout: float | None = None) -> None:
        """Flush, stop the sender and count what is still unsent, all within ``timeout``.

        ``timeout`` defaults to ``shutdown_timeout``. The bound holds whatever
        the sidecar does (slow, dripping, half-open, refusing): past it the
        connection is aborted, which wakes a sender blocked on it, and the
        sender, a daemon thread, is not waited for any longer.
        """
        try:
            if self._closed:
                return
            self._closed = True  # new spans are ignored from here on
            budget = self.shutdown_timeout if timeout is None else max(0.0, float(timeout))
            deadline = time.monotonic() + budget
            # Most of the budget for delivery; the rest to stop the thread.
            self.force_flush(int(budget * 0.8 * 1000))
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._kick.set()
            for poster in self._posters:
                poster.abort()
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
            with self._cond:
                left = list(self._queue)
                self._queue.clear()
            if left:
                self._lose(left, REASON_ERROR, "sidecar unreachable at shutdown")
        except Exception as exc:
            self._hook_error("shutdown", exc)

    # -- the sender thread ---------------------------------------------------

    def _take_batch(self) -> list[_Item] | None:
        """The next request's spans, or None when stopping (unsent spans are lost).

        Heartbeats of a beat older than the newest queued are dropped on the way: after
        an outage only the newest beat goes, whole (each of its parts)."""
        queue = self._queue
        batch: list[_Item] = []
        with self._cond:
            while not batch:
                while not queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                newest = self._newest_beat
                while queue and len(batch) < self._max_batch:
                    item = queue[0]
                    if item.beat is not None and item.beat < newest:
                        queue.popleft()  # superseded: says nothing the newer beat does not
                        continue
                    if item.alone and batch:
                        break
                    batch.append(queue.popleft())
                    if item.alone:
                        break
                if not batch:
                    self._cond.notify_all()  # only stale heartbeats were left: a flush may end
            if self._stopping:
                left = list(queue)
                queue.clear()
            else:
                left = None
                self._inflight = len(batch)
        if left is not None:
            if left:
                self._lose(left, REASON_ERROR, "sidecar unreachable at shutdown")
            return None
        return batch

    def _run(self) -> None:
        failures = 0
        while True:
            batch = self._take_batch()
            if batch is None:
                for poster in self._posters:
                    poster.close()
                return
            try:
                outcome, delay = self._send(batch)
            except Exception as exc:  # belt and braces: the thread must not die
                self._hook_error("send", exc)
                outcome, delay = "retry", None
            if outcome == "retry":
                failures += 1
                with self._cond:
                    self._queue.extendleft(reversed(batch))
                    self._inflight = 0
                    self._cond.notify_all()
                wait = delay if delay is not None else self._backoff(failures)
                self._kick.wait(wait)
                self._kick.clear()
            elif outcome == "split":
                # Refused as a whole: each span goes again on its own, in order.
                with self._cond:
                    self._queue.extendleft(
                        reversed(
                            [
                                _Item(i.span, i.ticket, True, i.marker, i.failed, i.beat)
                                for i in batch
                            ]
                        )
                    )
                    self._inflight = 0
                    self._cond.notify_all()
            else:
                failures = 0
                with self._cond:
                    self._inflight = 0
                    self._cond.notify_all()

    def _backoff(self, failures: int) -> float:
        # Exponential with "equal jitter" (half the capped delay fixed, half random),
        # written as the one backoff formula: spreads agents that lost the same sidecar.
        return backoff_seconds(
            failures,
            initial=self._retry_initial / 2,
            maximum=self._retry_max / 2,
            jitter_ratio=1.0,
        )

    def _send(self, batch: list[_Item]) -> tuple[Outcome, float | None]:
        """One attempt; returns the outcome and a retry delay (or None)."""
        try:
            body = encode([i.span for i in batch])
        except Exception as exc:
            self._lose(batch, REASON_ERROR, f"could not encode spans: {exc!r}")
            return "drop", None
        if len(body) > self._max_span_bytes:
            if len(batch) > 1:
                return "split", None
            self._too_large(batch[0], len(body), f"over max_span_bytes={self._max_span_bytes}")
            return "drop", None
        poster = self._posters[self._pick()]
        try:
            resp = poster.post(body)
        except Exception as exc:  # refused, reset, timed out: the sidecar may come back
            if self._fail_over(None):
                return "retry", 0.0
            self._note_down(describe_error(exc), batch, unreachable=True)
            return "retry", None
        code = resp.status
        if 200 <= code < 300:
            self._cooling[self._at] = 0.0
            self._failing_since = None
            if self._down:
                self._down = False
                self._safe_log(
                    "info",
                    sc.EV_EXPORT_RECOVERED,
                    message="sidecar reachable again; steps wait for acknowledgement again",
                    endpoint=self.endpoint,
                )
            self._overflow_logged = False
            answer = partial_rejections(resp.body)
            if answer.rejected:
                # A rejected span is never acknowledged. The answer counts the rejected
                # spans but does not say which: a batch goes again span by span (as one
                # refused as a whole), so each span has an answer of its own. The spans
                # the receiver took are answered as resends (deduplicated by span id);
                # failing the whole batch instead would escalate runs whose spans arrived.
                if len(batch) > 1:
                    return "split", None
                self._replace(
                    batch[0],
                    len(body),
                    reason=REASON_REJECTED,
                    dropped=sc.DROPPED_REJECTED,
                    message="the sidecar rejected a saga span (OTLP partial success; "
                    "error says why)",
                    error=answer.message,
                )
                return "drop", None
            for item in batch:
                if item.ticket is not None:
                    resolve(item.ticket, item.failed)
            return "ok", None
        if code == 429 or code >= 500:
            delay = retry_after(resp.retry_after, self._retry_max)
            if self._fail_over(delay):
                return "retry", 0.0
            self._note_down(f"HTTP {code}", batch, unreachable=False)
            return "retry", delay
        if len(batch) > 1:
            return "split", None  # one bad span must not take the others with it
        if code == 413:
            self._too_large(batch[0], len(body), "the sidecar answered 413 (over its --max-body)")
            return "drop", None
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

    def _pick(self) -> int:
        """The endpoint for the next request: the next in turn that is not cooling off
        after a failure, else the one back soonest (it is the probe)."""
        n = len(self._posters)
        if n == 1:
            return 0
        now = time.monotonic()
        cooling = self._cooling
        at = min(range(n), key=lambda k: (cooling[k], (k - self._next) % n))
        for k in range(n):
            i = (self._next + k) % n
            if cooling[i] <= now:
                at = i
                break
        self._at, self._next = at, (at + 1) % n
        return at

    def _fail_over(self, delay: float | None) -> bool:
        """The request's endpoint failed: skip it a while; True when another may take
        the spans now."""
        n = len(self._posters)
        if n == 1:
            return False
        now = time.monotonic()
        self._cooling[self._at] = now + max(self._retry_max, delay or 0.0)
        ready = [i for i in range(n) if self._cooling[i] <= now]
        if ready:
            self._safe_log(
                "warning",
                sc.EV_EXPORT_FAILOVER,
                message="sidecar endpoint failed; sending its spans to the next one",
                failed=self.endpoints[self._at],
                next=self.endpoints[self._next if self._next in ready else ready[0]],
            )
        return bool(ready)

    # -- a span too large to send, or rejected ------------------------------

    def _too_large(self, item: _Item, size: int, why: str) -> None:
        self._replace(
            item,
            size,
            reason=REASON_TOO_LARGE,
            dropped=sc.DROPPED_TOO_LARGE,
            message=f"saga span too large to send ({why})",
        )

    def _replace(
        self, item: _Item, size: int, *, reason: str, dropped: str, message: str, **kw: object
    ) -> None:
        """Lose ``item`` loudly and queue a small marker of its run in its place, so
        the sidecar knows the run and escalates it instead of never hearing of it. A
        marker refused in turn, and a heartbeat, are lost with no marker (the log says)."""
        attrs = item.span.attributes or {}
        heartbeat = _is_heartbeat(item.span)
        if item.marker:
            message += "; it is a marker already, nothing smaller can be sent"
        elif heartbeat:
            # A heartbeat without its run list would say "no runs open". Its parts fit
            # unless the span is too large with no run named (the resource's size).
            message += (
                "; the heartbeat is dropped, with no marker: if none gets through, the "
                "sidecar pages this process's open runs orphaned"
            )
            if reason == REASON_TOO_LARGE:
                message += (
                    " (a beat is cut into parts within max_span_bytes: one is too large only"
                    " when its resource is, or when max_span_bytes exceeds the sidecar's"
                    " --max-body)"
                )
        else:
            message += "; a marker span replaces it"
        self.count(reason)
        # The waiter is released last: once it goes on, the agent (or a test) may read
        # the log before this thread runs again; with a marker, once the marker was
        # answered, so that an agent killed after its step went on has left the run
        # at the sidecar.
        handed = False
        try:
            self.log_failure(
                reason,
                message,
                run_id=attrs.get(sc.SAGA_RUN_ID),
                step=attrs.get(sc.SAGA_STEP_NAME),
                span_name=item.span.name,
                size_bytes=size,
                marker=not item.marker and not heartbeat,
                **kw,
            )
            if item.marker or heartbeat:
                return
            try:
                marker = self._marker(item.span, size, dropped)
            except Exception as exc:
                self._hook_error("marker", exc)
                return
            with self._cond:
                # First in line: the marker is what the sidecar needs to hear next.
                self._queue.appendleft(_Item(marker, item.ticket, True, True, reason))
                self._cond.notify()
            handed = True
        finally:
            if item.ticket is not None and not handed:
                resolve(item.ticket, reason)

    def _marker(self, span: ReadableSpan, size: int, dropped: str) -> ReadableSpan:
        # Too large: the small attributes travel along. Rejected: the identity only, as
        # any other may be what the sidecar refused (a value cut by a span limit).
        small_too = dropped == sc.DROPPED_TOO_LARGE
        kept: dict[str, Any] = {}
        removed: list[str] = []
        for key, value in (span.attributes or {}).items():
            if key in _IDENTITY or (small_too and _small(value)):
                kept[key] = value
            else:
                removed.append(key)
        ctx = span.context
        if ctx is None:  # spans without a context never reach the queue
            raise ValueError(f"span {span.name!r} has no context")
        kept.update(
            {
                sc.SAGA_EXPORT_DROPPED: dropped,
                sc.SAGA_EXPORT_DROPPED_SPAN: span.name[:_MARKER_VALUE_BYTES],
                sc.SAGA_EXPORT_DROPPED_SPAN_ID: f"{ctx.span_id:016x}",
                sc.SAGA_EXPORT_DROPPED_SIZE: size,
                sc.SAGA_EXPORT_DROPPED_ATTRIBUTES: sorted(removed),
            }
        )
        return ReadableSpan(
            name=span.name[:_MARKER_VALUE_BYTES],
            # Same trace and parent, a span id of its own: the sidecar never
            # saw the original, and an id must not carry two contents.
            context=SpanContext(ctx.trace_id, self._ids.generate_span_id(), False, ctx.trace_flags),
            parent=span.parent,
            resource=span.resource,
            attributes=kept,
            kind=span.kind,
            status=span.status,  # the step's own outcome; the attributes say what is missing
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )

    # -- failure bookkeeping -------------------------------------------------

    def _lose(self, batch: Sequence[_Item], reason: str, message: str, **kw: object) -> None:
        self.count(reason, len(batch))
        # Logged before the waiters are released (as in _note_down): once they go on,
        # the agent (or a test) may read the log before this thread runs again.
        self.log_failure(reason, message, spans=len(batch), **kw)
        for item in batch:
            if item.ticket is not None:
                resolve(item.ticket, reason)

    def _note_down(self, what: str, batch: Sequence[_Item], *, unreachable: bool) -> None:
        """Open the circuit when the sidecar is known down; one log line per outage.

        Unreachable is known down at once. A sidecar that answers 429 or 5xx is
        alive, so a brief streak (which a retry usually cures) leaves the circuit
        closed; one longer than the ack bound would have failed the waits anyway.
        """
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if self._down or (not unreachable and now - self._failing_since < self.ack_timeout):
            return
        self._down = True
        with self._cond:
            waiting = [i.ticket for i in (*batch, *self._queue) if i.ticket is not None]
            queued = len(self._queue)
        # Logged before the waiters are released: once they go on, the agent (or a
        # test) may read the log before this thread runs again.
        self.log_failure(
            REASON_SIDECAR_DOWN,
            "sidecar unreachable; steps go on without waiting for acknowledgement, "
            "saga spans are kept and retried with backoff",
            cause=what,
            queued=queued,
        )
        for ticket in waiting:
            resolve(ticket, REASON_SIDECAR_DOWN)  # the steps waiting on them go on now

    def count(self, reason: str, n: int = 1) -> None:
        with contextlib.suppress(Exception):  # a metrics failure must not hurt the agent
            self._counters[reason].inc(n)

    def log_failure(self, reason: str, message: str, **kw: object) -> None:
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
        self.count(REASON_ERROR)
        self.log_failure(REASON_ERROR, f"saga span processor error in {where}", error=repr(exc))


def _small(value: object) -> bool:
    if isinstance(value, (str, bytes)):
        return len(value) <= _MARKER_VALUE_BYTES
    if isinstance(value, (list, tuple)):
        return sum(len(str(v)) for v in value) <= _MARKER_VALUE_BYTES
    return True
