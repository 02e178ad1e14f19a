"""Spans, log events and metrics of every kind of run, against the span contract.

Engine and observed() behaviours run in both modes (the ``mode`` fixture).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import Span, StatusCode
from saga_modes import Driver, refund_agent, run_refund, settle

from examples.refund_tools import refund_tools
from examples.release_saga import Release, release, validate_metadata
from examples.world import ServiceDown, World
from saga_otel import RetryPolicy, RunStatus, Step, observed, observed_run
from saga_otel import semconv as sc
from saga_otel.testing import Captured, FailureInjector, capture, contract_violations, span_attrs
from sidecar import RunState
from sidecar._otlp import extract

T = 1_700_000_100.0


@pytest.fixture
def cap() -> Captured:
    return capture()


def _one(cap: Captured, phase: str) -> dict[str, Any]:
    spans = cap.spans(phase=phase)
    assert len(spans) == 1, [s.name for s in spans]
    return dict(span_attrs(spans[0]))


async def test_completed_run_spans(cap: Captured, mode: Driver) -> None:
    report = await run_refund(mode, cap.saga("refund", tools=refund_tools(World())))
    assert report.status is RunStatus.COMPLETED
    spans = cap.spans()
    assert contract_violations(spans) == []
    run = _one(cap, "run")
    assert run[sc.SAGA_RUN_STATUS] == "completed"
    assert run[sc.SAGA_RUN_ID] == report.run_id
    assert sc.SAGA_RUN_FAILED_STEP not in run
    # One run is one trace, and the run id defaults to its trace id.
    trace_ids = {s.context.trace_id for s in spans}
    assert trace_ids == {int(report.run_id, 16)}
    run_span = cap.spans(phase="run")[0]
    dos = cap.spans(phase="do")
    assert [span_attrs(s)[sc.SAGA_STEP_INDEX] for s in dos] == [0, 1, 2, 3, 4]
    assert all(s.parent is not None and s.parent.span_id == run_span.context.span_id for s in dos)
    credit = span_attrs(dos[1])
    assert credit[sc.SAGA_STEP_CLASS] == "compensable"
    assert credit[sc.SAGA_COMPENSATION_TOOL] == "reverse_credit"
    assert json.loads(credit[sc.SAGA_COMPENSATION_ARGS]) == {"credit_id": "cr_9104_4921"}
    assert "reverse credit cr_9104_4921" in credit[sc.SAGA_COMPENSATION_DESCRIPTION]
    assert credit[sc.GEN_AI_OPERATION_NAME] == "execute_tool"
    assert credit[sc.GEN_AI_TOOL_NAME] == "issue_credit"
    reply = span_attrs(dos[3])
    assert reply[sc.SAGA_STEP_CLASS] == "irreversible"
    assert sc.SAGA_COMPENSATION_TOOL not in span_attrs(dos[0])  # reads push nothing
    assert cap.spans(phase="unwind") == []


def _two_runs_of_one_turn(cap: Captured, turn: Span, first: str, second: str) -> None:
    """Each run is the root of a trace of its own, its run id, linked to the agent's span."""
    assert first != second
    runs = cap.spans(phase="run")
    assert [span_attrs(s)[sc.SAGA_RUN_ID] for s in runs] == [first, second]
    for run_id, run in zip((first, second), runs, strict=True):
        assert run.parent is None
        assert run.context.trace_id == int(run_id, 16)
        assert [link.context for link in run.links] == [turn.get_span_context()]
        assert {s.context.trace_id for s in cap.spans(run_id=run_id)} == {run.context.trace_id}


def _sidecar_state(spans: list[ReadableSpan]) -> RunState:
    decoded = extract(encode_spans(spans))
    assert decoded.rejected == 0, decoded.errors
    state = RunState()
    state.apply(list(decoded.spans), T)
    return state


async def test_a_current_span_whose_context_raises_costs_the_run_its_link_only(
    cap: Captured, mode: Driver
) -> None:
    """The span current when a run begins is the user's: one whose context raises must
    not keep the run from opening (telemetry never breaks the agent). The run is a
    root without a link, and the error is counted."""
    from opentelemetry import trace

    class Broken(trace.NonRecordingSpan):
        def get_span_context(self) -> trace.SpanContext:
            raise RuntimeError("no context")

    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    with trace.use_span(Broken(trace.INVALID_SPAN_CONTEXT)):
        run = mode.run(saga)
        async with run:
            await run.call("issue_credit", order_id=1, amount=100)
    (span,) = cap.spans(phase="run")
    assert span.parent is None and not span.links
    assert run.report is not None and run.report.status is RunStatus.COMPLETED
    assert cap.metric(sc.M_TELEMETRY_ERRORS, kind="span") >= 1


async def test_runs_begun_in_one_agent_span_are_runs_of_their_own(
    cap: Captured, mode: Driver
) -> None:
    """Agent frameworks keep a span open around a turn. A run begun inside it must not
    take that span's trace (and so its trace id as run id): two runs of one turn would
    share a run id, their writes the same idempotency keys (the second run's credit a
    replay of the first's), and the sidecar would show the killed second run as the
    first's completed one: never orphaned, never recovered."""
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    with cap.provider.get_tracer("agent").start_as_current_span("agent turn") as turn:
        first = mode.run(saga)
        async with first:
            await first.call("issue_credit", order_id=1, amount=100)
        second = mode.run(saga)
        async with second:
            await second.call("issue_credit", order_id=2, amount=200)
            await second.call("issue_credit", order_id=3, amount=300)
            sent = cap.spans()  # all the sidecar gets if the agent is killed here
    assert [e["order_id"] for e in world.ledger] == [1, 2, 3]  # no key replayed another's
    _two_runs_of_one_turn(cap, turn, first.run_id, second.run_id)
    state = _sidecar_state(sent)
    assert sorted(state.run_ids()) == sorted([first.run_id, second.run_id])
    assert state.status(first.run_id) == sc.STATUS_COMPLETED
    assert state.status(second.run_id) == sc.STATE_RUNNING  # orphaned once its agent is silent
    stack = [c["args"] for c in state.stack(second.run_id) or []]
    assert stack == [{"credit_id": e["credit_id"]} for e in reversed(world.ledger[1:])]


async def test_observed_runs_begun_in_one_agent_span_are_runs_of_their_own(
    cap: Captured, mode: Driver
) -> None:
    """observed_run() opens its run span as the engine does: its own trace, linked."""
    world = World()
    kw: dict[str, Any] = {
        "saga": "refund",
        "tracer_provider": cap.provider,
        "registry": cap.registry,
        "logger": cap.logger,
    }
    step = observed(
        credit_step(mode, world),
        compensation=lambda i: {"credit_id": i.result["credit_id"]},
        **kw,
    )
    with cap.provider.get_tracer("agent").start_as_current_span("agent turn") as turn:
        with observed_run(**kw) as first:
            await settle(step.do(1, 100))
        with observed_run(**kw) as second:
            await settle(step.do(2, 200))
            sent = cap.spans()  # all the sidecar gets if the agent is killed here
    _two_runs_of_one_turn(cap, turn, first.run_id, second.run_id)
    state = _sidecar_state(sent)
    assert sorted(state.run_ids()) == sorted([first.run_id, second.run_id])
    assert state.status(first.run_id) == sc.STATUS_COMPLETED
    assert state.status(second.run_id) == sc.STATE_RUNNING
    stack = [c["args"] for c in state.stack(second.run_id) or []]
    assert stack == [{"credit_id": world.ledger[1]["credit_id"]}]


async def test_compensated_run_spans_logs_and_metrics(cap: Captured, mode: Driver) -> None:
    saga = cap.saga("refund", tools=refund_tools(World(mail_down=True)))
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.COMPENSATED
    assert contract_violations(cap.spans()) == []
    unwind = _one(cap, "unwind")
    assert unwind[sc.SAGA_RUN_FAILED_STEP] == "send_reply"
    assert unwind[sc.SAGA_UNWIND_REASON].startswith("ServiceDown: mail service")
    stack = json.loads(unwind[sc.SAGA_STACK])
    assert [c["tool"] for c in stack] == ["set_ticket_status", "reverse_credit"]
    assert set(stack[0]) == {"step", "index", "tool", "args", "description"}
    comps = cap.spans(phase="compensate")
    assert [span_attrs(s)[sc.SAGA_STEP_INDEX] for s in comps] == [2, 1]
    assert all(s.status.status_code is StatusCode.OK for s in comps)
    failed_do = [s for s in cap.spans(phase="do") if s.status.status_code is StatusCode.ERROR]
    assert len(failed_do) == 1
    assert failed_do[0].events[0].name == "exception"
    assert failed_do[0].events[0].attributes["exception.type"].endswith("ServiceDown")  # type: ignore[index]
    assert span_attrs(failed_do[0])[sc.ERROR_TYPE] == "ServiceDown"  # OpenTelemetry's error.type
    assert all(sc.ERROR_TYPE not in span_attrs(s) for s in comps)  # only on failures
    # the unwind span is emitted before the first compensation starts
    unwind_span = cap.spans(phase="unwind")[0]
    assert unwind_span.start_time is not None and comps[0].start_time is not None
    assert unwind_span.start_time <= comps[0].start_time
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == "compensated"

    m = cap.metric
    assert m("saga_runs_started_total", saga="refund") == 1
    assert m("saga_runs_finished_total", saga="refund", status="compensated") == 1
    assert m("saga_runs_in_progress", saga="refund") == 0
    assert m("saga_unwinds_total", saga="refund") == 1
    assert m("saga_compensations_total", saga="refund", step="issue_credit", outcome="ok") == 1
    assert m("saga_steps_total", saga="refund", step="send_reply", phase="do", outcome="error") == 1
    assert m("saga_step_duration_seconds_count", saga="refund", step="get_order", phase="do") == 1
    assert m("saga_pivots_total", saga="refund", step="send_reply") == 0

    finished = cap.events(sc.EV_STEP_FINISHED)
    assert len(finished) == 4 + 2  # four dos, two compensations
    failed = next(e for e in finished if e["outcome"] == "error")
    assert failed["error"].startswith("ServiceDown")
    assert set(failed) >= {"saga", "run_id", "step", "phase", "attempt", "duration_s"}
    assert failed["trace_id"] == report.run_id
    assert failed["span_id"] == format(failed_do[0].context.span_id, "016x")
    assert cap.events(sc.EV_UNWIND)[0]["failed_step"] == "send_reply"


async def test_compensation_failed_run_spans(cap: Captured, mode: Driver) -> None:
    injector = FailureInjector().fail("reverse_credit", phase="compensate")
    saga = cap.saga(
        "refund",
        tools=injector.wrap(refund_tools(World(mail_down=True))),
        retry=RetryPolicy(attempts=2),
        **mode.sleep_kwargs([]),
    )
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.COMPENSATION_FAILED
    assert contract_violations(cap.spans()) == []
    attempts = [
        (
            span_attrs(s)[sc.SAGA_STEP_INDEX],
            span_attrs(s)[sc.SAGA_STEP_ATTEMPT],
            s.status.status_code,
        )
        for s in cap.spans(phase="compensate")
    ]
    assert attempts == [(2, 1, StatusCode.OK), (1, 1, StatusCode.ERROR), (1, 2, StatusCode.ERROR)]
    assert [span_attrs(s).get(sc.ERROR_TYPE) for s in cap.spans(phase="compensate")] == [
        None,
        "InjectedFailure",
        "InjectedFailure",
    ]
    esc = _one(cap, "escalate")
    assert esc[sc.SAGA_ESCALATION_REASON] == "compensation_failed"
    card = json.loads(esc[sc.SAGA_ESCALATION_CARD])
    assert "reverse_credit" in card["not_undone"][0]
    assert cap.metric("saga_compensation_failures_total", saga="refund", step="issue_credit") == 1
    assert (
        cap.metric(
            "saga_step_retries_total", saga="refund", step="issue_credit", phase="compensate"
        )
        == 1
    )
    assert _one(cap, "run")[sc.SAGA_RUN_FAILED_STEP] == "send_reply"
    assert cap.events("saga.escalation")[0]["level"] == "error"


async def test_stuck_run_spans(cap: Captured, mode: Driver) -> None:
    saga = cap.saga("refund", tools=refund_tools(World(), close_fails=True))
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.STUCK
    assert contract_violations(cap.spans()) == []
    pivot = [s for s in cap.spans(phase="do") if span_attrs(s)[sc.SAGA_STEP_NAME] == "send_reply"]
    assert span_attrs(pivot[0])[sc.SAGA_STEP_CLASS] == "irreversible"
    assert cap.spans(phase="unwind") == [] and cap.spans(phase="compensate") == []
    assert _one(cap, "escalate")[sc.SAGA_ESCALATION_REASON] == "stuck"
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == "stuck"
    assert cap.metric("saga_stuck_runs_total", saga="refund") == 1
    assert cap.metric("saga_pivots_total", saga="refund", step="send_reply") == 1


async def test_rejected_run_spans(cap: Captured, mode: Driver) -> None:
    ctx = Release(World(), {"waterfall": []}, "x" * 100)
    if mode.is_async:
        report = await release(cap.saga("release"), ctx)
    else:  # the release plan's own validation, in a sync plan

        def noop(c: Any) -> None:
            pass

        steps = [
            Step("admob_mediation", do=noop, compensate=noop),
            Step("appstore_metadata", do=noop, compensate=noop, validate=validate_metadata),
        ]
        report = await mode.execute(cap.saga("release"), steps, ctx)
    assert report.status is RunStatus.REJECTED
    assert contract_violations(cap.spans()) == []
    v = cap.spans(phase="validate")
    assert len(v) == 1 and v[0].status.status_code is StatusCode.ERROR
    assert span_attrs(v[0])[sc.SAGA_STEP_NAME] == "appstore_metadata"
    run = _one(cap, "run")
    assert run[sc.SAGA_RUN_STATUS] == "rejected"
    assert run[sc.SAGA_RUN_FAILED_STEP] == "appstore_metadata"


async def test_broken_telemetry_never_changes_the_outcome(mode: Driver) -> None:
    class Boom:
        def __getattr__(self, name: str) -> Any:
            def fail(*a: Any, **k: Any) -> None:
                raise OSError("log sink gone")

            return fail

    class BadProvider:
        def get_tracer(self, *a: Any, **k: Any) -> Any:
            return self

        def start_span(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("tracer broken")

    cap = capture()
    world = World(mail_down=True)
    saga = cap.saga("refund", tools=refund_tools(world))
    saga.instr.log = Boom()
    saga.instr.tracer = BadProvider()
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.COMPENSATED
    assert isinstance(report.error, ServiceDown)
    assert world.balance(4921) == 0
    assert cap.metric("saga_telemetry_errors_total", kind="span") > 0


@pytest.mark.parametrize("run_id", [None, "run-1"])
async def test_spans_whose_every_method_raises_never_change_the_outcome(
    mode: Driver, run_id: str | None
) -> None:
    """A tracer whose spans raise, even when asked their ids: the run still opens, unwinds
    and closes, the agent gets its own exception, and the errors are counted."""
    from saga_otel import ToolRegistry, tool
    from saga_otel._heartbeat import open_run_ids

    class BrokenSpan:
        def __getattr__(self, name: str) -> Any:
            def fail(*a: Any, **k: Any) -> None:
                raise RuntimeError(f"span backend gone ({name})")

            return fail

    class BrokenTracer:
        def start_span(self, *a: Any, **k: Any) -> Any:
            return BrokenSpan()

    undone: list[int] = []

    @tool("compensable", compensate="undo_w", compensate_args=lambda i: {"id": i.result})
    def w(x: int) -> int:
        return x

    @tool("convergent")
    def undo_w(id: int) -> None:
        undone.append(id)

    cap = capture()
    saga = cap.saga("broken", tools=ToolRegistry([w, undo_w]))
    saga.instr.tracer = BrokenTracer()
    err = ValueError("the agent's own")
    run = mode.run(saga, run_id)
    with pytest.raises(ValueError) as info:
        async with run:
            await run.call("w", x=7)
            raise err
    assert info.value is err
    assert undone == [7]
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert run.report.trace_id == 0 and run.report.span_id == 0  # no ids could be read
    if run_id is not None:
        assert run.report.run_id == run_id
    assert run.report.run_id not in open_run_ids()
    assert cap.metric("saga_telemetry_errors_total", kind="span") > 0


async def test_a_failing_span_processor_and_metrics_never_change_the_outcome(
    mode: Driver,
) -> None:
    class Refusing(SpanProcessor):
        """An exporter's processor whose on_end raises (the SDK lets it out of span.end)."""

        def on_end(self, span: ReadableSpan) -> None:
            raise RuntimeError("exporter gone")

    class Broken:
        """A metric whose every call raises."""

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"metrics backend gone ({name})")

    cap = capture()
    cap.provider.add_span_processor(Refusing())
    world = World(mail_down=True)
    saga = cap.saga("refund", tools=refund_tools(world))
    live = saga.instr.metrics  # the count of swallowed errors stays real, to be read
    saga.instr.metrics = dataclasses.replace(
        live,
        **{f.name: Broken() for f in dataclasses.fields(live) if f.name != "telemetry_errors"},
    )
    run = mode.run(saga)
    with pytest.raises(ServiceDown) as info:
        async with run:
            await refund_agent(run)
    assert run.report is not None and run.report.error is info.value
    assert run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0
    assert cap.metric("saga_telemetry_errors_total", kind="span") > 0
    assert cap.metric("saga_telemetry_errors_total", kind="metric") > 0


def test_a_span_is_ended_even_when_recording_its_error_fails(
    cap: Captured, monkeypatch: pytest.MonkeyPatch
) -> None:
    from saga_otel import _telemetry
    from saga_otel._telemetry import Instrumentation

    def broken(span: Any, exc: BaseException) -> None:
        raise RuntimeError("cannot record")

    monkeypatch.setattr(_telemetry, "record_error", broken)
    instr = Instrumentation(
        "s", tracer_provider=cap.provider, registry=cap.registry, logger=cap.logger
    )
    err = ValueError("the step failed")
    with pytest.raises(ValueError) as info, instr.attempt(instr.start_run(), "do", "x", index=0):
        raise err
    assert info.value is err
    assert len(cap.spans(phase="do")) == 1  # exported, so ended: an open span is never sent
    assert cap.metric("saga_telemetry_errors_total", kind="span") == 1


# -- observed() on the user's own runner --------------------------------------------
class CreditStep:
    """A user's existing saga step, with do and compensate (sync)."""

    name = "issue_credit"

    def __init__(self, world: World) -> None:
        self.world = world
        self.credit: dict[str, Any] | None = None

    def do(self, order_id: int, amount: int) -> dict[str, Any]:
        self.credit = self.world.issue_credit(order_id, amount)
        return self.credit

    def compensate(self) -> None:
        assert self.credit is not None
        self.world.reverse_credit(self.credit["credit_id"])


class AsyncCreditStep(CreditStep):
    """The same step written async."""

    async def do(self, order_id: int, amount: int) -> dict[str, Any]:  # type: ignore[override]
        return CreditStep.do(self, order_id, amount)

    async def compensate(self) -> None:  # type: ignore[override]
        CreditStep.compensate(self)


def credit_step(mode: Driver, world: World) -> CreditStep:
    return AsyncCreditStep(world) if mode.is_async else CreditStep(world)


async def test_observed_step_object_and_function_match_the_engine(mode: Driver) -> None:
    # The engine's telemetry for: issue_credit ok, send_reply fails, unwind.
    engine_cap = capture()
    await run_refund(mode, engine_cap.saga("refund", tools=refund_tools(World(mail_down=True))))

    cap = capture()
    world = World(mail_down=True)
    kw: dict[str, Any] = {
        "saga": "refund",
        "tracer_provider": cap.provider,
        "registry": cap.registry,
        "logger": cap.logger,
    }
    step = observed(
        credit_step(mode, world),
        compensation=lambda i: {"credit_id": i.result["credit_id"]},
        **kw,
    )
    assert isinstance(step, CreditStep)  # same shape as the user's object

    def send_reply(ticket_id: str, body: str) -> None:
        """Send the customer a reply."""
        world.send_reply(ticket_id, body)

    send = observed(send_reply, step_class="irreversible", **kw)
    assert send.__name__ == "send_reply" and send.__doc__ == "Send the customer a reply."
    import inspect

    assert list(inspect.signature(send).parameters) == ["ticket_id", "body"]

    with pytest.raises(ServiceDown), observed_run(**kw):  # the user's own runner
        await settle(step.do(4921, 2500))
        try:
            send("T-9104", "hi")
        except ServiceDown:
            await settle(step.compensate())
            raise

    assert world.balance(4921) == 0
    assert contract_violations(cap.spans()) == []

    def shape(c: Captured, phase: str) -> list[tuple[str, str, Any]]:
        out = []
        for s in c.spans(phase=phase):
            a = span_attrs(s)
            if a.get(sc.SAGA_STEP_NAME) in ("issue_credit", "send_reply", None):
                out.append((s.name, a.get(sc.SAGA_STEP_CLASS, ""), s.status.status_code))
        return out

    assert shape(cap, "do") == [
        s
        for s in shape(engine_cap, "do")
        if s[0] != "saga.do get_order" and s[0] != "saga.do set_ticket_status"
    ]
    assert len(cap.spans(phase="unwind")) == 1
    # The unwind says why, as the engine's does: the failed step and its exception.
    for key in (sc.SAGA_UNWIND_REASON, sc.SAGA_RUN_FAILED_STEP):
        assert _one(cap, "unwind")[key] == _one(engine_cap, "unwind")[key], key
    assert _one(cap, "unwind")[sc.SAGA_UNWIND_REASON].startswith("ServiceDown: ")
    assert shape(cap, "run") == [("saga.run refund", "", StatusCode.ERROR)]
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == "compensated"
    comp = _one(cap, "compensate")
    assert json.loads(comp[sc.SAGA_COMPENSATION_ARGS]) == {
        "credit_id": world.ledger[0]["credit_id"]
    }
    # Same metric families and log events as the engine.
    for name in ("saga_runs_started_total", "saga_unwinds_total"):
        assert cap.metric(name, saga="refund") == engine_cap.metric(name, saga="refund") == 1
    assert (
        cap.metric("saga_compensations_total", saga="refund", step="issue_credit", outcome="ok")
        == 1
    )
    assert {e["event"] for e in cap.logs} >= {sc.EV_STEP_STARTED, sc.EV_STEP_FINISHED, sc.EV_UNWIND}


async def test_observed_plain_function_propagates_exceptions_unchanged(mode: Driver) -> None:
    cap = capture()
    err = ValueError("bad input")

    def flaky() -> None:
        raise err

    wrapped = observed(
        mode.fn(flaky),
        saga="s",
        tracer_provider=cap.provider,
        registry=cap.registry,
        logger=cap.logger,
    )
    with pytest.raises(ValueError) as info:
        await settle(wrapped())
    assert info.value is err
    span = cap.spans(phase="do")[0]
    assert span.status.status_code is StatusCode.ERROR
    assert contract_violations([span]) == []


def test_observed_rejects_what_it_cannot_wrap() -> None:
    from saga_otel import ConfigurationError

    with pytest.raises(ConfigurationError, match="needs an object with do"):
        observed(42, saga="s")


def test_the_library_never_writes_to_the_agents_stdout() -> None:
    """An agent's stdout is its own (often a protocol); telemetry goes to stderr."""
    import subprocess
    import sys

    code = (
        "import asyncio, saga_otel\n"
        "from examples.refund_agent import run_refund\n"
        "from examples.refund_tools import refund_tools\n"
        "from examples.world import World\n"
        "export = saga_otel.configure('http://127.0.0.1:9', ack_timeout=0.05)\n"
        "saga = saga_otel.Saga('refund', tools=refund_tools(World(mail_down=True)))\n"
        "print(asyncio.run(run_refund(saga)).status.value)\n"
        "export.shutdown(timeout=0.2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "compensated\n"  # the sidecar is down: failures went to stderr
    assert "saga.export.failed" in proc.stderr


async def test_observed_compensate_failure_ends_compensation_failed(mode: Driver) -> None:
    cap = capture()
    world = World(mail_down=True)
    kw: dict[str, Any] = {
        "saga": "refund",
        "tracer_provider": cap.provider,
        "registry": cap.registry,
        "logger": cap.logger,
    }

    def refuse() -> None:
        raise ConnectionError("ledger down")

    step = observed(credit_step(mode, world), **kw)
    undo = observed(mode.fn(refuse), step="issue_credit", phase="compensate", **kw)
    with pytest.raises(ConnectionError), observed_run(**kw):
        await settle(step.do(4921, 2500))
        await settle(undo())
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == "compensation_failed"
    assert _one(cap, "escalate")[sc.SAGA_ESCALATION_REASON] == "compensation_failed"
    assert len(cap.spans(phase="unwind")) == 1


@pytest.mark.parametrize("bad", ["datetime", "oversized", "raises"])
async def test_observed_undo_that_cannot_be_stored_is_marked(mode: Driver, bad: str) -> None:
    import datetime as dt

    cap = capture()
    world = World()
    kw: dict[str, Any] = {
        "saga": "refund",
        "tracer_provider": cap.provider,
        "registry": cap.registry,
        "logger": cap.logger,
    }

    def recipe(info: Any) -> dict[str, Any]:
        if bad == "raises":
            raise KeyError("credit_id")
        if bad == "datetime":
            return {"at": dt.datetime(2026, 1, 1)}
        return {"blob": "x" * 70_000}

    step = observed(credit_step(mode, world), compensation=recipe, **kw)
    with pytest.raises(RuntimeError), observed_run(**kw):
        result = await settle(step.do(4921, 2500))  # the user's step is never broken
        assert result["amount"] == 2500
        raise RuntimeError("the runner gives up without undoing")
    do = _one(cap, "do")
    assert do[sc.SAGA_COMPENSATION_UNSTORABLE]
    assert sc.SAGA_COMPENSATION_TOOL not in do
    assert len(world.ledger) == 1
    # The effect stands with no stored undo: never "compensated".
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == "compensation_failed"


async def test_tool_call_id_marks_the_do_spans_inside_it_only(cap: Captured) -> None:
    from saga_otel import tool_call_id

    saga = cap.saga("refund", tools=refund_tools(World()))
    async with saga.run() as run:
        with tool_call_id("call_7"):
            await run.call("get_order", order_id=4921)
        await run.call("get_order", order_id=4921)
    first, second = (span_attrs(s) for s in cap.spans(phase="do"))
    assert first[sc.GEN_AI_TOOL_CALL_ID] == "call_7"
    assert sc.GEN_AI_TOOL_CALL_ID not in second
    assert contract_violations(cap.spans()) == []


def test_repeated_attempts_keep_their_attributes_and_order(cap: Captured) -> None:
    """The common attempt's start attributes come from a per-step-kind template: they must
    be what the first attempt had (same keys, same order), follow the run's identity when
    it grows (recovery adds its token) and step aside for a tool call id."""
    from saga_otel import StepClass, tool_call_id
    from saga_otel._telemetry import Instrumentation

    instr = Instrumentation(
        "tmpl", tracer_provider=cap.provider, registry=cap.registry, logger=cap.logger
    )
    run = instr.start_run()

    def do(index: int, attempt: int) -> list[tuple[str, Any]]:
        with instr.attempt(
            run, "do", "s", index=index, attempt=attempt, tool="t", step_class=StepClass.COMPENSABLE
        ):
            pass
        return list((cap.exporter.get_finished_spans()[-1].attributes or {}).items())

    first = do(1, 1)
    again = do(2, 3)
    assert [k for k, _ in again] == [k for k, _ in first]
    assert dict(again)[sc.SAGA_STEP_INDEX] == 2 and dict(again)[sc.SAGA_STEP_ATTEMPT] == 3
    with tool_call_id("call_9"):
        marked = dict(do(1, 1))
    assert marked[sc.GEN_AI_TOOL_CALL_ID] == "call_9"
    assert sc.GEN_AI_TOOL_CALL_ID not in dict(do(1, 1))
    run.identity[sc.SAGA_RECOVERY_TOKEN] = 7
    assert dict(do(1, 1))[sc.SAGA_RECOVERY_TOKEN] == 7
    other = instr.start_run()
    run = other
    assert dict(do(1, 1))[sc.SAGA_RUN_ID] == other.run_id


def test_runs_on_many_threads_each_keep_their_own_identity_on_their_spans() -> None:
    """Runs of one saga on many threads at once (documented as supported): the per-step-kind
    attribute template they share must never give a step span another run's id.

    The race needs a thread switch inside the template's check-and-rebuild: every thread
    alternates two runs (so every attempt rebuilds), switches are made very frequent, and
    the rounds are repeated. A tracer of no cost gives each run span a trace of its own
    and notes, for each step span, its run id and the trace of the run it hangs from."""
    import random
    import sys
    import threading

    from opentelemetry.context import Context
    from opentelemetry.trace import (
        INVALID_SPAN,
        NonRecordingSpan,
        SpanContext,
        get_current_span,
    )
    from prometheus_client import CollectorRegistry

    from saga_otel._telemetry import Instrumentation

    class Tracer:
        def __init__(self) -> None:
            self.steps: list[tuple[str, str]] = []  # appended to: atomic, unlike a += count

        def start_span(
            self, name: str, context: Context | None = None, attributes: Any = None, **_: Any
        ) -> Span:
            if attributes is None:  # a run span; its trace id is its run's id
                ids = SpanContext(random.getrandbits(128), random.getrandbits(64), False)
                return NonRecordingSpan(ids)
            own = f"{get_current_span(context).get_span_context().trace_id:032x}"
            self.steps.append((own, attributes[sc.SAGA_RUN_ID]))
            return INVALID_SPAN

    class Quiet:
        """A logger that takes no events: the attempts are what the race needs time for."""

        def is_enabled_for(self, level: int) -> bool:
            return False

    def agent(instr: Instrumentation, attempts: int) -> None:
        runs = [instr.start_run(), instr.start_run()]
        for i in range(attempts):
            with instr.attempt(runs[i % 2], "do", "s", index=i, tool="t"):
                pass

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(5):
            instr = Instrumentation("race", registry=CollectorRegistry(), logger=Quiet())
            instr.tracer = tracer = Tracer()
            threads = [threading.Thread(target=agent, args=(instr, 3000)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(tracer.steps) == 8 * 3000  # the tracer saw every step (none failed)
            wrong = [(own, got) for own, got in tracer.steps if got != own]
            assert wrong == [], f"round {round_}: {len(wrong)} spans, another run's id"
    finally:
        sys.setswitchinterval(old)


class AsyncUndo:
    """A callable object whose ``__call__`` is ``async def``: observed() must await it."""

    async def __call__(self) -> None:
        raise ConnectionError("ledger down")


@pytest.mark.parametrize("make", [AsyncUndo, lambda: functools.partial(AsyncUndo())])
async def test_observed_awaits_a_callable_object_whose_call_is_async(make: Any) -> None:
    cap = capture()
    kw: dict[str, Any] = {
        "saga": "refund",
        "tracer_provider": cap.provider,
        "registry": cap.registry,
        "logger": cap.logger,
    }
    undo = observed(make(), step="issue_credit", phase="compensate", **kw)
    with pytest.raises(ConnectionError), observed_run(**kw):
        await undo()
    assert cap.spans(phase="compensate")[0].status.status_code is StatusCode.ERROR
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == "compensation_failed"


async def test_an_observed_sync_function_returning_an_awaitable_is_counted_not_broken() -> None:
    cap = capture()

    async def later() -> str:
        return "done"

    pending = later()

    def starts() -> Any:
        return pending  # a sync function handing back a coroutine: its outcome is unseen

    wrapped = observed(
        starts, saga="s", tracer_provider=cap.provider, registry=cap.registry, logger=cap.logger
    )
    out = wrapped()
    assert out is pending and await out == "done"  # the agent's value, unchanged
    assert cap.metric("saga_telemetry_errors_total", kind="observed_awaitable") == 1
    [event] = cap.events(sc.EV_TELEMETRY_ERROR)
    assert "'starts'" in event["error"] and "async def" in event["error"]


@pytest.mark.parametrize(("step_class", "status"), [("compensable", "compensation_failed"),
                                                   ("convergent", "compensated")])  # fmt: skip
async def test_an_observed_write_interrupted_before_it_returned_is_marked(
    mode: Driver, step_class: str, status: str
) -> None:
    """As in the engine: Ctrl-C during a compensable step's call may leave its effect
    with no undo, so the observed run ends compensation_failed, the do span marked; the
    interrupt propagates unchanged."""
    cap = capture()
    kw: dict[str, Any] = {
        "saga": "refund",
        "tracer_provider": cap.provider,
        "registry": cap.registry,
        "logger": cap.logger,
    }
    stop = KeyboardInterrupt("the person pressed Ctrl-C")

    def issue_credit(order_id: int) -> dict[str, Any]:
        raise stop

    step = observed(mode.fn(issue_credit), step_class=step_class, **kw)
    with pytest.raises(KeyboardInterrupt) as info, observed_run(**kw):
        await settle(step(4921))
    assert info.value is stop
    do = _one(cap, "do")
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == status
    if status == "compensation_failed":
        assert "interrupted by KeyboardInterrupt" in do[sc.SAGA_COMPENSATION_UNSTORABLE]
    else:
        assert sc.SAGA_COMPENSATION_UNSTORABLE not in do
    assert contract_violations(cap.spans()) == []


async def test_an_observed_interrupt_while_the_undo_is_built_is_marked(mode: Driver) -> None:
    """As in the engine: Ctrl-C inside the compensation recipe of a do that returned
    leaves the write standing with no undo, so the observed run ends compensation_failed,
    the do span OK and marked; the interrupt propagates unchanged."""
    cap = capture()
    world = World()
    kw: dict[str, Any] = {
        "saga": "refund",
        "tracer_provider": cap.provider,
        "registry": cap.registry,
        "logger": cap.logger,
    }
    stop = KeyboardInterrupt("the person pressed Ctrl-C")

    def recipe(info: Any) -> dict[str, Any]:
        raise stop

    step = observed(credit_step(mode, world), compensation=recipe, **kw)
    with pytest.raises(KeyboardInterrupt) as info, observed_run(**kw):
        await settle(step.do(4921, 2500))
    assert info.value is stop
    assert len(world.ledger) == 1  # the credit was issued
    do = cap.spans(phase="do")[0]
    assert do.status.is_ok
    assert "KeyboardInterrupt" in span_attrs(do)[sc.SAGA_COMPENSATION_UNSTORABLE]
    assert _one(cap, "run")[sc.SAGA_RUN_STATUS] == "compensation_failed"
    assert _one(cap, "escalate")[sc.SAGA_ESCALATION_REASON] == "compensation_failed"
    assert contract_violations(cap.spans()) == []
