"""saga-sidecar: watches saga runs from outside the agent, over OTLP.

Receives the saga span contract (``docs/semantic-conventions.md``) on OTLP/HTTP
and OTLP/gRPC, keeps every run's state and compensation stack in SQLite, and
serves them on a JSON API. See ``docs/sidecar.md``.

The names below load on first use: the package ships in the ``saga-otel`` wheel,
but its server stack (aiohttp, grpcio, click, rich, jinja2) comes only with the
``saga-otel[sidecar]`` extra, so importing ``sidecar`` alone must not need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOME = {
    "ApiError": "._errors",
    "ConfigError": "._errors",
    "DecodeError": "._errors",
    "Listener": "._server",
    "RunState": "._state",
    "Settings": "._settings",
    "Sidecar": "._server",
    "SidecarError": "._errors",
    "SpanEvent": "._otlp",
    "SpanRecord": "._otlp",
    "StoreError": "._errors",
    "Transition": "._state",
    "render_run": "._render",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'sidecar' has no attribute {name!r}")
    try:
        module = importlib.import_module(home, __name__)
    except ModuleNotFoundError:
        from ._deps import require_server_stack

        require_server_stack()  # names every missing part and the install line
        raise
    value = getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value
