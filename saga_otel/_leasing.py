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
from typing import Any, Literal, TypeVar
from urllib.parse import urlencode

from saga_otel import semconv as sc
from saga_otel._errors import RecoveryError
from saga_otel._transport import TransportSettings, request_once
from saga_otel.records import describe_error

DEFAULT_LEASE_TTL_S = 30.0
# The bounds the sidecar accepts for a lease's ttl_s.
MIN_LEASE_TTL_S = 1.0
MAX_LEASE_TTL_S = 600.0
T = TypeVar("T")
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

    def answer(self, reply: Reply, what: str) -> dict[str, Any]:
        """The JSON object the sidecar answered ``what`` with (an error names itself in
        ``"error"``); anything else is the `bad_answer` error. Every answer the recovery
        client reads comes through here; the caller checks the fields it reads."""
        try:
            body = json.loads(reply.body)
        except (ValueError, RecursionError):
            raise self.bad_answer(reply, what, "not JSON") from None
        if not isinstance(body, dict):
            raise self.bad_answer(reply, what, f"JSON {_json_kind(body)}, not an object")
        if reply.status != 200 and not isinstance(body.get("error"), str):
            raise self.bad_answer(reply, what, 'an error without its "error" text')
        return body

    def bad_answer(self, reply: Reply, what: str, problem: str) -> RecoveryError:
        """The error for an answer unlike the sidecar's API: most often the URL points at
        something else (its OTLP port, a proxy's login page)."""
        return RecoveryError(
            f"{reply.url} answered {what} with something that is not the sidecar's API "
            f"(HTTP {reply.status}, {problem}; it begins {reply.text[:80]!r}): point at the "
            "sidecar's API port (`saga-sidecar serve --api-port`, default 4320; 4318 is its "
            f"OTLP port): {self.flag_hint}"
        )


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return "number"


class HeldLease:
    """A lease this process holds; ``token`` goes on every span it sends for the run."""

    def __init__(
        self, api: ApiTarget, run_id: str, holder: str, token: int, ttl: float, data: dict[str, Any]
    ) -> None:
        self.api, self.run_id, self.holder, self.token, self.ttl = api, run_id, holder, token, ttl
        override = data.get("override")
        self.forced = isinstance(override, dict) and override.get("by") == holder
        self._lost: str | None = None
        self._lost_why = ""  # the sidecar's reason: agent_alive when the agent came back
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
        body = self.api.answer(resp, f"a renewal of the lease on run {self.run_id!r}")
        if resp.status != 200:
            with self._lock:
                self._lost = str(body["error"])
                self._lost_why = str(body.get("reason") or "")
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
            lost, why, taken_by = self._lost, self._lost_why, self._taken_by
        if lost is not None and why == "agent_alive":
            raise RecoveryRefusedError(
                f"run {self.run_id!r}: its agent came back while this process recovered it "
                f"(lease token {self.token}): {lost}. {stopped}; the agent goes on with its "
                "own run",
                reason="agent_alive",
            )
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
    what = f"a lease request on run {run_id!r}"
    data = api.answer(resp, what)
    if resp.status == 200:
        token = data.get("token")
        if isinstance(token, bool) or not isinstance(token, int):
            raise api.bad_answer(resp, what, f'a grant whose "token" is {token!r}, not an integer')
        return HeldLease(api, run_id, holder, token, ttl, data)
    message = str(data["error"])
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
            holder=_typed(data, "holder", str),
            expires_at=_typed(data, "expires_at", float),
            last_heard=_typed(data, "last_heard", float),
        )
    raise RecoveryError(f"the sidecar at {api.base} refused a lease on run {run_id!r}: {message}")


def _typed(data: dict[str, Any], key: str, kind: type[T]) -> T | None:
    """``data[key]`` when it is a ``kind`` (an int counts as a float), else None: a
    refusal's details are shown, never relied on."""
    value = data.get(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return value if isinstance(value, kind) else None
