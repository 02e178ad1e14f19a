"""The library's own logger, chosen without touching the user's logging setup.

When the user configured structlog, the library logs through their pipeline
(``structlog.get_logger("saga_otel")``). Otherwise it logs through a structlog
bound logger of its own (:func:`json_lines_logger`, never the global
configuration) that writes JSON lines to stderr: the lines structlog's
``add_log_level`` + ``TimeStamper(fmt="iso", utc=True)`` + ``JSONRenderer()``
pipeline would write (the event's fields, then ``event``, ``level`` and
``timestamp``, in that order, with the same values), rendered by one processor
instead of three, with the timestamp's date and time cached per second. It is the
bound logger itself (no lazy proxy), and its enabled level methods build the same event
dict and write it without structlog's generic processor dispatch (``bind`` and level
filtering stay structlog's); :func:`emitter` hands :class:`Instrumentation` a writer
that takes the event's fields dict as built.
The JSON is orjson's (compact: no spaces after ``,`` and ``:``); a value
orjson refuses (an int over 64 bits, a non-string key) falls back to the
standard library's encoder. ``tests/saga_otel/test_logging.py`` compares the
two pipelines' events.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import IO, Any

import orjson
import structlog

Logger = Any  # structlog's BoundLogger protocol is loose; anything with .error/.warning/.info


def _fallback(obj: object) -> Any:
    # structlog.processors.JSONRenderer's default: __structlog__ if given, else repr.
    custom = getattr(obj, "__structlog__", None)
    return custom() if custom is not None else repr(obj)


_encode = json.JSONEncoder(default=_fallback).encode


def render(fields: Mapping[str, Any]) -> str:
    """One event as a JSON object (orjson; the standard library for what orjson refuses)."""
    try:
        return orjson.dumps(fields, default=_fallback).decode()
    except TypeError:  # orjson.JSONEncodeError: a big int, a non-string key
        return _encode(fields)


def render_line(fields: Mapping[str, Any]) -> str:
    """:func:`render` and the newline, in one encode."""
    try:
        return orjson.dumps(fields, default=_fallback, option=orjson.OPT_APPEND_NEWLINE).decode()
    except TypeError:
        return _encode(fields) + "\n"


_write_locks: dict[int, threading.Lock] = {}
# Guards _write_locks' membership. It and every write lock are held across a fork, as
# the logging module holds its handlers' locks: a lock held by a thread that the child
# does not have (fork copies one thread) stayed held there forever, and the child hung
# at its first log line; held by the forking thread, no line is half-written either.
_locks_lock = threading.Lock()


def _hold_for_fork() -> None:
    _locks_lock.acquire()
    for lock in _write_locks.values():
        lock.acquire()


def _release_after_fork() -> None:
    for lock in _write_locks.values():
        lock.release()
    _locks_lock.release()


os.register_at_fork(
    before=_hold_for_fork, after_in_parent=_release_after_fork, after_in_child=_release_after_fork
)
_CLASSES: dict[int, type[Any]] = {}
# structlog's level methods and their numbers (as structlog's LEVEL_TO_NAME).
_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _interpolate(event: str, args: tuple[Any, ...]) -> str:
    """structlog's positional (or one-mapping) ``%`` interpolation of the event."""
    if len(args) == 1 and isinstance(args[0], Mapping) and args[0]:
        return event % args[0]
    return event % args


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
        return "%s.%06dZ" % (cached[1], micros) if micros else cached[1] + "Z"  # noqa: UP031


class LineWriter:
    """structlog's final "logger": writes each rendered line and flushes, under a lock
    per stream (threads' lines never interleave)."""

    __slots__ = ("_lock", "_stream")

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        with _locks_lock:
            self._lock = _write_locks.setdefault(id(stream), threading.Lock())

    def msg(self, line: str) -> None:
        self.write_line(line + "\n")

    def write_line(self, line: str) -> None:
        """Write ``line``, its newline included."""
        with self._lock:
            self._stream.write(line)
            self._stream.flush()

    debug = info = warning = warn = error = critical = exception = log = msg


# structlog.processors.add_log_level's names for the methods that are aliases.
_LEVEL_NAMES = {"warn": "warning", "exception": "error", "msg": "info"}


class _Render:
    """The one processor: ``add_log_level`` + ``TimeStamper(fmt="iso", utc=True)`` +
    ``JSONRenderer()`` in a single call (orjson, timestamp cached per second)."""

    __slots__ = ("_clock",)

    def __init__(self, clock: _Clock) -> None:
        self._clock = clock

    def fill(self, level: str, event: MutableMapping[str, Any]) -> None:
        """Add ``level`` and ``timestamp``, as add_log_level and TimeStamper do."""
        event["level"] = level
        event["timestamp"] = self._clock.stamp()

    def __call__(self, _logger: object, method: str, event: MutableMapping[str, Any]) -> str:
        self.fill(_LEVEL_NAMES.get(method, method), event)
        return render(event)


def _write(
    context: Mapping[str, Any],
    renderer: _Render,
    out: LineWriter,
    name: str,
    event: str,
    fields: dict[str, Any],
) -> None:
    """One event of level method ``name`` (never an alias): the event dict structlog's
    ``_process_event`` builds (bound context, then ``fields``, then ``event``), filled
    and rendered as :class:`_Render` does and written. ``fields`` is consumed."""
    if context:
        fields = {**context, **fields}
    fields["event"] = event
    renderer.fill(name, fields)
    out.write_line(render_line(fields))


def _write_fields(self: Any, name: str, event: str, fields: dict[str, Any]) -> None:
    """:func:`_write` for a bound logger, without the generic processor chain's dispatch.
    A logger whose processors are not the one ``_Render`` (never the case for
    :func:`json_lines_logger`'s loggers and their binds) takes structlog's own path."""
    procs = self._processors
    if len(procs) != 1 or type(procs[0]) is not _Render:
        self._proxy_to_logger(name, event, **fields)
        return
    _write(self._context, procs[0], self._logger, name, event, fields)


def _fast_method(name: str) -> Any:
    """A level method of the library's own logger, through :func:`_write_fields`."""

    def meth(self: Any, event: str, *args: Any, **kw: Any) -> Any:
        if args:
            event = _interpolate(event, args)
        _write_fields(self, name, event, kw)  # kw is this call's own dict
        return None

    meth.__name__ = name
    return meth


def emitter(logger: object) -> tuple[int, Callable[[str, str, dict[str, Any]], None]] | None:
    """For the library's own logger: its level (fixed for its life) and a writer of one
    event from a fields dict, ``write(method, event, fields)`` (``fields`` consumed; the
    caller checks the level); None for any other logger.

    The writer is :func:`_write` with this logger's parts looked up once."""
    if not is_default(logger) or not isinstance(logger, tuple(_CLASSES.values())):
        return None
    procs = logger._processors  # type: ignore[attr-defined]
    if len(procs) != 1 or type(procs[0]) is not _Render:
        return None
    write = functools.partial(_write, logger._context, procs[0], logger._logger)  # type: ignore[attr-defined]
    level: int = logger.get_effective_level()  # type: ignore[attr-defined]
    return level, write


def _json_lines_class(level: int) -> type[Any]:
    """structlog's filtering bound logger for ``level`` (filtered levels stay its no-op
    methods, ``bind``/``new``/``unbind`` and the async methods are its own), with the
    enabled levels' methods taking :func:`_fast_method`'s path."""
    found = _CLASSES.get(level)
    if found is None:
        base = structlog.make_filtering_bound_logger(level)
        meths: dict[str, Any] = {"__slots__": ()}
        for name, lvl in _METHOD_LEVELS.items():
            if lvl >= level:
                meths[name] = _fast_method(name)
        for alias, name in (("fatal", "critical"), ("warn", "warning"), ("msg", "info")):
            if name in meths:
                meths[alias] = meths[name]
        found = _CLASSES[level] = type(f"JsonLines{base.__name__}", (base,), meths)
    return found


def json_lines_logger(
    stream: IO[str], level: int = logging.INFO, *, _clock: _Clock | None = None
) -> Any:
    """A structlog bound logger of the library's own (structlog's global configuration is
    never touched) that filters by ``level`` and writes one JSON object per line.

    It is the bound logger itself, not ``structlog.wrap_logger``'s lazy proxy (which
    assembles a new bound logger on every method lookup)."""
    cls = _json_lines_class(level)
    return cls(LineWriter(stream), processors=[_Render(_clock or _Clock())], context={})


def is_default(logger: object) -> bool:
    """Whether ``logger`` is (bound from) the library's own JSON-lines logger."""
    return type(getattr(logger, "_logger", None)) is LineWriter


def default_logger(stream: IO[str] | None = None) -> Any:
    """The library's own logger: the user's structlog pipeline if they set one up,
    else JSON lines on ``stream`` (stderr), without touching structlog's global configuration."""
    if structlog.is_configured():
        return structlog.get_logger("saga_otel")
    level = getattr(logging, os.environ.get("SAGA_OTEL_LOG_LEVEL", "INFO").upper(), logging.INFO)
    return json_lines_logger(stream if stream is not None else sys.stderr, level)
