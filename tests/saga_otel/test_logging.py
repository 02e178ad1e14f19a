"""The library's default logger (structlog, one orjson processor) writes the events
structlog's stock JSON pipeline would."""

from __future__ import annotations

import io
import json
import logging
import re
from datetime import UTC, datetime

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from support import run_child

from saga_otel._logging import default_logger, is_default, json_lines_logger
from saga_otel._telemetry import STACK_FRAMES, Instrumentation

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{6})?Z$")


def structlog_pipeline(stream: io.StringIO, level: int = logging.INFO) -> object:
    """The pipeline the default logger used to be (and a user's own would be)."""
    return structlog.wrap_logger(
        structlog.PrintLogger(stream),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
    ).bind()


class Odd:
    def __repr__(self) -> str:
        return "<odd>"


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_same_events_fields_and_order_as_the_structlog_pipeline() -> None:
    fast_out, slow_out = io.StringIO(), io.StringIO()
    fast, slow = json_lines_logger(fast_out), structlog_pipeline(slow_out)
    calls: list[tuple[str, dict[str, object]]] = [
        ("info", {"saga": "refund", "attempt": 1, "duration_s": 0.25, "error": None}),
        ("warning", {"pending": ["a", "b"], "ok": False, "card": {"x": [1, {"y": 2}]}}),
        ("error", {"odd": Odd(), "big": 2**70, "text": 'é \u2028 "q"'}),
        ("debug", {"dropped": True}),  # below info: neither writes it
    ]
    for method, kw in calls:
        getattr(fast, method)("saga.test", **kw)
        getattr(slow, method)("saga.test", **kw)
    got, want = lines(fast_out), lines(slow_out)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)  # the same keys in the same order
        assert ISO_UTC.match(str(g.pop("timestamp"))) and ISO_UTC.match(str(w.pop("timestamp")))
        assert g == w


def test_timestamp_is_now_in_utc() -> None:
    out = io.StringIO()
    json_lines_logger(out).info("saga.test")
    stamp = datetime.fromisoformat(str(lines(out)[0]["timestamp"]).replace("Z", "+00:00"))
    assert abs((datetime.now(UTC) - stamp).total_seconds()) < 60


def test_bind_level_and_filtering() -> None:
    out = io.StringIO()
    log = json_lines_logger(out, logging.WARNING).bind(service="agent")
    assert not log.is_enabled_for(logging.INFO) and log.is_enabled_for(logging.ERROR)
    log.debug("saga.quiet")
    log.info("saga.quiet")
    log.error("saga.loud", n=1)
    log.critical("saga.louder")
    first, second = lines(out)
    assert (first["service"], first["n"], first["event"], first["level"]) == (
        "agent",
        1,
        "saga.loud",
        "error",
    )
    assert (second["event"], second["level"]) == ("saga.louder", "critical")


def test_default_logger_leaves_structlog_unconfigured_and_follows_the_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SAGA_OTEL_LOG_LEVEL", "ERROR")
    out = io.StringIO()
    log = default_logger(out)
    assert is_default(log) and not structlog.is_configured()
    log.warning("saga.quiet")
    log.error("saga.loud")
    assert [e["event"] for e in lines(out)] == ["saga.loud"]


def test_a_configured_structlog_is_used_as_is() -> None:
    seen: list[dict[str, object]] = []

    def keep(_l: object, _m: str, event: dict[str, object]) -> dict[str, object]:
        seen.append(dict(event))
        raise structlog.DropEvent

    structlog.configure(processors=[keep])
    try:
        instr = Instrumentation(
            "refund", tracer_provider=TracerProvider(), registry=CollectorRegistry()
        )
        assert not is_default(instr.log)
        instr.start_run()
        assert [e["event"] for e in seen] == ["saga.run.started"]
    finally:
        structlog.reset_defaults()


def test_failed_attempt_records_a_bounded_exception_event() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    out = io.StringIO()
    instr = Instrumentation(
        "refund",
        tracer_provider=provider,
        registry=CollectorRegistry(),
        logger=json_lines_logger(out),
    )
    run = instr.start_run()

    def deep(n: int) -> None:
        if n == 0:
            raise KeyError("charge ch_1")
        deep(n - 1)

    with pytest.raises(KeyError), instr.attempt(run, "do", "charge", index=0):
        deep(STACK_FRAMES * 3)
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("saga.do")]
    (event,) = span.events
    attrs = dict(event.attributes or {})
    assert event.name == "exception"
    assert attrs["exception.type"] == "KeyError"
    assert attrs["exception.message"] == "'charge ch_1'"
    assert attrs["exception.escaped"] == "False"
    stack = str(attrs["exception.stacktrace"])
    assert stack.endswith("KeyError: 'charge ch_1'\n")
    assert stack.startswith("Traceback (most recent call last):\n")
    assert stack.count('File "') == STACK_FRAMES  # the innermost frames only
    assert stack.count(", in deep\n") == STACK_FRAMES
    (finished,) = [e for e in lines(out) if e["event"] == "saga.step.finished"]
    assert finished["error"] == "KeyError: 'charge ch_1'" and finished["level"] == "warning"


@pytest.mark.parametrize("ns", [1_764_755_504_000_000_000, 1_764_755_504_123_456_789, 0, 999_999])
def test_timestamp_matches_datetime_isoformat(monkeypatch: pytest.MonkeyPatch, ns: int) -> None:
    from saga_otel import _logging

    monkeypatch.setattr(_logging.time, "time_ns", lambda: ns)
    want = (
        datetime.fromtimestamp(ns // 1000 / 1e6, UTC)
        .replace(microsecond=(ns // 1000) % 1_000_000)
        .isoformat()
        .replace("+00:00", "Z")
    )
    assert _logging._Clock().stamp() == want


class _BrokenStr(Exception):
    def __str__(self) -> str:
        raise ValueError("no text")


def _noted() -> BaseException:
    exc = ValueError("noted")
    exc.add_note("a note")
    return exc


@pytest.mark.parametrize(
    "exc",
    [
        KeyError("charge ch_1"),
        ValueError(""),
        RuntimeError("two\nlines"),
        _BrokenStr("x"),
        OSError(2, "not found"),
        SyntaxError("bad", ("f.py", 1, 2, "x y")),
        ExceptionGroup("g", [ValueError(1)]),
        KeyboardInterrupt(),
        _noted(),
    ],
)
def test_exception_line_is_tracebacks(exc: BaseException) -> None:
    """The recorded exception's last line is traceback.format_exception_only's, exactly."""
    import traceback

    from saga_otel._telemetry import exception_only

    assert exception_only(exc) == "".join(traceback.format_exception_only(exc))


def test_instrumentation_writes_through_a_bound_default_logger() -> None:
    """The events the library writes itself carry the bound context first, and follow the
    logger's level, like any call through the bound logger."""
    out = io.StringIO()
    instr = Instrumentation(
        "refund",
        tracer_provider=TracerProvider(),
        registry=CollectorRegistry(),
        logger=json_lines_logger(out).bind(service="agent"),
    )
    run = instr.start_run()
    with instr.attempt(run, "do", "charge", index=0):
        pass
    started, finished = lines(out)
    assert list(finished)[:2] == ["service", "saga"] and finished["service"] == "agent"
    assert (started["event"], finished["event"]) == ("saga.run.started", "saga.step.finished")
    assert finished["trace_id"] == started["trace_id"] == run.run_id
    quiet = io.StringIO()
    instr.log = json_lines_logger(quiet, logging.WARNING)
    with instr.attempt(run, "do", "charge", index=0):
        pass
    with pytest.raises(KeyError), instr.attempt(run, "do", "charge", index=0, attempt=2):
        raise KeyError("x")
    assert [(e["event"], e["level"]) for e in lines(quiet)] == [("saga.step.finished", "warning")]


# A thread is mid-line when the process forks: its write waits for `go`, which a timer
# sets a moment later. The child writes a line of its own to the same stream.
_FORK_MID_LINE = r"""
import faulthandler, os, threading
from saga_otel._logging import LineWriter

class Held:
    def __init__(self):
        self.lines = []
        self.entered = threading.Event()
        self.go = threading.Event()

    def write(self, text):
        if text == "parent\n":
            self.entered.set()
            self.go.wait(30)
        self.lines.append(text)

    def flush(self):
        pass

stream = Held()
threading.Thread(target=LineWriter(stream).write_line, args=("parent\n",), daemon=True).start()
assert stream.entered.wait(30)
threading.Timer(0.3, stream.go.set).start()
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(10, exit=True)  # a hung child ends, showing where
    LineWriter(stream).write_line("child\n")  # a writer of its own: the stream's one lock
    os._exit(0 if stream.lines == ["parent\n", "child\n"] else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_fork_while_another_thread_writes_a_line_leaves_the_child_able_to_log() -> None:
    """The write locks are held across a fork (as the logging module holds its handlers'):
    the fork waits for the line being written, and the child's lock is free."""
    done = run_child(_FORK_MID_LINE)
    assert done.returncode == 0, done.stderr
    # 1: the child hung on the lock (faulthandler's exit); 3: it saw a half-written line.
    assert done.stdout.strip() == "0", done.stderr
