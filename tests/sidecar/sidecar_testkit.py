"""Helpers for the sidecar tests: contract-shaped runs emitted with the plain OpenTelemetry SDK.

These deliberately do not use saga_otel's engine: the sidecar must understand any
agent that follows the span contract, whatever it is instrumented with.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode
from support import sql_on

from saga_otel import semconv as sc
from sidecar import Settings, Sidecar

if TYPE_CHECKING:
    from pg_server import Databases

NS = 1_000_000_000


class RunScript:
    """Writes the spans of one saga run by hand, with explicit times (seconds)."""

    def __init__(
        self,
        saga: str = "refund",
        *,
        instance: str = "agent-1",
        service: str = "refund-agent",
        t0: float = 1_700_000_000.0,
        run_id: str | None = None,
        resource: dict[str, Any] | None = None,
    ) -> None:
        """``resource``: the exact resource attributes (as another SDK may send them)."""
        self.saga = saga
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(
            resource=Resource(resource)
            if resource is not None
            else Resource.create({sc.SERVICE_NAME: service, sc.SERVICE_INSTANCE_ID: instance})
        )
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("saga-test")
        self.t = t0
        self.run = self.tracer.start_span(sc.run_span_name(saga), start_time=self._ns(self.t))
        self.run_id = run_id or f"{self.run.get_span_context().trace_id:032x}"
        for key, value in self._identity(sc.PHASE_RUN).items():
            self.run.set_attribute(key, value)
        self.ctx = trace.set_span_in_context(self.run)

    @staticmethod
    def _ns(t: float) -> int:
        return round(t * NS)

    def _identity(self, phase: str) -> dict[str, Any]:
        return {
            sc.SAGA_RUN_ID: getattr(self, "run_id", ""),
            sc.SAGA_NAME: self.saga,
            sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
            sc.SAGA_PHASE: phase,
        }

    def _span(
        self, name: str, phase: str, attrs: dict[str, Any], ok: bool = True, error: str = ""
    ) -> None:
        start = self.t
        self.t += 0.1
        span = self.tracer.start_span(
            name,
            context=self.ctx,
            start_time=self._ns(start),
            attributes={**self._identity(phase), **attrs},
        )
        if ok:
            span.set_status(Status(StatusCode.OK))
        else:
            span.add_event(
                "exception",
                {"exception.type": error.split(":")[0], "exception.message": error.split(": ")[-1]},
                timestamp=self._ns(self.t),
            )
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(self.t))
        self.t += 0.01

    def do(
        self,
        index: int,
        step: str,
        cls: str = "compensable",
        *,
        comp: tuple[str, dict[str, Any], str] | None = None,
        ok: bool = True,
        attempt: int = 1,
        pivot: bool = False,
        error: str = "TimeoutError: upstream timed out",
    ) -> RunScript:
        attrs: dict[str, Any] = {
            sc.SAGA_STEP_NAME: step,
            sc.SAGA_STEP_INDEX: index,
            sc.SAGA_STEP_CLASS: cls,
            sc.SAGA_STEP_ATTEMPT: attempt,
            sc.SAGA_STEP_PIVOT: pivot,
        }
        if comp is not None and ok:
            attrs[sc.SAGA_COMPENSATION_TOOL] = comp[0]
            attrs[sc.SAGA_COMPENSATION_ARGS] = json.dumps(comp[1])
            attrs[sc.SAGA_COMPENSATION_DESCRIPTION] = comp[2]
        self._span(sc.do_span_name(step), sc.PHASE_DO, attrs, ok, error)
        return self

    def unwind(self, reason: str, failed_step: str, stack: list[dict[str, Any]]) -> RunScript:
        attrs = {
            sc.SAGA_UNWIND_REASON: reason,
            sc.SAGA_RUN_FAILED_STEP: failed_step,
            sc.SAGA_STACK: json.dumps(stack),
        }
        self._span(sc.unwind_span_name(self.saga), sc.PHASE_UNWIND, attrs)
        return self

    def compensate(
        self,
        index: int,
        step: str,
        tool: str,
        args: dict[str, Any],
        *,
        ok: bool = True,
        attempt: int = 1,
        error: str = "HTTPError: 500 from billing",
    ) -> RunScript:
        attrs = {
            sc.SAGA_STEP_NAME: step,
            sc.SAGA_STEP_INDEX: index,
            sc.SAGA_STEP_ATTEMPT: attempt,
            sc.SAGA_COMPENSATION_TOOL: tool,
            sc.SAGA_COMPENSATION_ARGS: json.dumps(args),
        }
        self._span(sc.compensate_span_name(step), sc.PHASE_COMPENSATE, attrs, ok, error)
        return self

    def escalate(self, reason: str, card: object) -> RunScript:
        attrs = {sc.SAGA_ESCALATION_REASON: reason, sc.SAGA_ESCALATION_CARD: json.dumps(card)}
        self._span(sc.escalate_span_name(self.saga), sc.PHASE_ESCALATE, attrs)
        return self

    def end(self, status: str, failed_step: str | None = None) -> RunScript:
        self.run.set_attribute(sc.SAGA_RUN_STATUS, status)
        if failed_step:
            self.run.set_attribute(sc.SAGA_RUN_FAILED_STEP, failed_step)
        if status != sc.STATUS_COMPLETED:
            self.run.set_status(Status(StatusCode.ERROR, status))
        self.run.end(end_time=self._ns(self.t))
        return self

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


CREDIT = ("reverse_credit", {"credit_id": "cr_1"}, "reverse the credit cr_1")
TICKET = ("restore_ticket", {"ticket": "T-9", "status": "open"}, "reopen ticket T-9")


# Any value the sidecar reads from an agent's JSON attribute (Python's parser: NaN and
# Infinity too), and escalation cards: objects with the card's keys (and the sidecar's
# own additions) mapped to any of those, or anything else an agent may send as one.
any_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
CARD_KEYS = (
    "saga",
    "run_id",
    "reason",
    "failed_step",
    "error",
    "done",
    "undone",
    "not_undone",
    "irreversible",
    "decide",
    "will_undo",
    "recovery_override",
)
card_objects = st.fixed_dictionaries({}, optional={key: any_json for key in CARD_KEYS})
agent_cards = card_objects | any_json


def completed_run(**kw: Any) -> RunScript:
    r = RunScript(**kw)
    r.do(0, "lookup_order", "read")
    r.do(1, "issue_credit", "compensable", comp=CREDIT)
    r.do(2, "update_ticket", "reversible", comp=TICKET)
    r.do(3, "send_reply", "irreversible", pivot=True)
    return r.end(sc.STATUS_COMPLETED)


def _forward_then_fail(r: RunScript) -> RunScript:
    r.do(0, "lookup_order", "read")
    r.do(1, "issue_credit", "compensable", comp=CREDIT)
    r.do(2, "update_ticket", "reversible", comp=TICKET)
    r.do(3, "notify_billing", "compensable", ok=False)
    r.unwind(
        "TimeoutError: upstream timed out",
        "notify_billing",
        [
            {
                "step": "update_ticket",
                "index": 2,
                "tool": TICKET[0],
                "args": TICKET[1],
                "description": TICKET[2],
            },
            {
                "step": "issue_credit",
                "index": 1,
                "tool": CREDIT[0],
                "args": CREDIT[1],
                "description": CREDIT[2],
            },
        ],
    )
    return r


def compensated_run(**kw: Any) -> RunScript:
    r = _forward_then_fail(RunScript(**kw))
    r.compensate(2, "update_ticket", TICKET[0], TICKET[1])
    r.compensate(1, "issue_credit", CREDIT[0], CREDIT[1])
    return r.end(sc.STATUS_COMPENSATED, "notify_billing")


def compensation_failed_run(card: object = None, **kw: Any) -> RunScript:
    """``card``: the agent's escalation card (any JSON value), else a plain one."""
    r = _forward_then_fail(RunScript(**kw))
    r.compensate(2, "update_ticket", TICKET[0], TICKET[1])
    r.compensate(1, "issue_credit", CREDIT[0], CREDIT[1], ok=False, attempt=1)
    r.compensate(1, "issue_credit", CREDIT[0], CREDIT[1], ok=False, attempt=2)
    if card is None:
        card = {"not_undone": ["reverse the credit cr_1"]}
    r.escalate(sc.ESCALATION_COMPENSATION_FAILED, card)
    return r.end(sc.STATUS_COMPENSATION_FAILED, "notify_billing")


def stuck_run(**kw: Any) -> RunScript:
    r = RunScript(**kw)
    r.do(0, "issue_credit", "compensable", comp=CREDIT)
    r.do(1, "send_reply", "irreversible", pivot=True)
    r.do(2, "close_ticket", "convergent", ok=False)
    r.escalate(sc.ESCALATION_STUCK, {"decide": ["retry close_ticket"]})
    return r.end(sc.STATUS_STUCK, "close_ticket")


# Text an agent could send to take over a terminal: clear screen, window title, a
# hyperlink, concealed text, CR and erase-line (a fake line), a C1 CSI, bidi
# override and isolate (a file name read backwards).
ESC = "\x1b"
STEERING_STEP = f"issue_credit{ESC}[2J{ESC}]0;pwned{ESC}\\{ESC}]8;;https://evil.example/{ESC}\\x"
STEERING_TOOL = f"reverse_credit{ESC}[8m hidden{ESC}[0m"
STEERING_ERROR = f"Boom{ESC}[2K\rfake: all good\x9b31m"
STEERING_SAGA = "refund[bold]\u202egnp.exe"
STEERING_DESCRIPTION = "reverse\u2067 it\x7f"


def steering_run(**kw: Any) -> RunScript:
    """A compensation_failed run whose every agent-sent text carries terminal controls."""
    r = RunScript(saga=STEERING_SAGA, **kw)
    comp = (STEERING_TOOL, {f"credit{ESC}[1mid": "cr_1"}, STEERING_DESCRIPTION)
    r.do(0, STEERING_STEP, "compensable", comp=comp)
    r.do(1, "notify", "compensable", ok=False, error=STEERING_ERROR)
    stack = [{"step": STEERING_STEP, "index": 0, "tool": comp[0], "args": comp[1],
              "description": comp[2]}]  # fmt: skip
    r.unwind(STEERING_ERROR, "notify", stack)
    r.compensate(0, STEERING_STEP, comp[0], comp[1], ok=False, error=STEERING_ERROR)
    return r.end(sc.STATUS_COMPENSATION_FAILED, "notify")


def steering(text: str) -> list[str]:
    """The characters of ``text`` that a terminal obeys or that reorder what it shows."""
    return [
        c
        for c in text
        if (ord(c) < 0x20 and c not in "\n\t")
        or 0x7F <= ord(c) < 0xA0
        or 0x202A <= ord(c) <= 0x202E
        or 0x2066 <= ord(c) <= 0x2069
    ]


def open_run(**kw: Any) -> RunScript:
    """A run whose process went away after two steps: no run span."""
    r = RunScript(**kw)
    r.do(0, "lookup_order", "read")
    r.do(1, "issue_credit", "compensable", comp=CREDIT)
    return r


def heartbeat_spans(
    instance: str,
    open_runs: Sequence[str],
    at: float,
    interval: float = 1.0,
    resource: dict[str, Any] | None = None,
    beat: int | None = None,
    parts: int = 1,
) -> list[ReadableSpan]:
    """One heartbeat span at ``at``; with ``beat``, a part of that beat (of ``parts``)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource(resource)
        if resource is not None
        else Resource.create({sc.SERVICE_NAME: "refund-agent", sc.SERVICE_INSTANCE_ID: instance})
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("hb").start_span(
        sc.HEARTBEAT_SPAN_NAME,
        start_time=int(at * NS),
        attributes={
            sc.SAGA_PHASE: sc.PHASE_HEARTBEAT,
            sc.SAGA_CONTRACT_VERSION: sc.CONTRACT_VERSION,
            sc.SAGA_HEARTBEAT_OPEN_RUNS: list(open_runs),
            sc.SAGA_HEARTBEAT_INTERVAL_S: interval,
            **(
                {}
                if beat is None
                else {sc.SAGA_HEARTBEAT_BEAT: beat, sc.SAGA_HEARTBEAT_PARTS: parts}
            ),
        },
    )
    span.end(end_time=int(at * NS))
    return list(exporter.get_finished_spans())


def rejoin(span: ReadableSpan, run: RunScript, *, token: int) -> ReadableSpan:
    """A recoverer's span: in the run's own trace, with its lease token."""
    ctx = span.context
    return ReadableSpan(
        name=span.name,
        context=ctx.__class__(run.run.get_span_context().trace_id, ctx.span_id, False),
        resource=span.resource,
        attributes={**(span.attributes or {}), sc.SAGA_RECOVERY_TOKEN: token},
        start_time=span.start_time,
        end_time=span.end_time,
        status=span.status,
        events=span.events,
    )


class FakeClock:
    """The sidecar's wall clock in a test: moving ``now`` is time passing. ``step(by)`` is
    the host's clock being stepped (NTP, a VM resumed): the wall clock moves and no time
    passes, which ``steady`` (give it to the Sidecar as ``steady=clock.steady``) tells."""

    def __init__(self, now: float = 1_700_000_100.0) -> None:
        self.now = now
        self._stepped = 0.0

    def __call__(self) -> float:
        return self.now

    def steady(self) -> float:
        return self.now - self._stepped

    def step(self, by: float) -> None:
        self.now += by
        self._stepped += by


def database_clock_passes(sidecar: Sidecar, seconds: float) -> None:
    """On PostgreSQL the database's clock moves ``seconds`` on, as the test moves its fake
    clocks: the lease times stored there, which are kept on the database's clock (a
    replica reads them onto its own), move back by as much. Nothing on SQLite, where
    they are on the sidecar's clock, the fake one."""
    url = sidecar.settings.db_url
    if url is None:
        return
    with sql_on(url) as run:
        run(
            "UPDATE run_leases SET granted_at = granted_at - ?, expires_at = expires_at - ?, "
            "forced_at = forced_at - ?",
            [(seconds, seconds, seconds)],
        )


BOTH_BACKENDS = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)
"""``pytestmark = BOTH_BACKENDS``: the module's tests run on SQLite and on PostgreSQL."""

_POSTGRES: list[Databases] = []  # set by the backend fixture (conftest.py) on PostgreSQL


def use_postgres(databases: Databases | None) -> None:
    _POSTGRES[:] = [databases] if databases is not None else []


def db_for(path: Path) -> str:
    """What ``--db`` (or an Outbox) takes for the database a test calls ``path``: the path
    itself on SQLite, a database of its own on PostgreSQL."""
    return _POSTGRES[0].url_for(path) if _POSTGRES else str(path)


def settings_for(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "otlp_http_port": 0,
        "otlp_grpc_port": 0,
        "api_port": 0,
        "db_path": tmp_path / "sidecar.db",
    }
    merged = {**base, **kw}
    if _POSTGRES and "db_url" not in merged:
        merged["db_url"] = _POSTGRES[0].url_for(merged.pop("db_path"))
    return Settings(**merged)


def refuse_alert_writes(db: str, refuse: bool = True) -> None:
    """Make the database ``db`` (what :func:`db_for` gives) refuse every new alert row, as a
    full disk does, or (``refuse=False``) take them again: a trigger, from a session of its
    own, so the outbox meets a real refusal of its write (StoreError), not a stub."""
    if db.startswith("postgresql"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn:
            if refuse:
                conn.execute(
                    "CREATE FUNCTION refuse_alerts() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'could not extend file: No space left on "
                    "device'; END $$"
                )
                conn.execute(
                    "CREATE TRIGGER refuse_alerts BEFORE INSERT ON alert_outbox "
                    "FOR EACH ROW EXECUTE FUNCTION refuse_alerts()"
                )
            else:
                conn.execute("DROP TRIGGER refuse_alerts ON alert_outbox")
                conn.execute("DROP FUNCTION refuse_alerts()")
        return
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        if refuse:
            conn.execute(
                "CREATE TRIGGER refuse_alerts BEFORE INSERT ON alert_outbox "
                "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
            )
        else:
            conn.execute("DROP TRIGGER refuse_alerts")
    finally:
        conn.close()


async def export_http(sidecar: Sidecar, spans: Sequence[ReadableSpan], **kw: Any) -> Any:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(
        endpoint=f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces", timeout=10, **kw
    )
    try:
        return await asyncio.to_thread(exporter.export, list(spans))
    finally:
        exporter.shutdown()


async def export_grpc(sidecar: Sidecar, spans: Sequence[ReadableSpan], **kw: Any) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(
        endpoint=f"127.0.0.1:{sidecar.otlp_grpc_port}", insecure=True, timeout=10, **kw
    )
    try:
        return await asyncio.to_thread(exporter.export, list(spans))
    finally:
        exporter.shutdown()


def start_sidecar(db: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from sidecar._cli import main; main()",
            "serve",
            "--otlp-http-port",
            "0",
            "--otlp-grpc-port",
            "0",
            "--api-port",
            "0",
            "--db",
            db_for(db),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the sidecar exited before listening"
    ports = json.loads(line)
    assert ports["event"] == "sidecar.listening"
    return proc, ports
