"""Run ownership and recovery leases: the pure rules (no clock, no I/O).

A run belongs to the (trace id, instance) that sent its first accepted span.
Only that owner, or the holder of the run's current recovery lease, may change
it. A lease is granted to one recoverer at a time, only when the owner is not
alive (or a person forces it, with a reason), and carries a fencing token that
grows by one with every grant. The recoverer puts the token on every span it
sends (``saga.recovery.token``); intake refuses spans whose token is not the
current one, so a recoverer that lost its lease cannot record anything more.

The token stays current after a release or an expiry until the next grant: a
late span of a released holder is still the newest writer's, so it is kept.

The rules take the time (``now``) and read a lease's times on one clock, the
caller's; the stores keep it so (``_storage.Store``: SQLite moves them with a step
of the sidecar's clock, PostgreSQL judges them on the database's clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Literal

from . import _jsontext as jsontext
from ._views import LeaseView

DEFAULT_TTL_S = 30.0
MIN_TTL_S = 1.0
MAX_TTL_S = 600.0
MAX_HOLDER_CHARS = 200
MAX_REASON_CHARS = 2000

SpanRefusalReason = Literal[
    "bad_run_id", "foreign_trace", "not_owner", "stale_token", "conflicting_duplicate"
]
SPAN_REFUSAL_REASONS: tuple[SpanRefusalReason, ...] = (
    "bad_run_id",
    "foreign_trace",
    "not_owner",
    "stale_token",
    "conflicting_duplicate",
)
LeaseRefusalReason = Literal["agent_alive", "held", "not_holder", "unknown_run", "bad_request"]
LeaseAction = Literal["grant", "renew", "release"]


def when(epoch: float | None) -> str:
    """An epoch time for a message a person reads."""
    if epoch is None or not math.isfinite(epoch):
        return "never"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


@dataclass(frozen=True, slots=True)
class Owner:
    trace_id: str
    instance: str
    service: str


@dataclass(frozen=True, slots=True)
class Override:
    """A person's decision to recover behind an agent the sidecar believed alive."""

    reason: str
    by: str
    at: float


@dataclass(frozen=True, slots=True)
class Lease:
    run_id: str
    holder: str
    token: int
    granted_at: float
    expires_at: float
    released: bool = False
    override: Override | None = None  # the last forced grant on this run, kept after it

    def live(self, now: float) -> bool:
        return not self.released and now < self.expires_at

    def forced(self) -> bool:
        """Granted behind an agent the sidecar believed alive (a person's override)."""
        return self.override is not None and self.override.at == self.granted_at

    def moved(self, by: float) -> Lease:
        """The lease with its times ``by`` seconds later: read on a clock ``by`` ahead of
        the one it was kept on (a step of the sidecar's clock; a replica's clock against
        the database's). Every time moves alike, so what is compared stays so."""
        if not by:
            return self
        o = self.override
        return replace(
            self,
            granted_at=self.granted_at + by,
            expires_at=self.expires_at + by,
            override=None if o is None else replace(o, at=o.at + by),
        )


def lease_view(lease: Lease) -> LeaseView:
    o = lease.override
    return {
        "holder": lease.holder,
        "token": lease.token,
        "granted_at": lease.granted_at,
        "expires_at": lease.expires_at,
        "released": lease.released,
        "override": None if o is None else {"reason": o.reason, "by": o.by, "at": o.at},
    }


@dataclass(frozen=True, slots=True)
class Liveness:
    """Whether a run's owner may still be working on it, and when it was last heard from."""

    alive: bool
    last_heard: float | None
    window_s: float
    status: str
    # The owner spoke about the run (a span, a heartbeat naming it) while a recovery
    # lease stood on it: the latest such time, or None.
    returned: float | None = None


@dataclass(frozen=True, slots=True)
class LeaseRefusal:
    reason: LeaseRefusalReason
    message: str
    holder: str | None = None
    expires_at: float | None = None
    last_heard: float | None = None


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    holder: str
    ttl_s: float = DEFAULT_TTL_S
    force: bool = False
    reason: str | None = None
    token: int | None = None  # renew and release name the lease they hold


def parse_request(data: object, action: LeaseAction) -> LeaseRequest | LeaseRefusal:
    """A lease request from a JSON body (its bytes, or the parsed document), or why it is
    malformed."""
    shape = (
        '{"holder": "...", "ttl_s": 30, "force": false, "reason": "..."}'
        if action == "grant"
        else '{"holder": "...", "token": N' + (', "ttl_s": 30}' if action == "renew" else "}")
    )
    if isinstance(data, bytes):
        try:
            data = jsontext.loads(data)
        except ValueError as exc:  # too deep, too many digits, not JSON, not UTF-8
            # Python's advice on a long integer (raise its digit limit) is not the client's.
            why = str(exc).split("; use sys.", 1)[0]
            return _bad(f"the body is not JSON the sidecar reads ({why}): send {shape}")
    if not isinstance(data, dict):
        return _bad(f"a lease {action} needs a JSON object body: send {shape}")
    holder = data.get("holder")
    if not isinstance(holder, str) or not holder.strip() or len(holder) > MAX_HOLDER_CHARS:
        return _bad(
            f"holder={holder!r} must be a non-empty string of at most {MAX_HOLDER_CHARS} "
            f"characters naming the recovering process (e.g. host:pid): send {shape}"
        )
    ttl = data.get("ttl_s", DEFAULT_TTL_S)
    if (
        isinstance(ttl, bool)
        or not isinstance(ttl, int | float)
        or not math.isfinite(ttl)
        or not MIN_TTL_S <= ttl <= MAX_TTL_S
    ):
        return _bad(f"ttl_s={ttl!r} must be a number of seconds in {MIN_TTL_S:g}..{MAX_TTL_S:g}")
    token = data.get("token")
    if action != "grant" and (isinstance(token, bool) or not isinstance(token, int)):
        return _bad(f"token={token!r} must be the integer token the grant returned: send {shape}")
    force = data.get("force", False)
    if not isinstance(force, bool):
        return _bad(f"force={force!r} must be true or false")
    reason = data.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS):
        return _bad(f"reason must be a string of at most {MAX_REASON_CHARS} characters")
    if force and (reason is None or not reason.strip()):
        return _bad(
            "force needs a reason: say why recovering behind a live agent is right "
            '(CLI: --force --reason \'...\'; API: {"force": true, "reason": "..."})'
        )
    return LeaseRequest(
        holder=holder.strip(),
        ttl_s=float(ttl),
        force=force,
        reason=reason.strip() if isinstance(reason, str) else None,
        token=token if isinstance(token, int) else None,
    )


def _bad(message: str) -> LeaseRefusal:
    return LeaseRefusal("bad_request", message)


def grant(
    run_id: str, current: Lease | None, owner: Liveness, req: LeaseRequest, now: float
) -> Lease | LeaseRefusal:
    """Grant the run's lease to ``req.holder``, or refuse naming the holder or the live agent.

    A live lease is never overridden, not even with force: two recoverers must
    not run at once. Force overrides only the live-agent check.
    """
    if current is not None and current.live(now):
        return LeaseRefusal(
            "held",
            f"run {run_id!r} is being recovered by {current.holder!r} (lease token "
            f"{current.token}, expires {when(current.expires_at)}): wait for it to finish or "
            "for its lease to expire, then retry",
            holder=current.holder,
            expires_at=current.expires_at,
        )
    if owner.alive and not req.force:
        heard = (
            f"last heard from {when(owner.last_heard)} ({max(0.0, now - owner.last_heard):.1f}s "
            "ago)"
            if owner.last_heard is not None
            else "never heard from"
        )
        return LeaseRefusal(
            "agent_alive",
            f"run {run_id!r} is {owner.status} and its agent is alive ({heard}, within the "
            f"orphan window of {owner.window_s:g}s): recovering now would undo steps under a "
            "working agent. Wait until the sidecar marks it orphaned, or, if you know the "
            "agent is gone, override with --force --reason '...' (API: "
            '{"force": true, "reason": "..."})',
            last_heard=owner.last_heard,
        )
    override = current.override if current is not None else None
    if req.force and owner.alive:
        override = Override(req.reason or "", req.holder, now)
    return Lease(
        run_id=run_id,
        holder=req.holder,
        token=(current.token if current is not None else 0) + 1,
        granted_at=now,
        expires_at=now + req.ttl_s,
        override=override,
    )


def _check_holder(
    run_id: str, current: Lease | None, req: LeaseRequest, action: str
) -> LeaseRefusal | None:
    if current is None or current.holder != req.holder or current.token != req.token:
        held = (
            f"the current lease is held by {current.holder!r} (token {current.token})"
            if current is not None
            else "no lease was ever granted on it"
        )
        return LeaseRefusal(
            "not_holder",
            f"cannot {action} the lease on run {run_id!r} as {req.holder!r} with token "
            f"{req.token}: {held}. Stop acting on the run; take a new lease to continue",
            holder=current.holder if current is not None else None,
            expires_at=current.expires_at if current is not None else None,
        )
    return None


def renew(
    run_id: str, current: Lease | None, owner: Liveness, req: LeaseRequest, now: float
) -> Lease | LeaseRefusal:
    """Extend the holder's lease; refused once another grant took the token, and once
    the run's agent has spoken since the grant.

    An expired lease that nobody else took is still the holder's: its token is
    current, so renewing it is safe. An agent heard from after the grant was not dead
    (a long pause, a partition): it goes on with its run, so the recoverer, which
    renews before each undo, stops before the next one. Only a forced grant goes on:
    a person chose to recover behind that agent.
    """
    refusal = _check_holder(run_id, current, req, "renew")
    if refusal is not None:
        return refusal
    assert current is not None
    if current.released:
        return LeaseRefusal(
            "not_holder",
            f"the lease on run {run_id!r} (token {current.token}) was released: take a new one",
            holder=current.holder,
        )
    back = owner.returned
    if back is not None and back > current.granted_at and not current.forced():
        return LeaseRefusal(
            "agent_alive",
            f"run {run_id!r}: its agent was heard from at {when(back)}, after this lease was "
            f"granted at {when(current.granted_at)}: it is alive and goes on with the run, "
            "so no undo may run beside it. Stop and release the lease; if the agent goes "
            "quiet again the sidecar orphans the run and pages for a new recovery (if the "
            "agent must not go on, stop it, or force a new recovery with a reason)",
            holder=current.holder,
            last_heard=back,
        )
    return replace(current, expires_at=now + req.ttl_s)


def release(
    run_id: str, current: Lease | None, req: LeaseRequest, now: float
) -> Lease | LeaseRefusal:
    refusal = _check_holder(run_id, current, req, "release")
    if refusal is not None:
        return refusal
    assert current is not None
    return replace(current, released=True, expires_at=min(current.expires_at, now))


@dataclass(frozen=True, slots=True)
class SpanRefusal:
    reason: SpanRefusalReason
    message: str


def screen_span(
    run_id: str,
    owner: Owner | None,
    lease: Lease | None,
    trace_id: str,
    instance: str,
    token: object,
) -> SpanRefusal | None:
    """Whether a span of ``run_id`` from (trace, instance) carrying ``token`` may change the run.

    ``owner`` is None for a run not seen before (the span opens it). A span
    with a token must carry the run's current one and join the run's trace; a
    span without one must come from the owner.
    """
    if token is not None:
        current = lease.token if lease is not None else None
        if current is None or token != current:
            return SpanRefusal(
                "stale_token",
                f"run {run_id!r}: span carries recovery token {token!r} but the current lease "
                f"token is {current!r}: this process lost (or never held) the recovery lease; "
                "stop and take a new lease",
            )
        if owner is not None and trace_id != owner.trace_id:
            return SpanRefusal(
                "foreign_trace",
                f"run {run_id!r} belongs to trace {owner.trace_id}; a recovery joins that trace, "
                f"this span is in trace {trace_id}",
            )
        return None
    if owner is None:
        return None
    if trace_id != owner.trace_id:
        return SpanRefusal(
            "foreign_trace",
            f"run {run_id!r} belongs to trace {owner.trace_id} (instance {owner.instance}); a "
            f"span of trace {trace_id} cannot change it: give a new run a new id",
        )
    if instance != owner.instance:
        return SpanRefusal(
            "not_owner",
            f"run {run_id!r} belongs to instance {owner.instance}; instance {instance!r} holds "
            "no recovery lease on it: recover through `saga-otel recover`, which takes one",
        )
    return None
