"""The HTTP poster: one keep-alive OTLP/HTTP connection to the sidecar.

``http.client`` rather than httpx/requests: on loopback it costs about half as
much per request, and the wait for the ack is on every compensable step's path.

Only the sender thread posts. Another thread may only shut the socket down,
which wakes a sender blocked on a slow, dripping or half-open sidecar at once:
:meth:`Poster.abort` (shutdown), and the poster's watchdog thread when a request
outlives its deadline (``timeout``, for the whole request: socket timeouts
alone never fire against a sidecar that drips a byte at a time). Nobody calls
``close()`` across threads: closing an ``http.client`` response takes the
buffered reader's lock, which the blocked sender holds until the whole answer
has dripped in (that is how an agent's exit once took 25 s).

The recovery client's calls to the sidecar's API go through it too
(:func:`request_once`), under the same whole-request deadline.
"""

from __future__ import annotations

import contextlib

# The "idna" codec, imported now, in the importing thread. Python imports it lazily at
# the process's first getaddrinfo (every connect, even to 127.0.0.1), which is the
# sender's or the heartbeat's first connection: a fork landing while that thread was
# half-way through the import left the child with "unknown encoding: idna" for life
# (every export and presence connect failed). requests imports it up front too.
import encodings.idna  # noqa: F401
import gzip
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal
from urllib.parse import urlsplit

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from saga_otel._text import printable

__all__ = [
    "MAX_PARTIAL_MESSAGE",
    "Answer",
    "Compression",
    "PartialSuccess",
    "Poster",
    "TransportSettings",
    "partial_rejections",
    "request_once",
    "retry_after",
]

Compression = Literal["none", "gzip"]


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """How to reach the sidecar: configure()'s arguments and the OTEL_EXPORTER_OTLP_* variables."""

    headers: Mapping[str, str]
    timeout: float = 5.0  # seconds, for a whole request (connect, send, answer)
    compression: Compression = "none"
    ssl_context: ssl.SSLContext | None = None  # https only; None = the system's CAs


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    retry_after: str | None
    body: bytes


# A keep-alive connection the server has closed fails on first use this way;
# one immediate retry on a fresh connection is the cure (a resent request is
# harmless: the receiver deduplicates by span id).
_STALE: Final = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class Poster:
    """One keep-alive HTTP/1.1 connection to the sidecar, used by the sender thread only."""

    def __init__(
        self,
        endpoint: str,
        settings: TransportSettings,
        content_type: str | None = "application/x-protobuf",
    ) -> None:
        parts = urlsplit(endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._headers = dict(settings.headers)
        if content_type is not None:
            self._headers["Content-Type"] = content_type
        self._gzip = settings.compression == "gzip"
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._timeout = settings.timeout
        self._ssl = settings.ssl_context
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False
        self._fresh_watch()

    def _fresh_watch(self) -> None:
        # Guards the raw socket of the request in flight, its deadline and
        # whether it passed; the watchdog thread waits on it.
        self._watch = threading.Condition()
        self._sock: socket.socket | None = None
        self._deadline: float | None = None
        self._expired = False
        self._watchdog: threading.Thread | None = None

    def post(self, body: bytes) -> Answer:
        if self._gzip:
            # Level 1: spans are small and the ack is on the step's path.
            body = gzip.compress(body, compresslevel=1, mtime=0)
        return self.send("POST", body)

    def send(self, method: str, body: bytes | None) -> Answer:
        """One request to the endpoint, answered in full within ``timeout`` or raising."""
        with self._watch:
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._watch_deadlines, name="saga-otel-export-watchdog", daemon=True
                )
                self._watchdog.start()
            self._deadline = time.monotonic() + self._timeout
            self._expired = False
        try:
            reused = self._conn is not None
            try:
                return self._once(method, body)
            except _STALE:
                if not reused or self._aborted or self._expired:
                    raise
                return self._once(method, body)
        except (OSError, http.client.HTTPException) as exc:
            if self._expired:
                raise TimeoutError(
                    f"no complete answer within {self._timeout} s (request_timeout)"
                ) from exc
            raise
        finally:
            with self._watch:
                self._deadline = None

    def _watch_deadlines(self) -> None:
        # Polls a few times per bound instead of being woken per request: a
        # wake-up per request would cost every acknowledged step a thread switch.
        with self._watch:
            while not self._aborted:
                self._watch.wait(self._timeout / 4)
                deadline = self._deadline
                if deadline is not None and time.monotonic() >= deadline:
                    self._expired = True
                    self._deadline = None
                    self._shutdown_sock()  # the sender wakes with an error

    def _connect(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(
                self._host,
                self._port,
                timeout=self._timeout,
                context=self._ssl if self._ssl is not None else ssl.create_default_context(),
            )
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        conn.connect()
        with self._watch:
            self._sock = conn.sock
            if self._aborted or self._expired:  # abort() or the deadline came meanwhile
                self._shutdown_sock()
        return conn

    def _once(self, method: str, body: bytes | None) -> Answer:
        if self._aborted:
            raise ConnectionAbortedError("the sidecar connection was aborted (shutdown)")
        if self._conn is None:
            self._conn = self._connect()
        try:
            self._conn.request(method, self._path, body=body, headers=self._headers)
            resp = self._conn.getresponse()
            data = resp.read()
        except BaseException:
            self.close()
            raise
        if resp.will_close:
            self.close()
        return Answer(resp.status, resp.getheader("retry-after"), data)

    def abort(self) -> None:
        """Wake a sender blocked on this connection; from any thread, never blocks.

        Later posts fail at once: the poster is done.
        """
        with self._watch:
            self._aborted = True
            self._shutdown_sock()
            self._watch.notify()  # the watchdog ends too

    def _shutdown_sock(self) -> None:
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection; the sender thread's own cleanup (see module docstring)."""
        conn, self._conn = self._conn, None
        with self._watch:
            self._sock = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def forget_after_fork(self) -> None:
        """Drop the parent's connection without touching it (the parent still uses it).

        Fork copied no watchdog thread: the child's first post starts its own.
        """
        self._conn = None
        self._fresh_watch()


def request_once(
    method: str,
    url: str,
    body: bytes | None,
    settings: TransportSettings,
    content_type: str | None = None,
) -> Answer:
    """One request on a connection of its own, under the exporter's whole-request
    deadline (``settings.timeout``): the recovery client's calls to the sidecar's API.

    Never resent (a fresh connection is never stale): a lease grant sent twice
    would find the lease held by its own first grant.
    """
    poster = Poster(url, settings, content_type)
    try:
        return poster.send(method, body)
    finally:
        poster.close()
        poster.abort()  # ends its watchdog thread


# The receiver's partial-success message is logged: at most this many characters of it.
MAX_PARTIAL_MESSAGE: Final = 1000


@dataclass(frozen=True, slots=True)
class PartialSuccess:
    """An OTLP 2xx answer's partial success: how many spans the receiver rejected, and
    its message (the sidecar's names the first problem and the fix), bounded to
    ``MAX_PARTIAL_MESSAGE`` characters and printable (control characters escaped):
    it comes from outside and goes into the agent's log."""

    rejected: int = 0
    message: str = ""


_ACCEPTED: Final = PartialSuccess()


def partial_rejections(body: bytes) -> PartialSuccess:
    """What an OTLP 2xx answer says was rejected (nothing if unreadable)."""
    if not body:
        return _ACCEPTED
    try:
        found = ExportTraceServiceResponse.FromString(body).partial_success
        rejected, text = max(0, int(found.rejected_spans)), str(found.error_message)
    except Exception:
        return _ACCEPTED  # a body we cannot read is not a reason to resend
    if len(text) > MAX_PARTIAL_MESSAGE:
        text = text[: MAX_PARTIAL_MESSAGE - 1] + "\u2026"
    # Escaping may lengthen it (up to 10 characters each): cut again after.
    return PartialSuccess(rejected, printable(text)[:MAX_PARTIAL_MESSAGE])


def retry_after(value: str | None, cap: float) -> float | None:
    """Seconds from a ``Retry-After`` header, capped; None when absent or unreadable."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), cap)
