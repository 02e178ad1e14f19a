"""What the transports need of the service, as a protocol in a leaf module.

The HTTP and gRPC transports reach the :class:`~sidecar._server.Sidecar` only
through :class:`Service`, and aiohttp apps carry it under :data:`SERVICE`, so
``_server`` imports the transports and nothing imports ``_server`` back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from ._leases import Lease, LeaseAction, LeaseRefusal
from ._metrics import SidecarMetrics
from ._otlp import Decoded
from ._redact import Redactor
from ._settings import Settings
from ._state import RunState
from ._storage import DbTarget, RunQuery
from ._views import RunSummary, RunView


class Service(Protocol):
    """The intake and API side of the sidecar, as its transports see it."""

    @property
    def settings(self) -> Settings: ...

    @property
    def metrics(self) -> SidecarMetrics: ...

    @property
    def state(self) -> RunState: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def failed_tasks(self) -> list[str]:
        """Background tasks that ended by an error since start (``/healthz``: 503)."""
        ...

    @property
    def redactor(self) -> Redactor:
        """The masks on API views (install_alerting sets the configured ones)."""
        ...

    @property
    def api_routes(self) -> list[web.AbstractRouteDef]: ...

    # What the run page and review queue (_pages.py) show and link to.
    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def database(self) -> DbTarget:
        """Where the state and the alert outbox live (SQLite file or PostgreSQL)."""
        ...

    @property
    def otlp_http_port(self) -> int | None:
        """The OTLP/HTTP port actually bound; None before start()."""
        ...

    @property
    def api_port(self) -> int | None:
        """The API port actually bound; None before start()."""
        ...

    @property
    def public_url(self) -> str | None:
        """``--public-url``, the API as people reach it (install_alerting sets it); None:
        the bound address. The pages' commands name it, and the Host check answers it."""
        ...

    async def lookup(self, run_id: str) -> RunState:
        """The state that knows ``run_id`` (ours, or one read from the store for a finished
        run put away). Raises StoreError (answer 503)."""
        ...

    async def runs_page(
        self, query: RunQuery, limit: int, *, needs_person: bool = False
    ) -> tuple[list[tuple[RunSummary, RunView | None]], bool]:
        """A page of runs (memory and store), newest first, with views; whether more follow."""
        ...

    def enter(self) -> bool:
        """Take an in-flight slot; False when the service is at its bound (answer 429)."""
        ...

    def leave(self) -> None: ...

    def oldest_waiting(self, now: float) -> float:
        """When the oldest request still waiting for its commit arrived (``now``: none)."""
        ...

    async def ingest(
        self, decoded: Decoded, transport: str, body: bytes | None = None, content_type: str = ""
    ) -> Decoded:
        """Screen, store, fold and announce one request's spans. Raises StoreError (503).

        Returns ``decoded`` less the spans the ownership, fencing and run id rules
        refused (counted in its ``rejected`` and ``errors``): answer with those.
        """
        ...

    def presence_opened(self, instance: str) -> bool:
        """An agent process opened its live connection; False at the bound (answer 429)."""
        ...

    def presence_closed(self, instance: str, clean: bool) -> None:
        """Its live connection closed, with a goodbye (``clean``) or not."""
        ...

    async def resolve(
        self, run_id: str, note: str, *, first: bool = False, by: str | None = None
    ) -> RunView | None:
        """Record a resolution (``by``: who, as they named themselves, or None); with
        ``first`` a resolved run keeps its note and ``by`` (view unchanged)."""
        ...

    async def lease(self, run_id: str, action: LeaseAction, data: object) -> Lease | LeaseRefusal:
        """Grant, renew or release a run's recovery lease (``data``: the request body's
        bytes, parsed by the lease rules, or the parsed document).

        Raises StoreError (answer 503).
        """
        ...


SERVICE = web.AppKey("service", Service)
"""Where an aiohttp app of the sidecar keeps its :class:`Service`."""

BODY = web.RequestKey("body", bytes)
"""Where an API request's body waits for its handler: the API port reads every body
before any handler, bounded as the OTLP port reads its own (``_http._api_bodies``), so
a handler takes it from here, never from ``request.read()``, ``json()`` or ``post()``
(which find the body read). Absent when the request has none."""
