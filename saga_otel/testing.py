"""Helpers for testing your own sagas and their telemetry.

* :func:`capture` gives an in-memory tracer provider, a private Prometheus
  registry and a list of log events, and builds sagas wired to them.
* :class:`FailureInjector` makes chosen tools (or a seeded random share of
  calls) fail in do or in compensate, transiently or for good, so the
  compensation paths, the least-run code you have, run in your tests.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import structlog
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from saga_otel import semconv as sc
from saga_otel._engine import Saga, current_call
from saga_otel._errors import ConfigurationError
from saga_otel._registry import Tool, ToolRegistry
from saga_otel.contract import check

__all__ = [
    "AlertReceiver",
    "Captured",
    "FailureInjector",
    "InjectedFailure",
    "SidecarProcess",
    "capture",
    "contract_violations",
    "metric_value",
    "span_attrs",
    "start_sidecar",
]


# The samples a family of each type exposes, after prometheus-client's own table.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "info": ("_info",),
}


def metric_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0.0 when the series does not exist yet.

    Raises :class:`~saga_otel.ConfigurationError` when no metric in ``registry``
    has a sample called ``name`` (a counter's ends in ``_total``), or when the
    label names are not the metric's: either would read 0.0 whatever happened.
    """
    families = list(registry.collect())
    family = next((f for f in families if name in _sample_names(f)), None)
    if family is None:
        known = sorted(n for f in families for n in _sample_names(f) if not n.endswith("_created"))
        raise ConfigurationError(
            f"no metric sample {name!r} in this registry (a counter's name ends in _total); "
            f"its samples: {', '.join(known) or 'none yet (build a saga on it first)'}"
        )
    wanted = _label_names(registry, family, name)
    if wanted is not None and set(labels) != wanted:
        raise ConfigurationError(
            f"metric {name!r} has labels ({', '.join(sorted(wanted)) or 'none'}), not "
            f"({', '.join(sorted(labels)) or 'none'}); give each of its labels and no other"
        )
    return registry.get_sample_value(name, labels) or 0.0


def _sample_names(family: Metric) -> tuple[str, ...]:
    return tuple(family.name + s for s in _SUFFIXES.get(family.type, ("",)))


def _label_names(registry: CollectorRegistry, family: Metric, name: str) -> set[str] | None:
    """The label names of ``name``'s samples, or None when they cannot be known."""
    for sample in family.samples:
        if sample.name == name:
            return set(sample.labels)
    # No series yet: a prometheus-client metric keeps its label names (a private
    # attribute, hence the getattr; another collector's are unknown until it has one).
    collectors = getattr(registry, "_names_to_collectors", {})
    names = getattr(collectors.get(name), "_labelnames", None)
    if not isinstance(names, tuple):
        return None
    bucket = family.type in ("histogram", "gaugehistogram") and name.endswith("_bucket")
    return {*names, "le"} if bucket else set(names)


@dataclass
class Captured:
    """Everything one test's sagas emitted."""

    provider: TracerProvider
    exporter: InMemorySpanExporter
    registry: CollectorRegistry
    logs: list[dict[str, Any]]
    logger: Any

    def spans(self, phase: str | None = None, run_id: str | None = None) -> list[ReadableSpan]:
        """The finished spans, of one saga ``phase`` and/or run when given.

        Raises :class:`~saga_otel.ConfigurationError` for a phase no saga span has
        (a misspelt one would find no span, whatever happened).
        """
        if phase is not None and phase not in sc.PHASES:
            raise ConfigurationError(
                f"Captured.spans(phase={phase!r}): no saga span has that phase; use one of "
                f"{', '.join(sorted(sc.PHASES))}"
            )
        out = []
        for s in self.exporter.get_finished_spans():
            attrs = s.attributes or {}
            if phase is not None and attrs.get(sc.SAGA_PHASE) != phase:
                continue
            if run_id is not None and attrs.get(sc.SAGA_RUN_ID) != run_id:
                continue
            out.append(s)
        return out

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.registry, name, **labels)

    def events(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.logs if e.get("event") == event]

    def saga(self, name: str, **kwargs: Any) -> Saga:
        """A Saga wired to this capture, with no real sleeping between retries."""
        kwargs.setdefault("sleep", lambda _s: None)
        kwargs.setdefault("async_sleep", _no_sleep)
        return Saga(
            name,
            tracer_provider=self.provider,
            registry=self.registry,
            logger=self.logger,
            **kwargs,
        )

    def clear(self) -> None:
        self.exporter.clear()
        self.logs.clear()


async def _no_sleep(_seconds: float) -> None:
    return None


def capture() -> Captured:
    """A private tracer provider, metrics registry and log list; nothing global is touched."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    logs: list[dict[str, Any]] = []

    def keep(_logger: Any, _method: str, event: Any) -> Any:
        logs.append(dict(event))
        raise structlog.DropEvent

    logger = structlog.wrap_logger(
        structlog.PrintLogger(),
        processors=[structlog.processors.add_log_level, keep],
    )
    return Captured(provider, exporter, CollectorRegistry(), logs, logger)


class InjectedFailure(Exception):
    """Raised by a tool that a FailureInjector told to fail."""


_INJECTED_PHASES = (sc.PHASE_DO, sc.PHASE_COMPENSATE)  # the phases a tool call runs in


@dataclass
class _Plan:
    phase: str
    times: int | None  # None: fail for good
    error: Callable[[str], BaseException]
    count: int = 0


@dataclass
class FailureInjector:
    """Decides which tool calls fail. Thread-safe; seeded for repeatable random runs.

    ``fail("send_reply")`` breaks a tool's do for good; ``fail("reverse_credit",
    phase="compensate", times=2)`` makes its first two compensate attempts
    fail, after which retries carry it. ``rate`` fails that share of all other
    calls (in ``phases``), each transiently for ``transient_attempts``. A plan
    that could never inject (another phase, a tool the wrapped registry lacks,
    ``times`` below 1; a ``rate`` with no ``phases`` or ``transient_attempts``
    below 1) is refused with :class:`~saga_otel.ConfigurationError`, not kept silently.
    """

    seed: int | None = None
    rate: float = 0.0
    phases: tuple[str, ...] = ("do", "compensate")
    transient_attempts: int = 1
    _plans: dict[tuple[str, str], _Plan] = field(default_factory=dict)
    _random_left: dict[tuple[str, str, str, int], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    injected: list[tuple[str, str, str, int]] = field(default_factory=list)

    _tools: set[str] | None = None  # the names of every tool wrapped so far

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in _INJECTED_PHASES]
        if unknown:
            raise ConfigurationError(
                f"FailureInjector(phases={self.phases!r}): no tool call runs in phase "
                f"{unknown[0]!r}; use {' or '.join(map(repr, _INJECTED_PHASES))}"
            )
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigurationError(
                f"FailureInjector(rate={self.rate!r}) is not a share of calls: use 0.0 to 1.0"
            )
        if self.rate and not self.phases:
            raise ConfigurationError(
                f"FailureInjector(rate={self.rate!r}, phases=()) never injects: name the phases "
                f"to fail in ({' and/or '.join(map(repr, _INJECTED_PHASES))}), or use rate=0.0"
            )
        if self.rate and self.transient_attempts < 1:
            raise ConfigurationError(
                f"FailureInjector(rate={self.rate!r}, transient_attempts="
                f"{self.transient_attempts!r}) never injects: use transient_attempts >= 1 (the "
                "attempts of a drawn call that fail), or rate=0.0"
            )
        self._rng = random.Random(self.seed)

    def fail(
        self,
        tool: str,
        *,
        phase: str = "do",
        times: int | None = None,
        error: Callable[[str], BaseException] = InjectedFailure,
    ) -> FailureInjector:
        """Make ``tool`` fail in ``phase`` (``do`` or ``compensate``): ``times`` times, or always.

        Raises :class:`~saga_otel.ConfigurationError` for a plan that would never
        inject: another phase, ``times`` below 1, or (once the injector has wrapped
        a registry) a tool name it does not hold.
        """
        if phase not in _INJECTED_PHASES:
            raise ConfigurationError(
                f"FailureInjector.fail({tool!r}, phase={phase!r}): no tool call runs in phase "
                f"{phase!r}; use {' or '.join(map(repr, _INJECTED_PHASES))}"
            )
        if times is not None and times < 1:
            raise ConfigurationError(
                f"FailureInjector.fail({tool!r}, times={times!r}) never injects: use times >= 1, "
                "or leave it out to fail every call"
            )
        with self._lock:
            # Before any wrap() the tools are unknown: wrap() checks the plans then.
            if self._tools is not None:
                _check_plans([tool], self._tools)
            self._plans[(tool, phase)] = _Plan(phase, times, error)
        return self

    def should_fail(
        self, tool: str, phase: str, index: int, run_id: str = ""
    ) -> BaseException | None:
        """The error to raise for this call, or None. Random draws are per run and step."""
        with self._lock:
            plan = self._plans.get((tool, phase))
            if plan is not None:
                if plan.times is None or plan.count < plan.times:
                    plan.count += 1
                    self.injected.append((run_id, tool, phase, index))
                    return plan.error(f"injected failure in {phase} of {tool}")
                return None
            if self.rate and phase in self.phases:
                key = (run_id, tool, phase, index)
                left = self._random_left.get(key)
                if left is None:
                    left = self.transient_attempts if self._rng.random() < self.rate else 0
                if left > 0:
                    self._random_left[key] = left - 1
                    self.injected.append(key)
                    return InjectedFailure(f"injected transient failure in {phase} of {tool}")
                self._random_left[key] = 0
        return None

    def wrap(self, registry: ToolRegistry | Iterable[Tool]) -> ToolRegistry:
        """A copy of the registry whose tools consult this injector before running.

        Raises :class:`~saga_otel.ConfigurationError` when a :meth:`fail` plan
        names a tool that neither this registry nor one wrapped before holds.
        """
        tools = registry if isinstance(registry, ToolRegistry) else ToolRegistry(registry)
        with self._lock:
            known = (self._tools or set()) | {tools.get(name).name for name in tools}
            _check_plans([tool for tool, _ in self._plans], known)
            self._tools = known
        out = ToolRegistry()
        for name in tools:
            out.register(self._wrap_tool(tools.get(name)), name=name)
        return out

    def _wrap_tool(self, t: Tool) -> Tool:
        injector, fn = self, t.fn

        def check() -> None:
            call = current_call()
            phase = call.phase if call else "do"
            index = call.index if call else -1
            exc = injector.should_fail(t.name, phase, index, call.run_id if call else "")
            if exc is not None:
                raise exc

        if t.is_async:

            async def wrapped_async(**kwargs: Any) -> Any:
                check()
                return await fn(**kwargs)

            new_fn: Callable[..., Any] = wrapped_async
        else:

            def wrapped(**kwargs: Any) -> Any:
                check()
                return fn(**kwargs)

            new_fn = wrapped
        keep_key = t.accepts_idempotency_key

        made = replace(t, fn=new_fn)
        object.__setattr__(made, "accepts_idempotency_key", keep_key)
        return made


def _check_plans(planned: Iterable[str], tools: set[str]) -> None:
    unknown = sorted(set(planned) - tools)
    if unknown:
        raise ConfigurationError(
            f"FailureInjector.fail() names {', '.join(map(repr, unknown))}, which no registry "
            f"it wraps holds (tools: {', '.join(sorted(tools)) or 'none'}); fix the name"
        )


def span_attrs(span: ReadableSpan) -> Mapping[str, Any]:
    """A span's attributes as a plain dict."""
    return dict(span.attributes or {})


# The saga span names without their saga or step: "saga.do" of "saga.do get_order".
_SAGA_SPAN_NAMES = (
    *(
        name("").rstrip()
        for name in (
            sc.run_span_name,
            sc.validate_span_name,
            sc.do_span_name,
            sc.unwind_span_name,
            sc.compensate_span_name,
            sc.escalate_span_name,
        )
    ),
    sc.HEARTBEAT_SPAN_NAME,
)


def _looks_like_saga(span: ReadableSpan, attrs: Mapping[str, Any]) -> bool:
    named = any(span.name == n or span.name.startswith(n + " ") for n in _SAGA_SPAN_NAMES)
    return named or any(key.startswith("saga.") for key in attrs)


def contract_violations(spans: Iterable[ReadableSpan]) -> list[str]:
    """Every way these spans break the saga span contract (empty when they keep it).

    The rules are :func:`saga_otel.contract.check` with ``complete=True``: the
    sidecar's intake rules plus what every span saga-otel emits carries. Saga
    spans are those carrying ``saga.phase``, as at the sidecar's intake; your own
    spans beside them are skipped, unless one looks like a saga span (a saga
    span's name, or any ``saga.*`` attribute) without ``saga.phase``: that one is
    reported, since the sidecar would ignore it.
    """
    out: list[str] = []
    for span in spans:
        attrs = dict(span.attributes or {})
        if sc.SAGA_PHASE not in attrs and not _looks_like_saga(span, attrs):
            continue
        for problem in check(attrs, span.name, complete=True):
            out.append(f"span {span.name!r}: {problem}")
    return out


# -- a real sidecar and a recording alert sink, for integration tests ----------------


@dataclass
class SidecarProcess:
    """A ``saga-sidecar serve`` process started by :func:`start_sidecar`."""

    proc: Any
    otlp: str
    grpc: str
    api: str
    db: Any
    log: Any

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> SidecarProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_sidecar(tmp: Any, *args: str, db: Any = None, log: Any = None) -> SidecarProcess:
    """Start ``saga-sidecar serve`` on free loopback ports, its database in folder ``tmp``.

    Extra ``args`` go to ``serve`` (e.g. ``"--webhook", url``); ``db`` may be a file
    or a ``postgresql://`` URL. Returns once it listens; use as a context manager or
    call ``stop()``.
    """
    import json
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(tmp)
    if not (isinstance(db, str) and "://" in db):  # a URL (postgresql://...) goes as is
        db = Path(db) if db is not None else folder / "sidecar.db"
    log = (
        Path(log)
        if log is not None
        else folder / f"sidecar-{len(list(folder.glob('sidecar-*.log')))}.log"
    )
    cmd = [
        str(Path(sys.executable).parent / "saga-sidecar"),
        "serve",
        "--otlp-http-port", "0",
        "--otlp-grpc-port", "0",
        "--api-port", "0",
        "--db", str(db),
        "--no-alert-log",
        *args,
    ]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == "sidecar.listening":
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain
            return SidecarProcess(
                proc,
                otlp=f"http://127.0.0.1:{doc['otlp_http']}",
                grpc=f"127.0.0.1:{doc['otlp_grpc']}",
                api=f"http://127.0.0.1:{doc['api']}",
                db=db,
                log=log,
            )
    proc.wait()
    raise RuntimeError(f"the sidecar did not start; its log ends: {log.read_text()[-2000:]}")


class AlertReceiver:
    """A webhook alert sink on loopback that records every alert the sidecar delivers.

    ``port=0`` picks a free port; a chosen port may be started late with
    :meth:`start`, to play a sink that is down for a while.
    """

    def __init__(self, port: int = 0, *, start: bool = True) -> None:
        import socket

        if port == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        self.port = port
        self.alerts: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self._server: Any = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    def start(self) -> None:
        import json
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: ARG002
                return  # quiet: the test reads the recorded alerts, not the access log

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    outer.alerts.append({**json.loads(body), "_received": time.time()})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def find(self, alertname: str, run_id: str, status: str = "firing") -> dict[str, Any] | None:
        with self.lock:
            for a in self.alerts:
                if (a.get("alertname"), a.get("run_id"), a.get("status")) == (
                    alertname,
                    run_id,
                    status,
                ):
                    return a
        return None

    def keys(self) -> dict[tuple[str, str], int]:
        """How many times each (dedup_key, status) arrived."""
        out: dict[tuple[str, str], int] = {}
        with self.lock:
            for a in self.alerts:
                key = (a["dedup_key"], a["status"])
                out[key] = out.get(key, 0) + 1
        return out

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
