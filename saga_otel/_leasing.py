"""The recoverer's side of a recovery lease: take it, keep it renewed, give it back.

The sidecar decides (``sidecar/_leases.py``); this only asks and remembers. A
background thread renews at a third of the lease's time to live, and
:meth:`HeldLease.check` renews in the foreground before each undo, so an undo
never starts on a lease that another recoverer may already hold.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlencode

from saga_otel import semconv as sc
from saga_otel._errors import RecoveryError
from saga_otel._transport import TransportSettings, request_once
from saga_otel.records import describe_error

DEFAULT_LEASE_TTL_S = 30.0
# The bounds the sidecar accepts for a lease's ttl_s.
MIN_LEASE_TTL_S = 1.0
MAX_LEASE_TTL_S = 600.0
# Seconds for each whole request to the sidecar's API (connect, send, the full answer):
# a per-read timeout never fires against an answer that drips in a byte at a time.
REQUEST_TIMEOUT_S = 10.0


class RecoveryRefusedError(RecoveryError):
    """The sidecar refused the recovery lease: the run's agent is alive, or another
    recoverer holds the lease (or took it over). Nothing was undone by this call."""

    def __init__(
        self,
        message: str,
        *,
        reason: str,
        holder: str | None = None,
        expires_at: float | None = None,
        last_heard: float | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.holder = holder
        self.expires_at = expires_at
        self.last_heard = last_heard


def default_holder() -> str:
    """A name for this recovering process that a person can find: host, pid, instance."""
    from saga_otel._config import instance_id

    return f"{socket.gethostname()}:{os.getpid()}:{instance_id()}"


@dataclass(frozen=True, slots=True)
class Reply:
    """The sidecar's answer to one request."""

    url: str
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class ApiTarget:
    base: str
    headers: dict[str, str]
    flag_hint: str  # how to point at the sidecar, worded for the caller (CLI or Python)

    def url(self, run_id: str, suffix: str = "") -> str:
        return f"{self.base}/runs/{sc.run_id_segment(run_id)}{suffix}"

    def call(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str | int] | None = None,
        body: dict[str, Any] | None = None,
    ) -> Reply:
        """One request to the sidecar's API, answered in full within REQUEST_TIMEOUT_S.

        Every call of the recovery client goes through here: an unreachable or
        stalled sidecar is one `RecoveryError` saying how to start it or point at it.
        """
        if params:
            url = f"{url}?{urlencode(params)}"
        settings = TransportSettings(
            headers={**self.headers, "Accept": "application/json"}, timeout=REQUEST_TIMEOUT_S
        )
        data = None if body is None else json.dumps(body).encode()
        try:
            answer = request_once(
                method, url, data, settings, None if body is None else "application/json"
            )
        except TimeoutError as exc:
            raise RecoveryError(
                f"the sidecar at {self.base} did not answer {method} {url} in full within "
                f"{REQUEST_TIMEOUT_S:g} s (the deadline of a whole request): retry once it is "
                f"less loaded; if what listens there is not the sidecar's API, {self.flag_hint}"
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            raise RecoveryError(
                f"cannot reach the sidecar at {self.base} ({describe_error(exc)}); start "
                f"it with `saga-sidecar serve` or {self.flag_hint}"
            ) from exc
        return Reply(url, answer.status, answer.body)

    def post(self, run_id: str, suffix: str, body: dict[str, Any]) -> Reply:
        return self.call("POST", self.url(run_id, suffix), body=body)


def _answer(resp: Reply) -> dict[str, Any]:
    try:
        body = json.loads(resp.body)
    except ValueError:
        body = {"error": resp.text[:300]}
    return body if isinstance(body, dict) else {"error": str(body)[:300]}


class HeldLease:
    """A lease this process holds; ``token`` goes on every span it sends for the run."""

    def __init__(
        self, api: ApiTarget, run_id: str, holder: str, token: int, ttl: float, data: dict[str, Any]
    ) -> None:
        self.api, self.run_id, self.holder, self.token, self.ttl = api, run_id, holder, token, ttl
        self.forced = bool(data.get("override")) and data["override"].get("by") == holder
        self._lost: str | None = None
        self._taken_by: str | None = None  # who holds the lease now, when the sidecar says
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._renew_loop, name="saga-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        resp = self.api.post(
            self.run_id,
            "/lease/renew",
            {"holder": self.holder, "token": self.token, "ttl_s": self.ttl},
        )
        if resp.status != 200:
            body = _answer(resp)
            with self._lock:
                self._lost = str(body.get("error") or f"HTTP {resp.status}")
                holder = body.get("holder")
                self._taken_by = holder if isinstance(holder, str) else None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._renew()
            except RecoveryError:
                continue  # the foreground check reports it if it lasts
            if self._lost:
                return

    def check(self, stopped: str = "Stopped before the next undo") -> None:
        """Renew now; raise RecoveryRefusedError when the lease is no longer ours.

        ``stopped`` says where the recovery stops, for the person reading the error.
        """
        if self._lost is None:
            self._renew()
        with self._lock:
            lost, taken_by = self._lost, self._taken_by
        if lost is not None:
            raise RecoveryRefusedError(
                f"run {self.run_id!r}: this process lost its recovery lease (token "
                f"{self.token}): {lost}. {stopped}; whoever holds the lease now continues "
                "from what the sidecar acknowledged",
                reason="lease_lost",
                holder=taken_by,
            )

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        with contextlib.suppress(RecoveryError):  # unreleased, it expires by itself
            self.api.post(
                self.run_id, "/lease/release", {"holder": self.holder, "token": self.token}
            )


def take_lease(
    api: ApiTarget,
    run_id: str,
    *,
    holder: str,
    ttl: float,
    force: bool,
    reason: str | None,
    force_hint: str,
) -> HeldLease:
    body: dict[str, Any] = {"holder": holder, "ttl_s": ttl}
    if force:
        body.update(force=True, reason=reason)
    resp = api.post(run_id, "/lease", body)
    data = _answer(resp)
    if resp.status == 200:
        return HeldLease(api, run_id, holder, int(data["token"]), ttl, data)
    message = str(data.get("error") or f"HTTP {resp.status}")
    kind: Literal["agent_alive", "held"] | str = str(data.get("reason") or "")
    if resp.status == 409 and kind in ("agent_alive", "held"):
        if kind == "agent_alive":
            # The sidecar words its hint for both; name the caller's own way to force.
            message = message.split(" Wait until", 1)[0] + (
                ". Wait until the sidecar marks the run orphaned, or, if you know the agent is "
                f"gone, override with {force_hint}"
            )
        raise RecoveryRefusedError(
            f"recovery refused: {message}",
            reason=kind,
            holder=data.get("holder"),
            expires_at=data.get("expires_at"),
            last_heard=data.get("last_heard"),
        )
    raise RecoveryError(f"the sidecar at {api.base} refused a lease on run {run_id!r}: {message}")
