"""Settings of one sidecar: plain values, validated once, before anything binds."""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ._errors import ConfigError
from ._storage import DbTarget, parse_db, redact_url

DEFAULT_HOST = "127.0.0.1"
DEFAULT_OTLP_HTTP_PORT = 4318
DEFAULT_OTLP_GRPC_PORT = 4317
DEFAULT_API_PORT = 4320
DEFAULT_MAX_BODY = 16 * 1024 * 1024
DEFAULT_IDLE_TIMEOUT = 60.0
DEFAULT_RETENTION = 7 * 24 * 3600.0
DEFAULT_MAX_IN_FLIGHT = 64
DEFAULT_FORWARD_QUEUE = 1024
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_BODY_MIN_RATE = 16 * 1024
DEFAULT_MAX_RECEIVING = 1024
# A connection that has sent no whole request head for this long, since it opened or
# since its last answer, is closed: idle, or its request line and headers trickling.
# Every client of the sidecar sends its head at once; a pooled one reconnects after a
# pause (cheap on loopback or a LAN). Twice an OpenTelemetry SDK's 5 s export cadence,
# so a busy exporter's connection is never closed under it. Behind a proxy that keeps
# idle upstream connections longer (60 s is common), set it above the proxy's.
DEFAULT_KEEPALIVE_TIMEOUT = 10.0
# Connections each port holds at once, unless told (max_connections None). Above what the
# other bounds admit on the OTLP port (max_presence + --max-receiving + --max-in-flight:
# 11,088), so those answer first; three full ports take 49,152 descriptors, within the
# 65,536 servers are commonly given (LimitNOFILE). A lower descriptor limit lowers it
# (_connections.connection_cap).
DEFAULT_MAX_CONNECTIONS = 16384
# /readyz answers 503 while a request has waited longer than this for its commit: the
# SagaSidecarIntakeStalled rule's threshold (alerts/saga-rules.yml), so a replica leaves
# rotation when the alert starts counting.
DEFAULT_READY_STALL = 5.0
# Seconds a body may take before --body-min-rate applies (slow starts are normal).
BODY_RATE_GRACE = 2.0
# Seconds aiohttp drains an unread body after answering (e.g. 401) before it closes.
LINGERING_TIME = 2.0
ENV_PREFIX = "SAGA_SIDECAR_"


def default_db_path() -> Path:
    """``$XDG_STATE_HOME/saga-sidecar/sidecar.db``, else under ``~/.local/state``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "saga-sidecar" / "sidecar.db"


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str | float, what: str) -> float:
    """Seconds from ``90``, ``1.5``, ``250ms``, ``30s``, ``10m``, ``12h`` or ``7d``."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _DURATION.match(text)
        if not match:
            raise ConfigError(
                f"{what} {text!r} is not a duration: write seconds (e.g. 60) or a number "
                "with ms, s, m, h or d (e.g. 7d)"
            )
        value = float(match.group(1)) * _UNITS[match.group(2)]
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be positive: use e.g. 60s")
    return value


_SIZE = re.compile(r"^\s*(\d+)\s*(b|kib|kb|mib|mb|gib|gb)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    None: 1,
    "b": 1,
    "kb": 1000,
    "kib": 1024,
    "mb": 1000**2,
    "mib": 1024**2,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_size(text: str | int, what: str) -> int:
    """Bytes from ``16777216``, ``16MiB``, ``512KiB``."""
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(text)
        if not match:
            raise ConfigError(
                f"{what} {text!r} is not a size: write bytes (e.g. 16777216) or e.g. 16MiB"
            )
        unit = match.group(2).lower() if match.group(2) else None
        value = int(match.group(1)) * _SIZE_UNITS[unit]
    if value <= 0:
        raise ConfigError(f"{what} {text!r} must be positive: use e.g. 16MiB")
    return value


def http_url(host: str, port: int) -> str:
    """``http://host:port`` for a bound address; a wildcard bind names this machine."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()  # links leave this machine: a name people can reach
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``saga-sidecar serve`` can be told. Ports 0 bind ephemeral ports."""

    host: str = DEFAULT_HOST
    otlp_http_port: int = DEFAULT_OTLP_HTTP_PORT
    otlp_grpc_port: int = DEFAULT_OTLP_GRPC_PORT
    api_port: int = DEFAULT_API_PORT
    db_path: Path | None = None  # SQLite
    db_url: str | None = None  # PostgreSQL (postgresql://...); at most one of the two
    token: str | None = None
    forward: str | None = None
    forward_queue: int = DEFAULT_FORWARD_QUEUE
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    retention: float = DEFAULT_RETENTION
    max_body: int = DEFAULT_MAX_BODY
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    tick_interval: float = 0.2
    prune_interval: float = 60.0
    # Finished runs leave memory (the store serves them) this long after they finish at
    # most: memory holds the open runs plus this interval's finished ones.
    evict_interval: float = 10.0
    # Slow clients: a request body must arrive whole within body_timeout, and after its
    # first BODY_RATE_GRACE seconds at body_min_rate bytes/s on average; max_receiving
    # requests may be receiving their bodies at once (they hold no max_in_flight slot).
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    body_min_rate: int = DEFAULT_BODY_MIN_RATE
    max_receiving: int = DEFAULT_MAX_RECEIVING
    # Agent processes holding a live presence connection at once (one each).
    max_presence: int = 10_000
    # Every connection on the HTTP ports must send a whole request head within
    # keepalive_timeout of opening or of its last answer (gRPC: its HTTP/2 preface);
    # each port holds at most max_connections at once and closes the next on arrival
    # (None: DEFAULT_MAX_CONNECTIONS, silently fewer to fit the descriptor limit).
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    max_connections: int | None = None
    # GET /readyz: not ready while the oldest request has waited longer than this for
    # its database commit (sidecar/_ready.py).
    ready_stall: float = DEFAULT_READY_STALL

    def __post_init__(self) -> None:
        self.validate()

    @property
    def resolved_db_path(self) -> Path:
        """The SQLite file (the default one when PostgreSQL is chosen: unused then)."""
        return self.db_path if self.db_path is not None else default_db_path()

    @property
    def database(self) -> DbTarget:
        """Where the state lives: ``db_url`` (PostgreSQL) or the SQLite file."""
        if self.db_url is not None:
            return parse_db(self.db_url)
        return DbTarget("sqlite", path=self.resolved_db_path)

    def __repr__(self) -> str:  # the URL may carry a password: never print it
        shown = ", ".join(
            f"{f}={self.database.shown!r}"
            if f == "db_url" and self.db_url
            else f"{f}={getattr(self, f)!r}"
            for f in self.__dataclass_fields__
            if f != "token"
        )
        return f"Settings({shown})"

    def validate(self) -> None:
        for name in ("otlp_http_port", "otlp_grpc_port", "api_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name}={port} is not a TCP port: use 0..65535 (0 = any free)")
        if self.db_url is not None:
            if self.db_path is not None:
                raise ConfigError(
                    "give the database once: db_path (SQLite) or db_url (PostgreSQL), not both"
                )
            if parse_db(self.db_url).backend != "postgresql":
                raise ConfigError(
                    f"db_url {redact_url(self.db_url)!r} is not a PostgreSQL URL: use "
                    "postgresql://USER@HOST:PORT/DB, or db_path for a SQLite file"
                )
        if not is_loopback(self.host) and not self.token:
            raise ConfigError(
                f"refusing to listen on non-loopback host {self.host!r} without a token: "
                "anyone who can reach it could read and resolve runs. Set --token "
                "(SAGA_SIDECAR_TOKEN) or bind 127.0.0.1"
            )
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ConfigError(
                "the token is empty or contains whitespace: use a random string such as "
                "the output of `openssl rand -hex 32`"
            )
        if self.forward is not None and not self.forward.startswith(("http://", "https://")):
            raise ConfigError(
                f"--forward {self.forward!r} is not an http(s) URL: use e.g. "
                "http://collector:4318/v1/traces"
            )
        for name in (
            "forward_queue",
            "max_body",
            "max_in_flight",
            "body_min_rate",
            "max_receiving",
            "max_presence",
            "max_connections",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in (
            "idle_timeout",
            "retention",
            "tick_interval",
            "prune_interval",
            "evict_interval",
            "body_timeout",
            "keepalive_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0 seconds")
        # nan compares false with everything (a `<= 0` check lets it through), and with
        # it /readyz would answer ready through any stall; inf would too.
        if not 0 < self.ready_stall < math.inf:
            raise ConfigError(
                f"ready_stall={self.ready_stall} (--ready-stall) must be a finite number of "
                f"seconds > 0: use e.g. {DEFAULT_READY_STALL:g}s, the SagaSidecarIntakeStalled "
                "rule's threshold"
            )
