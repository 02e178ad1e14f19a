"""Durable acknowledgement tickets and the engine's waits on them.

In durable mode every saga span the processor takes (heartbeats aside) gets a
ticket: a ``concurrent.futures.Future`` that resolves when the sidecar answered
2xx for the request that carried it and did not report it rejected (result None)
or when the span was lost (result: the reason; a span replaced by a marker, once
the marker was answered). The engine waits with :func:`wait_for_ack` /
:func:`wait_for_ack_async`, bounded by the owning processor's ``ack_timeout``.
Tickets are kept by span id in :data:`saga_otel._state.STATE` because the
engine asks by span, not by processor.

Counting rule, one increment per event: ``timeout`` counts durable waits that
passed their bound (the span may still arrive later); ``sidecar_down`` counts
steps that went on unacknowledged without waiting because the sidecar was known
to be down (the processor's circuit was open; the span is kept and retried); ``queue_full``,
``rejected`` (a 4xx other than 429, or a span a 2xx answer's partial
success reported rejected), ``too_large`` (a span over the sidecar's or the local size bound,
replaced by a marker span), and ``error`` (encoding failure, spans still unsent
at shutdown, a hook error) count spans lost. A wait that finds its span already
lost logs but does not count it a second time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Final, Protocol

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan

from saga_otel._frozen import fast_init
from saga_otel._state import MAX_FAILED_TICKETS, STATE

__all__ = [
    "REASONS",
    "REASON_ERROR",
    "REASON_QUEUE_FULL",
    "REASON_REJECTED",
    "REASON_SIDECAR_DOWN",
    "REASON_TIMEOUT",
    "REASON_TOO_LARGE",
    "Ticket",
    "TicketOwner",
    "forget",
    "new_ticket",
    "resolve",
    "wait_for_ack",
    "wait_for_ack_async",
]

REASON_TIMEOUT: Final = "timeout"
REASON_ERROR: Final = "error"
REASON_QUEUE_FULL: Final = "queue_full"
REASON_REJECTED: Final = "rejected"
REASON_TOO_LARGE: Final = "too_large"
REASON_SIDECAR_DOWN: Final = "sidecar_down"
REASONS: Final = (
    REASON_TIMEOUT,
    REASON_SIDECAR_DOWN,
    REASON_ERROR,
    REASON_QUEUE_FULL,
    REASON_REJECTED,
    REASON_TOO_LARGE,
)


class TicketOwner(Protocol):
    """The processor that took the span: its bound, its counter and its log."""

    @property
    def ack_timeout(self) -> float: ...

    def count(self, reason: str, n: int = 1) -> None: ...

    def log_failure(self, reason: str, message: str, **kw: object) -> None: ...


@fast_init
@dataclass(frozen=True, slots=True)
class Ticket:
    """One durable span awaiting its acknowledgement.

    The future is marked running at creation so that an asyncio wrapper
    cancelled by ``wait_for`` cannot cancel it under the sender.
    """

    span_id: int
    future: concurrent.futures.Future[str | None]
    owner: TicketOwner

    def lost_in_child(self) -> Ticket:
        """A copy already resolved as lost, for a forked child (see ``ProcessState``).

        A fresh future: the parent's may have had its internal lock held by the
        parent's sender thread at fork time.
        """
        return Ticket(self.span_id, _running_future(REASON_ERROR), self.owner)


def _running_future(
    result: str | None = None, *, done: bool = True
) -> concurrent.futures.Future[str | None]:
    fut: concurrent.futures.Future[str | None] = concurrent.futures.Future()
    fut.set_running_or_notify_cancel()
    if done:
        fut.set_result(result)
    return fut


def new_ticket(span_id: int, owner: TicketOwner) -> Ticket:
    ticket = Ticket(span_id, _running_future(done=False), owner)
    with STATE.tickets_lock:
        STATE.tickets[span_id] = ticket
    return ticket


def resolve(ticket: Ticket, reason: str | None) -> None:
    """Resolve ``ticket``: None = acknowledged, else the reason the span was lost."""
    try:
        ticket.future.set_result(reason)
    except concurrent.futures.InvalidStateError:
        return  # already resolved (shutdown raced the sender); first answer stands
    state = STATE
    with state.tickets_lock:
        if state.tickets.get(ticket.span_id) is not ticket:
            return  # already waited for
        if reason is None:
            del state.tickets[ticket.span_id]
            return
        state.failed_order.append(ticket.span_id)
        while len(state.failed_order) > MAX_FAILED_TICKETS:
            old = state.failed_order.popleft()
            stale = state.tickets.get(old)
            if stale is not None and stale.future.done():
                del state.tickets[old]


def _span_id_of(span: object) -> int | None:
    get = getattr(span, "get_span_context", None)
    if get is None:
        return None
    ctx = get()
    return None if ctx is None else int(ctx.span_id)


def _take_ticket(span: object) -> Ticket | None:
    try:
        span_id = _span_id_of(span)
    except Exception:
        return None
    if span_id is None:
        return None
    with STATE.tickets_lock:
        found = STATE.tickets.get(span_id)
    return found if isinstance(found, Ticket) else None


def forget(ticket: Ticket) -> None:
    with STATE.tickets_lock:
        if STATE.tickets.get(ticket.span_id) is ticket:
            del STATE.tickets[ticket.span_id]


def _judge(ticket: Ticket, reason: str | None, span: object) -> bool:
    """Log/count the outcome of a durable wait; True when acknowledged."""
    forget(ticket)
    if reason is None:
        return True
    owner = ticket.owner
    if reason == REASON_SIDECAR_DOWN:
        # The outage was logged once when the circuit opened; a line per step
        # would bury it. The counter says how many steps went on unacknowledged.
        owner.count(REASON_SIDECAR_DOWN)
        return False
    if reason == REASON_TIMEOUT:
        owner.count(REASON_TIMEOUT)
    # Other reasons were counted when the span was lost; log the step's view only.
    owner.log_failure(
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
        future = ticket.future
        if future.done():  # answered before we asked: no wrapper, no loop round trip
            return _judge(ticket, future.result(), span)
        try:
            # asyncio.timeout rather than wait_for: no extra waiter future per step.
            async with asyncio.timeout(ticket.owner.ack_timeout):
                reason = await asyncio.wrap_future(future)
        except TimeoutError:
            reason = REASON_TIMEOUT
        return _judge(ticket, reason, span)
    except asyncio.CancelledError:
        forget(ticket)
        raise  # the caller's own cancellation is not ours to swallow
    except Exception:
        return False
