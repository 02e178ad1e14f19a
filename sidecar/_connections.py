"""How many connections each port holds at once: the cap, and how it is kept.

Without a cap a peer that opens connections and says nothing fills the process's
descriptor table: then accept() fails with EMFILE on every port (asyncio stops
accepting on it for a second at a time), grpc cannot accept either, and the
database cannot open a file, so agents' exports fail though their own connections
were never the problem. Each of the three ports holds at most ``connection_cap()``
connections, so three full ports and what the sidecar keeps open for itself fit in
the descriptor limit.

aiohttp has no setting for it, so the HTTP ports' listeners are built here
(``CappedSite``: aiohttp's ``TCPSite`` with the runner's protocol factory wrapped):
past the cap a new connection is closed as it is accepted, which frees its
descriptor at once, never blocks the accept loop and never queues it unanswered.
grpc has its own (``grpc.max_allowed_incoming_connections``, the same number: see
``_grpc.server_options``). Time bounds are not kept here: a connection that holds a
place is closed by --keepalive-timeout when it sends no request, and its body by
--body-timeout.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ._log import get_logger

log = get_logger("sidecar")

# Descriptors the sidecar keeps open beside its connections: the database files and
# lock, the loop's and grpc's own, a PostgreSQL pool, the forward and alert clients'
# connections, the log (24 at the start of a SQLite sidecar; a margin on top).
FD_RESERVE = 128
PORTS = 3  # OTLP/HTTP, OTLP/gRPC, API: each may be full at once
REFUSED_LOG_INTERVAL = 60.0  # seconds between two warnings of refused connections


def fd_limit() -> int:
    """The descriptors this process may open (its soft RLIMIT_NOFILE)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 2**31 - 1


def connection_cap(wanted: int, limit: int) -> int:
    """The connections each port may hold: ``wanted`` (--max-connections), or fewer when
    three full ports plus FD_RESERVE would pass the descriptor ``limit``; never 0."""
    return max(1, min(wanted, (limit - FD_RESERVE) // PORTS))


class _Refused(asyncio.Protocol):
    """A connection past the cap: closed as soon as it is made (its descriptor goes)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Counted(asyncio.Protocol):
    """The server's own protocol for one connection, counted until it is lost.

    Only the two ends are wrapped; data, EOF and flow control go straight to the
    server's protocol (bound methods set once, no call in between).
    """

    def __init__(self, inner: asyncio.Protocol, cap: _Cap) -> None:
        self._inner = inner
        self._cap = cap
        self.data_received = inner.data_received  # type: ignore[method-assign]
        self.eof_received = inner.eof_received  # type: ignore[method-assign]
        self.pause_writing = inner.pause_writing  # type: ignore[method-assign]
        self.resume_writing = inner.resume_writing  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cap.open -= 1
        self._inner.connection_lost(exc)


class _Cap:
    """One port's protocol factory (what ``loop.create_server`` calls for each accepted
    connection): the server's own while fewer than ``limit`` connections are open, else
    ``_Refused``, each counted by ``refused`` (the port's metric) and in a warning at most
    once a REFUSED_LOG_INTERVAL."""

    def __init__(
        self, factory: Callable[[], Any], limit: int, port: str, refused: Callable[[], None]
    ) -> None:
        self._factory = factory
        self.limit = limit
        self.port = port
        self._count_refused = refused
        self.open = 0
        self._refused = 0
        self._warned_at = -REFUSED_LOG_INTERVAL

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            self._count_refused()
            self._refused += 1
            now = time.monotonic()
            if now - self._warned_at >= REFUSED_LOG_INTERVAL:
                self._warned_at = now
                log.warning(
                    "sidecar.connections.refused",
                    port=self.port,
                    max_connections=self.limit,
                    refused=self._refused,
                    fix="a peer that sends nothing is closed after --keepalive-timeout; if "
                    "the port's own clients need more, raise --max-connections (and the "
                    "descriptor limit, ulimit -n / LimitNOFILE, which lowers it)",
                )
                self._refused = 0
            return _Refused()
        self.open += 1
        return _Counted(self._factory(), self)


class CappedSite(web.BaseSite):
    """aiohttp's ``TCPSite`` (same listener options) holding at most ``limit``
    connections: the runner's protocol factory is wrapped in ``_Cap``; ``refused`` is
    called for each connection turned away."""

    __slots__ = ("_host", "_limit", "_port", "_port_name", "_refused")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        limit: int,
        name: str,
        refused: Callable[[], None],
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._limit = limit
        self._port_name = name
        self._refused = refused

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # BaseSite() refuses a runner not set up
        cap = _Cap(server, self._limit, self._port_name, self._refused)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            cap, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
