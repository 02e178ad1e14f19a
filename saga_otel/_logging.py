"""The library's own logger, chosen without touching the user's logging setup.

When the user configured structlog, the library logs through their pipeline
(``structlog.get_logger("saga_otel")``). Otherwise it writes JSON lines to
stderr with :class:`JsonLinesLogger`: the lines structlog's
``add_log_level`` + ``TimeStamper(fmt="iso", utc=True)`` + ``JSONRenderer()``
pipeline would write (the event's fields, then ``event``, ``level`` and
``timestamp``, in that order, with the same values), rendered in one call
instead of three processors, with the timestamp's date and time cached per second.
The JSON is orjson's (compact: no spaces after ``,`` and ``:``); a value
orjson refuses (an int over 64 bits, a non-string key) falls back to the
standard library's encoder. ``tests/saga_otel/test_logging.py`` compares the
two pipelines' events.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import IO, Any

import orjson
import structlog

Logger = Any  # structlog's BoundLogger protocol is loose; anything with .error/.warning/.info


def _fallback(obj: object) -> Any:
    # structlog.processors.JSONRenderer's default: __structlog__ if given, else repr.
    custom = getattr(obj, "__structlog__", None)
    return custom() if custom is not None else repr(obj)


_encode = json.JSONEncoder(default=_fallback).encode


def render(fields: dict[str, Any]) -> str:
    """One event as a JSON object (orjson; the standard library for what orjson refuses)."""
    try:
        return orjson.dumps(fields, default=_fallback).decode()
    except TypeError:  # orjson.JSONEncodeError: a big int, a non-string key
        return _encode(fields)


_write_locks: dict[int, threading.Lock] = {}


class _Clock:
    """``datetime.now(utc).isoformat()``, ``+00:00`` as ``Z``; date and time cached per second.

    The cache is one (second, text) tuple, swapped whole, so threads never mix
    one second's text with another's.
    """

    __slots__ = ("_cached",)

    def __init__(self) -> None:
        self._cached: tuple[int, str] = (-1, "")

    def stamp(self) -> str:
        second, rest = divmod(time.time_ns(), 1_000_000_000)
        cached = self._cached
        if cached[0] != second:
            cached = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
            self._cached = cached
        micros = rest // 1000
        # isoformat() leaves out a zero fraction; keep the same shape.
        return f"{cached[1]}.{micros:06d}Z" if micros else f"{cached[1]}Z"


class JsonLinesLogger:
    """The default logger: one JSON object per line, written and flushed under a lock.

    The surface the library and a user holding ``saga.instr.log`` use from a
    structlog filtering bound logger: the level methods, ``bind`` and
    ``is_enabled_for``.
    """

    __slots__ = ("_clock", "_context", "_level", "_lock", "_stream")

    def __init__(
        self,
        stream: IO[str],
        level: int = logging.INFO,
        context: dict[str, Any] | None = None,
        *,
        _clock: _Clock | None = None,
    ) -> None:
        self._stream = stream
        self._level = level
        self._context = context or {}
        self._clock = _clock or _Clock()
        self._lock = _write_locks.setdefault(id(stream), threading.Lock())

    def is_enabled_for(self, level: int) -> bool:
        return level >= self._level

    def bind(self, **kw: Any) -> JsonLinesLogger:
        return JsonLinesLogger(
            self._stream, self._level, {**self._context, **kw}, _clock=self._clock
        )

    def emit(self, level: str, number: int, event: str, fields: dict[str, Any]) -> None:
        """Write one line if ``number`` passes the level; ``fields`` is consumed."""
        if number < self._level:
            return
        if self._context:
            fields = {**self._context, **fields}
        fields["event"] = event
        fields["level"] = level
        fields["timestamp"] = self._clock.stamp()
        line = render(fields) + "\n"
        with self._lock:
            self._stream.write(line)
            self._stream.flush()

    def debug(self, event: str, **kw: Any) -> None:
        self.emit("debug", logging.DEBUG, event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self.emit("info", logging.INFO, event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self.emit("warning", logging.WARNING, event, kw)

    warn = warning

    def error(self, event: str, **kw: Any) -> None:
        self.emit("error", logging.ERROR, event, kw)

    def critical(self, event: str, **kw: Any) -> None:
        self.emit("critical", logging.CRITICAL, event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        kw.setdefault("exc_info", True)
        self.emit("error", logging.ERROR, event, kw)

    def log(self, level: int, event: str, **kw: Any) -> None:
        name = logging.getLevelName(level).lower()
        self.emit(name, level, event, kw)


def default_logger(stream: IO[str] | None = None) -> Any:
    """The library's own logger: the user's structlog pipeline if they set one up,
    else JSON lines on ``stream`` (stderr), without touching structlog's global configuration."""
    if structlog.is_configured():
        return structlog.get_logger("saga_otel")
    level = getattr(logging, os.environ.get("SAGA_OTEL_LOG_LEVEL", "INFO").upper(), logging.INFO)
    return JsonLinesLogger(stream if stream is not None else sys.stderr, level)
