"""The presence stream: one live connection to the sidecar per agent process.

While runs are open, the heartbeat thread keeps an HTTP request to the sidecar
open (``POST /v1/saga/presence``, a chunked body that never ends: a hello line
naming the process's ``service.instance.id``, then a line per heartbeat). When
the process dies, SIGKILL included, the kernel closes the connection and the
sidecar sees it at once; it confirms with the heartbeats (no reconnect, no
heartbeat within half a second) and pages the open runs orphaned within about a
second instead of three heartbeat intervals. A clean shutdown says ``bye``
first. Heartbeats stay the rule for host death and for SDKs without this
stream (docs/semantic-conventions.md, "Presence").

Only the heartbeat thread uses a Presence; telemetry never breaks the agent, so
every failure here is retried at a later beat with backoff (network failures
swallowed, anything else counted and logged by the heartbeat).
"""

from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401  # before any thread connects: see _transport
import json
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Final
from urllib.parse import urlsplit

from saga_otel import semconv as sc
from saga_otel._logging import Logger
from saga_otel._transport import TransportSettings
from saga_otel.records import backoff_seconds

__all__ = ["PRESENCE_PATH", "Presence", "presence_url"]

PRESENCE_PATH: Final = "/v1/saga/presence"
_TRACES_PATH: Final = "/v1/traces"
_IO_TIMEOUT: Final = 1.0  # connect and each send: a beat never waits long on the sidecar


def presence_url(traces_endpoint: str) -> str:
    """The presence URL beside an OTLP/HTTP traces URL (same scheme, host, port, prefix)."""
    parts = urlsplit(traces_endpoint)
    path = parts.path
    prefix = path[: -len(_TRACES_PATH)] if path.endswith(_TRACES_PATH) else ""
    return f"{parts.scheme}://{parts.netloc}{prefix}{PRESENCE_PATH}"


class Presence:
    """The live connection; :meth:`beat` once per heartbeat, :meth:`close` at shutdown."""

    def __init__(
        self,
        traces_endpoint: str | Sequence[str],
        settings: TransportSettings,
        instance: Callable[[], str],
        logger: Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Several (sidecar replicas): one connection, to the next one when it fails.
        endpoints = [traces_endpoint] if isinstance(traces_endpoint, str) else traces_endpoint
        self._urls = [presence_url(e) for e in endpoints]
        self._next_url = 0
        self._use(self._urls[0])
        self._headers = dict(settings.headers)
        self._ssl = settings.ssl_context
        self._instance = instance
        self._log = logger
        self._clock = clock
        self._sock: socket.socket | None = None
        self._disabled = False
        self._failures = 0
        self._next_try = 0.0

    def _use(self, url: str) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._path = parts.path

    def beat(self) -> None:
        """Open the connection if it is not, else keep it alive.

        A failure is retried at a later beat, with backoff. A network failure is
        swallowed; anything else is raised after the same backoff is set, for the
        heartbeat to count and log (at most once a backoff, not once a beat).
        """
        if self._disabled:
            return
        try:
            if self._sock is not None and self._answered():
                self._drop()
            if self._sock is None:
                if self._clock() < self._next_try:
                    return
                self._open()
            else:
                self._chunk(b"beat\n")
            self._failures = 0
        except Exception as exc:
            self._drop()
            if len(self._urls) > 1:  # that replica failed: the next one, after the backoff
                self._next_url = (self._next_url + 1) % len(self._urls)
                self._use(self._urls[self._next_url])
            self._failures += 1
            self._next_try = self._clock() + backoff_seconds(
                self._failures, initial=0.5, maximum=30.0
            )
            if not isinstance(exc, OSError | ValueError):
                raise

    def close(self) -> None:
        """Say goodbye (a clean shutdown, not a death) and close. Never raises."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        with contextlib.suppress(OSError, ValueError):
            sock.sendall(_chunk(b"bye\n") + b"0\r\n\r\n")
        with contextlib.suppress(OSError):
            sock.close()

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copy of the descriptor only (close(),
        never shutdown(): the parent's connection stays up, and the parent's death still
        closes it); the child opens its own, under its own instance id, at its first beat."""
        self._drop()

    def _open(self) -> None:
        raw = socket.create_connection((self._host, self._port), timeout=_IO_TIMEOUT)
        sock: socket.socket = raw
        try:
            if self._https:
                context = self._ssl if self._ssl is not None else ssl.create_default_context()
                sock = context.wrap_socket(raw, server_hostname=self._host)
            host = self._host if ":" not in self._host else f"[{self._host}]"
            head = [
                f"POST {self._path} HTTP/1.1",
                f"Host: {host}:{self._port}",
                "Content-Type: application/x-ndjson",
                "Transfer-Encoding: chunked",
                *(f"{k}: {v}" for k, v in self._headers.items()),
            ]
            hello = json.dumps({"instance": self._instance()}).encode() + b"\n"
            sock.sendall("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + _chunk(hello))
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        self._sock = sock

    def _chunk(self, data: bytes) -> None:
        assert self._sock is not None
        self._sock.sendall(_chunk(data))

    def _answered(self) -> bool:
        """The sidecar answers only to end the stream: a refusal, or it went away."""
        sock = self._sock
        assert sock is not None
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        try:
            answer = sock.recv(512)
        except (OSError, ValueError):
            return True
        status = answer[9:12]
        if status in (b"404", b"405", b"401", b"403", b"400"):
            # An older sidecar without this route, or one that refuses us: heartbeats
            # alone watch this process (as for any other SDK). Said once.
            self._disabled = True
            with contextlib.suppress(Exception):
                self._log.warning(
                    sc.EV_EXPORT_FAILED,
                    reason="presence_refused",
                    status=status.decode("ascii", "replace"),
                    message="the sidecar refused the presence stream; process death is "
                    "noticed by missed heartbeats only",
                )
        return True

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
