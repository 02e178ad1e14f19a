"""The library's own logger, chosen without touching the user's logging setup."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

Logger = Any  # structlog's BoundLogger protocol is loose; anything with .error/.warning/.info


def default_logger() -> Any:
    """The library's own logger: the user's structlog pipeline if they set one up,
    else JSON lines on stderr, without touching structlog's global configuration."""
    if structlog.is_configured():
        return structlog.get_logger("saga_otel")
    level = getattr(logging, os.environ.get("SAGA_OTEL_LOG_LEVEL", "INFO").upper(), logging.INFO)
    # bind() resolves structlog's lazy proxy once, instead of on every event.
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_name="saga_otel",
    ).bind()
