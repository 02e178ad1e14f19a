"""saga-sidecar: watches saga runs from outside the agent, over OTLP.

Receives the saga span contract (``docs/semantic-conventions.md``) on OTLP/HTTP
and OTLP/gRPC, keeps every run's state and compensation stack in SQLite, and
serves them on a JSON API. See ``docs/sidecar.md``.
"""

from __future__ import annotations

from ._errors import ApiError, ConfigError, DecodeError, SidecarError, StoreError
from ._otlp import SpanEvent, SpanRecord
from ._render import render_run
from ._server import Listener, Sidecar
from ._settings import Settings
from ._state import RunState, Transition

__all__ = [
    "ApiError",
    "ConfigError",
    "DecodeError",
    "Listener",
    "RunState",
    "Settings",
    "Sidecar",
    "SidecarError",
    "SpanEvent",
    "SpanRecord",
    "StoreError",
    "Transition",
    "render_run",
]
