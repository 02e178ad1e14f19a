"""The sidecar's logs: one event name and typed fields per line, never a repr.

Modules log through `get_logger`: a structlog logger over a stdlib one, so a program
that embeds `Sidecar` keeps its own logging setup (the event name is the message and
the fields ride as ``extra``). `saga-sidecar serve`, which owns its process, calls
`configure` once: JSON lines on stderr, or ``key=value`` on a terminal, for its own
events and for the libraries' (aiohttp, grpc) alike.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import structlog

_SHARED: list[Any] = [
    structlog.stdlib.add_logger_name,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def get_logger(name: str) -> Any:
    """A structlog logger writing through ``logging.getLogger(name)``."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.render_to_log_kwargs],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def configure(level: str, stream: IO[str] | None = None) -> None:
    """The service's log format (``saga-sidecar serve`` only; never called on import)."""
    out = stream if stream is not None else sys.stderr
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if out.isatty()
        else structlog.processors.JSONRenderer(sort_keys=True)
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*_SHARED, structlog.stdlib.ExtraAdder()],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
