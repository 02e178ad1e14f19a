"""The saga engine: refund and release scenarios, pivot rules, recovery, cancellation.

Each behaviour is written once and runs through the sync and the async driver
(the ``mode`` fixture); only what exists in one mode alone (asyncio
cancellation, concurrent calls within one run, threads) is written for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from saga_modes import Driver, refund_agent, run_refund

from examples.refund_tools import CloseDown, refund_tools
from examples.release_saga import RELEASE_STEPS, Release, release
from examples.world import ServiceDown, World
from saga_otel import (
    ConfigurationError,
    EscalationCard,
    RetryPolicy,
    RunStatus,
    SagaReport,
    Step,
    StepRefusedError,
    ToolRegistry,
    ValidationRejectedError,
    _acks,
    current_call,
    idempotency_key,
    observed_run,
    tool,
)
from saga_otel import semconv as sc
from saga_otel._heartbeat import open_run_ids
from saga_otel.testing import (
    Captured,
    FailureInjector,
    InjectedFailure,
    capture,
    contract_violations,
    span_attrs,
)


@pytest.fixture
def cap() -> Captured:
    return capture()


# -- refund scenario ------------------------------------------------------------
async def test_refund_completes_and_pushes_one_undo_per_reversible_write(
    cap: Captured, mode: Driver
) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    run = mode.run(saga)
    async with run:
        order = await run.call("get_order", order_id=4921)
        credit = await run.call("issue_credit", order_id=4921, amount=order["amount"])
        await run.call("set_ticket_status", ticket_id="T-9104", status="refunded")
        stack = run.stack
    assert [c.tool for c in stack] == ["set_ticket_status", "reverse_credit"]
    # The undo holds the reference the write returned, captured at that moment.
    assert stack[1].args == {"credit_id": credit["credit_id"]}
    assert stack[0].args == {"ticket_id": "T-9104", "status": "open"}
    assert run.report is not None and run.report.status is RunStatus.COMPLETED


async def test_mail_down_unwinds_in_reverse_with_a_reversing_ledger_entry(
    cap: Captured, mode: Driver
) -> None:
    world = World(mail_down=True)
    report = await run_refund(mode, cap.saga("refund", tools=refund_tools(world)))
    assert report.status is RunStatus.COMPENSATED
    assert report.failed_step == "send_reply"
    assert isinstance(report.error, ServiceDown)
    assert [o.compensation.tool for o in report.compensations] == [
        "set_ticket_status",
        "reverse_credit",
    ]
    # Compensation is not rollback: the original credit stays, a reversing entry follows.
    assert [e["amount"] for e in world.ledger] == [2500, -2500]
    assert world.ledger[1]["reverses"] == world.ledger[0]["credit_id"]
    assert world.balance(4921) == 0
    assert world.tickets["T-9104"] == "open"
    assert report.escalation_card() is None


async def test_runtime_api_reraises_the_agents_exception_unchanged(
    cap: Captured, mode: Driver
) -> None:
    world = World(mail_down=True)
    saga = cap.saga("refund", tools=refund_tools(world))
    run = mode.run(saga)
    with pytest.raises(ServiceDown) as info:
        async with run:
            await refund_agent(run)
    assert run.report is not None
    assert run.report.error is info.value
    assert run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_a_tool_raising_stop_iteration_reaches_the_agent_as_itself(
    cap: Captured, mode: Driver
) -> None:
    """A tool's StopIteration (next() on an empty iterator) used to reach a sync agent as
    RuntimeError("generator raised StopIteration"): the engine's scripts are generators
    (PEP 479). The agent gets its own object; its span records it. An async agent awaits
    a coroutine, which Python never lets raise StopIteration: it gets Python's
    RuntimeError with the object as its __cause__, as from any async function."""
    raised = StopIteration("no matching order")

    @tool("read")
    def find_order() -> None:
        raise raised

    saga = cap.saga("x", tools=[find_order])
    if mode.is_async:
        with pytest.raises(RuntimeError) as info:
            async with saga.run() as run:
                await run.call("find_order")
        assert type(info.value) is RuntimeError and info.value.__cause__ is raised
        assert run.report is not None
        assert str(run.report.steps[-1].error).startswith("StopIteration")
    else:  # not through the mode's async adapter: a coroutine would make it a RuntimeError
        with pytest.raises(StopIteration) as stopped, saga.run_sync() as sync_run:
            sync_run.call("find_order")
        assert stopped.value is raised and raised.__context__ is None
        assert sync_run.report is not None and sync_run.report.error is raised
        assert str(sync_run.report.steps[-1].error).startswith("StopIteration")
    (do,) = cap.spans(phase="do")
    assert span_attrs(do)[sc.ERROR_TYPE] == "StopIteration"


async def test_failed_compensation_is_retried_recorded_and_escalated(
    cap: Captured, mode: Driver
) -> None:
    world = World(mail_down=True)
    injector = FailureInjector().fail("reverse_credit", phase="compensate")
    escalations: list[EscalationCard] = []
    saga = cap.saga(
        "refund",
        tools=injector.wrap(refund_tools(world)),
        retry=RetryPolicy(attempts=3),
        escalation_handlers=[lambda card, report: escalations.append(card)],
        **mode.sleep_kwargs([]),
    )
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.COMPENSATION_FAILED
    failed = report.compensations_failed
    assert [o.compensation.tool for o in failed] == ["reverse_credit"]
    assert failed[0].attempts == 3
    # The unwind went on past the failure: the ticket was still put back.
    assert world.tickets["T-9104"] == "open"
    assert len(escalations) == 1
    text = escalations[0].render()
    assert "Could NOT be undone" in text and "reverse_credit" in text
    assert escalations[0].undone  # what was undone is on the card too


async def test_transient_compensation_failure_is_carried_by_retries(
    cap: Captured, mode: Driver
) -> None:
    world = World(mail_down=True)
    slept: list[float] = []
    injector = FailureInjector().fail("reverse_credit", phase="compensate", times=2)
    saga = cap.saga(
        "refund",
        tools=injector.wrap(refund_tools(world)),
        retry=RetryPolicy(attempts=4, initial=0.5, multiplier=2, jitter=0),
        **mode.sleep_kwargs(slept),
    )
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.COMPENSATED
    assert slept == [0.5, 1.0]  # exponential backoff through the injected sleep
    assert world.balance(4921) == 0


async def test_forward_retries_use_the_same_backoff(cap: Captured, mode: Driver) -> None:
    slept: list[float] = []
    calls = {"n": 0}

    @tool("convergent")
    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionError("backend blinked")
        return "ok"

    saga = cap.saga(
        "x",
        tools=[flaky],
        forward_retry=RetryPolicy(attempts=3, initial=0.25, multiplier=3, jitter=0),
        **mode.sleep_kwargs(slept),
    )
    async with mode.run(saga) as run:
        assert await run.call("flaky") == "ok"
    assert slept == [0.25, 0.75]
    assert run.report.steps[0].attempts == 3
    attempts = [span_attrs(s)[sc.SAGA_STEP_ATTEMPT] for s in cap.spans(phase="do")]
    assert attempts == [1, 2, 3]


async def test_interrupt_is_not_retried(cap: Captured, mode: Driver) -> None:
    calls = {"n": 0}

    @tool("convergent")
    def interrupted() -> None:
        calls["n"] += 1
        raise KeyboardInterrupt

    saga = cap.saga("x", tools=[interrupted], forward_retry=RetryPolicy(attempts=3))
    with pytest.raises(KeyboardInterrupt):
        async with mode.run(saga) as run:
            await run.call("interrupted")
    assert calls["n"] == 1


async def test_per_tool_retry_policy_overrides_the_sagas(cap: Captured, mode: Driver) -> None:
    world = World(mail_down=True)
    tools = refund_tools(world)
    base = tools.get("reverse_credit")
    custom = ToolRegistry()
    for name in tools:
        t = tools.get(name)
        if name == "reverse_credit":
            t = tool("convergent", retry=RetryPolicy(attempts=6, jitter=0))(base.fn)
        custom.register(t, name=name)
    injector = FailureInjector().fail("reverse_credit", phase="compensate", times=5)
    saga = cap.saga(
        "refund",
        tools=injector.wrap(custom),
        retry=RetryPolicy(attempts=2),
        **mode.sleep_kwargs([]),
    )
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.COMPENSATED
    assert report.compensations[-1].attempts == 6


async def test_failure_after_the_pivot_is_stuck_and_never_unwinds(
    cap: Captured, mode: Driver
) -> None:
    world = World()
    escalated: list[SagaReport] = []
    saga = cap.saga(
        "refund",
        tools=refund_tools(world, close_fails=True),
        escalation_handlers=[lambda card, report: escalated.append(report)],
    )
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.STUCK
    assert report.compensations == ()
    assert world.balance(4921) == 2500  # nothing was undone
    assert report.irreversible_steps == ("send_reply",)
    assert [p.tool for p in report.pending] == ["close_ticket"]
    assert escalated and escalated[0] is report
    card = report.escalation_card()
    assert card is not None and "send_reply" in card.render()


async def test_forward_recovery_completes_a_stuck_run_idempotently(
    cap: Captured, mode: Driver
) -> None:
    world = World()
    keys: list[str] = []
    attempts = {"n": 0}

    @tool("convergent")
    def close_ticket(ticket_id: str, idempotency_key: str) -> str:
        keys.append(idempotency_key)
        attempts["n"] += 1
        if attempts["n"] <= 2:
            raise CloseDown("still down")
        return world.set_ticket_status(ticket_id, "closed")

    base = refund_tools(world)
    tools = ToolRegistry()
    for name in base:
        tools.register(close_ticket if name == "close_ticket" else base.get(name), name=name)
    saga = cap.saga(
        "refund",
        tools=tools,
        recovery_retry=RetryPolicy(attempts=5, jitter=0),
        **mode.sleep_kwargs([]),
    )
    report = await run_refund(mode, saga)
    assert report.status is RunStatus.STUCK
    resumed = await mode.resume(saga, report)
    assert resumed.status is RunStatus.COMPLETED
    assert resumed.run_id == report.run_id
    assert world.tickets["T-9104"] == "closed"
    # Every attempt, first run and resumption alike, carried the same key.
    assert len(set(keys)) == 1 and keys[0] == idempotency_key(report.run_id, 4)
    assert len(world.outbox) == 1  # the reply was not sent twice


async def test_resume_refuses_a_run_that_is_not_stuck(cap: Captured, mode: Driver) -> None:
    saga = cap.saga("refund", tools=refund_tools(World(mail_down=True)))
    report = await run_refund(mode, saga)
    with pytest.raises(StepRefusedError, match="only a stuck run"):
        await mode.resume(cap.saga("refund", tools=refund_tools(World())), report)


# -- pivot rules -------------------------------------------------------------------
async def test_irreversible_call_is_refused_while_another_write_is_in_flight(
    cap: Captured,
) -> None:
    # Async only: two calls of one run in flight at once need an event loop.
    world = World()
    gate = asyncio.Event()
    sent: list[str] = []

    @tool("compensable", compensate="undo", compensate_args=lambda i: {"n": 1})
    async def slow_write() -> int:
        await gate.wait()
        return 1

    @tool("convergent")
    def undo(n: int) -> None:
        pass

    @tool("irreversible")
    def send(body: str) -> None:
        sent.append(body)

    saga = cap.saga("r", tools=[slow_write, undo, send])
    async with saga.run() as run:
        pending = asyncio.ensure_future(run.call("slow_write"))
        await asyncio.sleep(0)
        with pytest.raises(StepRefusedError, match="still in flight"):
            await run.call("send", body="hello")
        gate.set()
        await pending
        await run.call("send", body="hello")  # allowed once the write has settled
    assert sent == ["hello"]
    assert world.outbox == []


async def test_reversible_write_after_the_pivot_is_refused_unless_allowed(
    cap: Captured, mode: Driver
) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    with pytest.raises(StepRefusedError, match="allow_writes_after_pivot"):
        async with mode.run(saga) as run:
            await run.call("send_reply", ticket_id="T-9104", body="x")
            await run.call("issue_credit", order_id=4921, amount=1)
    assert world.ledger == []  # refused before any side effect
    lenient = cap.saga("refund", tools=refund_tools(world), allow_writes_after_pivot=True)
    async with mode.run(lenient) as run:
        await run.call("send_reply", ticket_id="T-9104", body="x")
        await run.call("issue_credit", order_id=4921, amount=1)
    assert len(world.ledger) == 1


# -- classes, records, registry ---------------------------------------------------
async def test_reads_and_convergent_writes_push_nothing(cap: Captured, mode: Driver) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    async with mode.run(saga) as run:
        await run.call("get_order", order_id=4921)
        await run.call("close_ticket", ticket_id="T-9104")
        assert run.stack == ()


async def test_unknown_compensation_tool_fails_loudly_not_silently(
    cap: Captured, mode: Driver
) -> None:
    @tool("compensable", compensate="gone", compensate_args=lambda i: {})
    def write() -> int:
        return 1

    saga = cap.saga("x", tools=[write])
    run = mode.run(saga)
    with pytest.raises(RuntimeError):
        async with run:
            await run.call("write")
            raise RuntimeError("boom")
    assert run.report is not None
    assert run.report.status is RunStatus.COMPENSATION_FAILED
    assert "no tool named 'gone'" in (run.report.compensations_failed[0].error or "")


def test_a_sync_run_refuses_async_tools_and_async_undos_before_any_write(
    cap: Captured,
) -> None:
    """A sync run cannot await: an async tool, or a sync write whose registered undo is
    async (every retry of that undo would fail in the unwind, after the write), is refused
    by name before the do runs, and nothing is pushed."""
    writes: list[str] = []

    @tool("compensable", compensate="refund_async", compensate_args=lambda i: {})
    def charge() -> None:
        writes.append("charge")

    @tool("convergent")
    async def refund_async() -> None:
        writes.append("refund")

    @tool("convergent")
    async def fetch() -> None:
        writes.append("fetch")

    saga = cap.saga("x", tools=[charge, refund_async, fetch])
    told = {"charge": "'refund_async', which is async", "fetch": "'fetch' is async"}
    for name, why in told.items():
        with pytest.raises(ConfigurationError, match=why) as info, saga.run_sync() as run:
            run.call(name)
        assert "async with saga.run()" in str(info.value)
        assert run.report is not None and run.report.compensations == ()
    assert writes == []


def test_a_run_id_the_sidecar_would_refuse_is_refused_before_the_run_opens(
    cap: Captured,
) -> None:
    """Such a run would be invisible to the sidecar (every span refused: no alert, no
    recovery), so the library refuses it where the id is given, naming the rule; no tool
    runs and nothing is emitted. None and "" still ask for a generated id."""
    writes: list[str] = []

    @tool("convergent")
    def touch() -> None:
        writes.append("touch")

    saga = cap.saga("x", tools=[touch])
    for bad, why in ((".", "dot segment"), ("..", "dot segment"), ("tab\there", "U+0009"),
                     ("x" * 257, "at most 256"), ("bidi\u202e", "U+202E")):  # fmt: skip
        why = re.escape(why)
        with pytest.raises(ConfigurationError, match=why) as info:
            saga.run_sync(bad)
        assert "pass a valid id" in str(info.value)
        with pytest.raises(ConfigurationError, match=why):
            saga.run(bad)
        with pytest.raises(ConfigurationError, match=why), observed_run("x", bad):
            writes.append("observed")
    assert writes == [] and cap.spans() == []
    for generated in (None, ""):
        with saga.run_sync(generated) as run:
            run.call("touch")
        assert run.report is not None and sc.run_id_problem(run.report.run_id) is None
    assert writes == ["touch", "touch"]


async def test_tools_see_their_call_context_and_idempotency_key(
    cap: Captured, mode: Driver
) -> None:
    seen: list[Any] = []

    @tool("convergent")
    def probe() -> None:
        seen.append(current_call())

    saga = cap.saga("x", tools=[probe])
    async with mode.run(saga) as run:
        await run.call("probe")
    assert seen[0].run_id == run.run_id
    assert seen[0].idempotency_key == f"{run.run_id}:0"
    assert current_call() is None


async def test_a_snapshot_is_frozen_when_read(cap: Captured, mode: Driver) -> None:
    """The read returns the stored object itself, which the write then mutates: the undo
    still restores the value read before the write."""
    ticket = {"status": "open"}

    def read(status: str) -> dict[str, str]:
        return ticket  # the live object, as an in-memory store or an ORM hands it out

    @tool(
        "reversible",
        compensate="restore",
        snapshot=read,
        compensate_args=lambda i: {"status": i.snapshot["status"]},
    )
    def set_status(status: str) -> dict[str, str]:
        ticket["status"] = status
        return ticket

    @tool("convergent")
    def restore(status: str) -> None:
        ticket["status"] = status

    run = mode.run(cap.saga("x", tools=[set_status, restore]))
    with pytest.raises(RuntimeError):
        async with run:
            await run.call("set_status", status="refunded")
            raise RuntimeError("a later step failed")
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert run.report.compensations[0].compensation.args == {"status": "open"}
    assert ticket == {"status": "open"}


async def test_a_snapshot_that_cannot_be_copied_is_refused_before_the_write(
    cap: Captured, mode: Driver
) -> None:
    writes: list[str] = []

    @tool("reversible", compensate="restore", snapshot=lambda: {"lock": threading.Lock()})
    def set_status() -> None:
        writes.append("set")

    saga = cap.saga("x", tools=[set_status, tool("convergent", name="restore")(lambda: None)])
    run = mode.run(saga)
    with pytest.raises(ConfigurationError, match=r"'set_status'.*cannot be copied.*plain data"):
        async with run:
            await run.call("set_status")
    assert writes == []


# -- fixed plans ---------------------------------------------------------------
async def test_release_completes(cap: Captured) -> None:
    world = World()
    ctx = Release(world, {"waterfall": ["c"]}, "New title")
    report = await release(cap.saga("release"), ctx)
    assert report.status is RunStatus.COMPLETED
    assert world.flags["new_feature"] is True
    assert report.pivot_step == "remote_config_flag"


async def test_release_pivot_failure_restores_snapshots(cap: Captured) -> None:
    world = World(flag_down=True)
    ctx = Release(world, {"waterfall": ["c"]}, "New title")
    report = await release(cap.saga("release"), ctx)
    assert report.status is RunStatus.COMPENSATED
    assert world.mediation == {"waterfall": ["a", "b"]}
    assert world.metadata == {"title": "Old title"}
    assert [o.compensation.step for o in report.compensations] == [
        "appstore_metadata",
        "admob_mediation",
    ]


async def test_release_validation_rejects_before_any_side_effect(cap: Captured) -> None:
    world = World()
    ctx = Release(world, {"waterfall": ["c"]}, "FREE MONEY for everyone")
    report = await release(cap.saga("release"), ctx)
    assert report.status is RunStatus.REJECTED
    assert report.failed_step == "appstore_metadata"
    assert report.steps == ()
    assert world.mediation == {"waterfall": ["a", "b"]}
    assert cap.spans(phase="do") == []


async def test_fixed_plan_unwinds_in_reverse(cap: Captured, mode: Driver) -> None:
    log: list[str] = []
    steps = [
        Step("a", do=lambda c: log.append("a"), compensate=lambda c: log.append("undo a")),
        Step("b", do=lambda c: log.append("b"), compensate=lambda c: log.append("undo b")),
        Step("c", do=lambda c: (_ for _ in ()).throw(ValueError("c broke"))),
    ]
    report = await mode.execute(cap.saga("plan"), steps)
    assert report.status is RunStatus.COMPENSATED
    assert log == ["a", "b", "undo b", "undo a"]
    assert isinstance(report.error, ValueError)


async def test_a_fixed_plan_step_raising_stop_iteration_is_reported_as_itself(
    cap: Captured, mode: Driver
) -> None:
    """A plan's steps run inside a generator (the plan body): a step's StopIteration
    left it as Python's RuntimeError (PEP 479), so the report, the run's unwind reason
    and its span said RuntimeError for what the step raised as StopIteration."""
    log: list[str] = []
    raised = StopIteration("no matching order")

    def find(c: Any) -> None:
        raise raised

    steps = [
        Step("a", do=lambda c: log.append("a"), compensate=lambda c: log.append("undo a")),
        Step("find", do=find),
    ]
    report = await mode.execute(cap.saga("plan"), steps)
    assert report.status is RunStatus.COMPENSATED
    assert log == ["a", "undo a"]
    assert report.error is raised
    assert str(report.steps[-1].error).startswith("StopIteration: no matching order")
    (unwind,) = cap.spans(phase="unwind")
    assert "StopIteration: no matching order" in str(span_attrs(unwind)[sc.SAGA_UNWIND_REASON])


async def test_fixed_plan_validation_rejects_before_any_do(cap: Captured, mode: Driver) -> None:
    log: list[str] = []

    def refuse(ctx: Any) -> None:
        raise ValueError("bad plan")

    steps = [
        Step("a", do=lambda c: log.append("a"), compensate=lambda c: log.append("undo a")),
        Step("b", do=lambda c: log.append("b"), validate=refuse, step_class="convergent"),
    ]
    report = await mode.execute(cap.saga("plan"), steps)
    assert report.status is RunStatus.REJECTED
    assert report.failed_step == "b"
    assert log == []


@pytest.mark.parametrize("part", ["do", "compensate", "validate"])
async def test_a_sync_plan_refuses_an_async_step_before_anything_runs(
    cap: Captured, mode: Driver, part: str
) -> None:
    """execute_sync cannot await: a plan with an async do, compensate or validate is
    refused by step and part before the run opens (an async undo used to fail every try
    in the unwind, after the write it was meant to undo). execute runs the same plan."""
    log: list[str] = []

    async def async_part(ctx: Any) -> None:
        log.append(f"async {part}")

    def reserve(ctx: Any) -> None:
        log.append("reserve")

    def release(ctx: Any) -> None:
        log.append("release")

    parts: dict[str, Any] = {"do": reserve, "compensate": release, "validate": None}
    parts[part] = async_part
    steps = [
        Step("hold", do=lambda c: log.append("hold"), compensate=lambda c: log.append("unhold")),
        Step("reserve", **parts),
        Step("charge", do=lambda c: (_ for _ in ()).throw(ValueError("card declined"))),
    ]
    saga = cap.saga("plan")
    if not mode.is_async:
        with pytest.raises(ConfigurationError) as info:
            saga.execute_sync(steps, {})
        why = str(info.value)
        assert f"step 'reserve' has an async {part}" in why and "await saga.execute" in why
        assert log == [] and cap.spans() == []  # refused before the run opened
        return
    report = await saga.execute(steps, {})
    assert report.status is RunStatus.COMPENSATED
    ran = {"do": "reserve", "compensate": "release", "validate": "async validate"}
    ran[part] = f"async {part}"
    checked = [ran["validate"]] if part == "validate" else []
    assert log == [*checked, "hold", ran["do"], ran["compensate"], "unhold"]


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("result", "bound"),
    [(["x" * 100] * 1000, None), (_nested(100_000), None), ({"id": "x" * 100}, 64)],
    ids=["over-64KiB", "too-deep-for-json", "over-the-sagas-bound"],
)
async def test_a_plan_steps_result_is_left_out_of_its_undo_when_it_cannot_be_kept(
    cap: Captured, mode: Driver, result: Any, bound: int | None
) -> None:
    """A fixed plan's compensate(ctx) never reads the step's result: one too large for
    max_undo_bytes or that JSON cannot encode is left out of the undo's record, and the
    step succeeds and is undone (it used to fail the run compensation_failed)."""
    log: list[str] = []
    steps = [
        Step("fetch", do=lambda c: result, compensate=lambda c: log.append("undo fetch")),
        Step("notify", do=lambda c: "sent"),
    ]
    saga = cap.saga("plan", **({"max_undo_bytes": bound} if bound else {}))
    report = await mode.execute(saga, steps, {})
    assert report.status is RunStatus.COMPLETED, report.error
    stored = report.steps[0].compensation
    assert stored is not None and stored.args == {}
    boom = Step("charge", do=lambda c: (_ for _ in ()).throw(ValueError("card declined")))
    report = await mode.execute(saga, [*steps, boom], {})
    assert report.status is RunStatus.COMPENSATED, report.error
    assert log == ["undo fetch"]


async def test_a_plan_step_that_returned_a_result_is_undone_with_its_ctx(
    cap: Captured, mode: Driver
) -> None:
    """The result kept in the undo's record is for people: compensate(ctx) is called
    with ctx alone (the record's result used to be passed to it as a keyword, and every
    try failed with TypeError)."""
    undone: list[Any] = []
    steps = [
        Step("reserve", do=lambda c: {"hold_id": "h_1"}, compensate=undone.append),
        Step("charge", do=lambda c: (_ for _ in ()).throw(ValueError("card declined"))),
    ]
    ctx = {"order": 4921}
    report = await mode.execute(cap.saga("plan"), steps, ctx)
    assert report.status is RunStatus.COMPENSATED, report.compensations
    assert undone == [ctx]
    stored = report.steps[0].compensation
    assert stored is not None and stored.args == {"result": {"hold_id": "h_1"}}


async def test_runtime_validation_rejects(cap: Captured, mode: Driver) -> None:
    sent: list[str] = []

    def check(body: str) -> None:
        if not body:
            raise ValueError("empty reply")

    send = tool("irreversible", name="send", validate=check)(lambda body: sent.append(body))
    saga = cap.saga("x", tools=[send])
    with pytest.raises(ValidationRejectedError, match="empty reply"):
        async with mode.run(saga, validate=[("send", {"body": ""})]) as run:
            await run.call("send", body="")
    assert sent == []
    async with mode.run(saga, validate=[("send", {"body": "hi"})]) as run:
        await run.call("send", body="hi")
    assert sent == ["hi"]


# -- cancellation, interrupts, concurrency ---------------------------------------------
async def test_cancelled_task_still_unwinds_with_shielded_compensations(cap: Captured) -> None:
    # Async only: task cancellation exists only on an event loop.
    world = World()
    started = asyncio.Event()
    undone = asyncio.Event()

    @tool("convergent")
    async def reverse_credit(credit_id: str, idempotency_key: str) -> None:
        await asyncio.sleep(0.01)  # a cancellation arriving here must not cut the undo
        world.reverse_credit(credit_id, idempotency_key)
        undone.set()

    base = refund_tools(world)
    tools = ToolRegistry()
    for name in base:
        tools.register(reverse_credit if name == "reverse_credit" else base.get(name), name=name)
    saga = cap.saga("refund", tools=tools)
    holder: dict[str, Any] = {}

    async def agent() -> None:
        run = saga.run()
        holder["run"] = run
        async with run:
            await run.call("issue_credit", order_id=4921, amount=2500)
            started.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(agent())
    await started.wait()
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()  # a second cancel during the unwind
    with pytest.raises(asyncio.CancelledError):
        await task
    assert undone.is_set()
    assert world.balance(4921) == 0
    assert holder["run"].report.status is RunStatus.COMPENSATED


async def test_keyboard_interrupt_unwinds_before_propagating(cap: Captured, mode: Driver) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    run = mode.run(saga)
    with pytest.raises(KeyboardInterrupt):
        async with run:
            await run.call("issue_credit", order_id=4921, amount=2500)
            raise KeyboardInterrupt
    assert world.balance(4921) == 0
    assert run.report is not None and run.report.failed_step == "(agent)"


def test_many_runs_in_threads_share_no_state(cap: Captured) -> None:
    # Sync driver: one run per thread.
    world = World(
        orders={i: {"order_id": i, "amount": i, "ticket_id": "T-9104"} for i in range(40)}
    )
    world.tickets = {"T-9104": "open"}
    saga = cap.saga("refund", tools=refund_tools(world))
    reports: list[SagaReport] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        run = saga.run_sync()
        try:
            with run:
                run.call("issue_credit", order_id=i, amount=i + 1)
                if i % 2:
                    raise InjectedFailure("odd runs fail")
        except InjectedFailure:
            pass
        with lock:
            reports.append(run.report)  # type: ignore[arg-type]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.run_id for r in reports}) == 40
    for i in range(40):
        assert world.balance(i) == (0 if i % 2 else i + 1)
    for r in reports:
        # each report holds only its own run's compensations
        assert all(o.compensation.index == 0 for o in r.compensations)


async def test_many_runs_in_tasks_share_no_state(cap: Captured) -> None:
    # Async driver: one run per task.
    world = World(mail_down=True)
    saga = cap.saga("refund", tools=refund_tools(world))
    reports = await asyncio.gather(*(run_refund(Driver("async"), saga) for _ in range(25)))
    assert {r.status for r in reports} == {RunStatus.COMPENSATED}
    assert len({r.run_id for r in reports}) == 25
    assert world.balance(4921) == 0
    assert all(len(r.compensations) == 2 for r in reports)


def test_release_steps_are_ordered_pivot_last() -> None:
    assert [s.pivot for s in RELEASE_STEPS] == [False, False, True]


# -- a compensation that raises a BaseException (issue 12, point 7) ----------------
class Meltdown(BaseException):
    """A custom BaseException, as some libraries raise for fatal conditions."""


def _three_writes(log: list[str], undo_b: Any) -> list[Any]:
    """write_a, write_b, write_c, each undone by undo_<x>; undo_b is the one given."""
    tools: list[Any] = []
    for name in "abc":

        def write(name: str = name) -> int:
            log.append(name)
            return 1

        tools.append(
            tool(
                "compensable",
                name=f"write_{name}",
                compensate=f"undo_{name}",
                compensate_args=lambda i: {"n": 1},
            )(write)
        )

        def undo(n: int, name: str = name) -> None:
            log.append(f"undo {name}")

        tools.append(tool("convergent", name=f"undo_{name}")(undo_b if name == "b" else undo))
    return tools


@pytest.mark.parametrize("raised", [Meltdown, KeyboardInterrupt, SystemExit])
async def test_a_base_exception_in_a_compensation_still_unwinds_and_pages(
    cap: Captured, mode: Driver, raised: type[BaseException]
) -> None:
    log: list[str] = []
    escalations: list[EscalationCard] = []

    def undo_b_raises(n: int) -> None:
        log.append("undo b (raising)")
        raise raised("compensation blew up")

    saga = cap.saga(
        "x",
        tools=_three_writes(log, undo_b_raises),
        retry=RetryPolicy(attempts=3),
        escalation_handlers=[lambda card, report: escalations.append(card)],
    )
    agent_error = InjectedFailure("the agent failed")
    run = mode.run(saga)
    with pytest.raises(raised) as info:
        async with run:
            await run.call("write_a")
            await run.call("write_b")
            await run.call("write_c")
            raise agent_error
    # Every remaining undo ran, top first; the raising one was not retried.
    assert log == ["a", "b", "c", "undo c", "undo b (raising)", "undo a"]
    # The run ended with a status that pages, before the exception propagated.
    report = run.report
    assert report is not None and report.status is RunStatus.COMPENSATION_FAILED
    assert [o.compensation.tool for o in report.compensations_failed] == ["undo_b"]
    assert report.compensations_failed[0].attempts == 1
    assert report.error is agent_error
    assert len(escalations) == 1 and "undo_b" in escalations[0].render()
    run_span = cap.spans(phase="run")
    assert len(run_span) == 1 and run_span[0].end_time is not None
    assert span_attrs(run_span[0])[sc.SAGA_RUN_STATUS] == "compensation_failed"
    # The agent's own error is kept as the cause.
    assert info.value.__cause__ is agent_error


async def test_base_exception_in_a_compensation_of_a_fixed_plan(
    cap: Captured, mode: Driver
) -> None:
    log: list[str] = []

    def boom(ctx: Any) -> None:
        raise Meltdown("undo b")

    steps = [
        Step("a", do=lambda c: log.append("a"), compensate=lambda c: log.append("undo a")),
        Step("b", do=lambda c: log.append("b"), compensate=boom),
        Step("c", do=lambda c: (_ for _ in ()).throw(ValueError("c broke"))),
    ]
    with pytest.raises(Meltdown) as info:
        await mode.execute(cap.saga("plan", retry=RetryPolicy(attempts=1)), steps)
    assert log == ["a", "b", "undo a"]
    assert isinstance(info.value.__cause__, ValueError)
    assert span_attrs(cap.spans(phase="run")[0])[sc.SAGA_RUN_STATUS] == "compensation_failed"


# -- an undo that cannot be stored (issue 12, point 5) -----------------------------
class _Opaque:
    """Not JSON: an object a tool might return as its handle."""


@pytest.mark.parametrize(
    ("result", "why"),
    [
        ({"credit_id": "cr_1", "at": _dt.datetime(2026, 1, 1)}, "JSON"),
        ({"credit_id": "cr_1", "handle": _Opaque()}, "JSON"),
        ({"credit_id": "cr_1", "blob": "x" * 70_000}, "max_undo_bytes"),
    ],
    ids=["datetime", "object", "oversized"],
)
async def test_an_undo_that_cannot_be_stored_fails_loudly_and_never_reads_compensated(
    cap: Captured, mode: Driver, result: dict[str, Any], why: str
) -> None:
    calls = {"issue": 0, "hold": 0, "release": 0}
    escalations: list[EscalationCard] = []

    @tool("compensable", compensate="release_hold", compensate_args=lambda i: {"h": 1})
    def place_hold() -> int:
        calls["hold"] += 1
        return 1

    @tool("convergent")
    def release_hold(h: int) -> None:
        calls["release"] += 1

    @tool("compensable", compensate="reverse_credit", compensate_args=lambda i: i.result)
    def issue_credit() -> dict[str, Any]:
        calls["issue"] += 1
        return result

    @tool("convergent")
    def reverse_credit(**kw: Any) -> None:
        raise AssertionError("never stored, so never run")

    saga = cap.saga(
        "refund",
        tools=[place_hold, release_hold, issue_credit, reverse_credit],
        forward_retry=RetryPolicy(attempts=3, jitter=0, initial=0),
        escalation_handlers=[lambda card, report: escalations.append(card)],
    )
    run = mode.run(saga)
    with pytest.raises(ConfigurationError, match=why) as info:
        async with run:
            await run.call("place_hold")
            await run.call("issue_credit")
            raise AssertionError("the push failed loudly: never reached")
    assert "reverse_credit" in str(info.value) and "issue_credit" in str(info.value)
    assert calls == {"issue": 1, "hold": 1, "release": 1}  # the do was not retried
    report = run.report
    assert report is not None
    assert report.status is RunStatus.COMPENSATION_FAILED
    assert report.failed_step == "issue_credit"
    credit = report.steps[1]
    assert credit.ok and credit.compensation is None and credit.undo_error is not None
    assert [o.compensation.tool for o in report.compensations] == ["release_hold"]
    card = escalations[0]
    text = card.render()
    assert "issue_credit" in text and "reverse_credit" in text and why in text
    dos = cap.spans(phase="do")
    marked = [span_attrs(s).get(sc.SAGA_COMPENSATION_UNSTORABLE) for s in dos]
    assert marked[0] is None and why in (marked[1] or "")
    assert sc.SAGA_COMPENSATION_TOOL not in span_attrs(dos[1])
    assert len(dos) == 2  # one attempt each


async def test_max_undo_bytes_is_a_saga_parameter(cap: Captured, mode: Driver) -> None:
    @tool("compensable", compensate="undo", compensate_args=lambda i: {"blob": "x" * 100})
    def write() -> None:
        pass

    saga = cap.saga("x", tools=[write, tool("convergent", name="undo")(lambda blob: None)])
    async with mode.run(saga) as run:
        await run.call("write")  # 64 KiB by default: fine
    small = cap.saga("x", tools=saga.tools, max_undo_bytes=50)
    with pytest.raises(ConfigurationError, match="max_undo_bytes=50"):
        async with mode.run(small) as run:
            await run.call("write")
    with pytest.raises(ConfigurationError, match="max_undo_bytes=0"):
        cap.saga("x", max_undo_bytes=0)


async def test_a_long_run_unwinds_without_deep_recursion(cap: Captured, mode: Driver) -> None:
    undone: list[int] = []

    @tool("compensable", compensate="undo", compensate_args=lambda i: {"n": i.result})
    def write(n: int) -> int:
        return n

    @tool("convergent")
    def undo(n: int) -> None:
        undone.append(n)

    saga = cap.saga("long", tools=[write, undo])
    run = mode.run(saga)
    with pytest.raises(InjectedFailure):
        async with run:
            for n in range(1200):  # more steps than Python's default recursion limit
                await run.call("write", n=n)
            raise InjectedFailure("late")
    assert undone == list(reversed(range(1200)))
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED


# -- an interrupt or a cancellation at any moment still closes the run ----------------
def _run_ended(cap: Captured, run_id: str) -> None:
    """The run's span was exported (so ended) once, and the process no longer holds it open."""
    assert len(cap.spans(phase="run", run_id=run_id)) == 1
    assert run_id not in open_run_ids()


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_cancellation_during_validation_closes_the_run_and_propagates(
    cap: Captured, how: str
) -> None:
    # Async only: a cancellation arrives while an async validate awaits.
    started = asyncio.Event()

    async def check() -> None:
        started.set()
        await asyncio.Event().wait()  # never answers

    @tool("compensable", compensate="undo", compensate_args=lambda i: {}, validate=check)
    async def write() -> None:
        raise AssertionError("never reached: the validation did not pass")

    @tool("convergent")
    async def undo() -> None:
        pass

    run = cap.saga("x", tools=[write, undo]).run(validate=[("write", {})])
    holder: dict[str, Any] = {}

    async def agent() -> None:
        async with asyncio.timeout(None) as deadline:
            holder["deadline"] = deadline
            async with run:
                await run.call("write")

    task = asyncio.ensure_future(agent())
    await started.wait()
    if how == "cancel":
        task.cancel()
    else:
        holder["deadline"].reschedule(asyncio.get_running_loop().time())
    with pytest.raises(asyncio.CancelledError if how == "cancel" else TimeoutError):
        await task
    assert run.report is not None and run.report.status is RunStatus.REJECTED
    assert run.report.steps == () and run.report.failed_step == "write"
    assert [s.end_time is not None for s in cap.spans(phase="validate")] == [True]
    _run_ended(cap, run.run_id)


class Unprintable(Exception):
    """An exception whose text cannot be had: its __str__ raises."""

    def __str__(self) -> str:
        raise ValueError("no text")


@pytest.mark.parametrize("where", ["tool", "agent"])
async def test_an_exception_whose_str_raises_unwinds_and_propagates_unchanged(
    cap: Captured, mode: Driver, where: str
) -> None:
    log: list[str] = []
    err = Unprintable("x")

    def fails() -> None:
        raise err

    tools = [
        *_three_writes(log, lambda n: log.append("undo b")),
        tool("convergent", name="fails")(mode.fn(fails)),
    ]
    run = mode.run(cap.saga("x", tools=tools))
    with pytest.raises(Unprintable) as info:
        async with run:
            await run.call("write_a")
            await run.call("write_b")
            if where == "tool":
                await run.call("fails")
            raise err
    assert info.value is err  # the same object, not an error raised while describing it
    assert log == ["a", "b", "undo b", "undo a"]
    report = run.report
    assert report is not None and report.status is RunStatus.COMPENSATED
    assert report.error is err
    assert report.failed_step == ("fails" if where == "tool" else "(agent)")
    # Every span the run started was ended (exported): the failed do's too.
    assert len(cap.spans(phase="do")) == (3 if where == "tool" else 2)
    assert len(cap.spans(phase="compensate")) == 2 and len(cap.spans(phase="unwind")) == 1
    if where == "tool":
        failed = cap.spans(phase="do")[-1]
        assert failed.status.description == "Unprintable: <exception str() failed>"
    _run_ended(cap, run.run_id)


@pytest.mark.parametrize("at", ["unwind", "compensate"])
async def test_an_interrupt_while_waiting_for_an_ack_still_runs_every_undo(
    cap: Captured, mode: Driver, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    # Ctrl-C while the unwind waits for the sidecar: on the unwind's own span, or on the
    # first undo's.
    interrupted: list[Any] = []

    def ack(span: Any) -> bool:
        attrs = getattr(span, "attributes", None) or {}
        if not interrupted and attrs.get(sc.SAGA_PHASE) == at:
            interrupted.append(span)
            raise KeyboardInterrupt
        return True

    async def ack_async(span: Any) -> bool:
        return ack(span)

    monkeypatch.setattr(_acks, "wait_for_ack", ack)
    monkeypatch.setattr(_acks, "wait_for_ack_async", ack_async)
    log: list[str] = []
    saga = cap.saga("x", tools=_three_writes(log, lambda n: log.append("undo b")))
    agent_error = InjectedFailure("the agent failed")
    run = mode.run(saga)
    with pytest.raises(KeyboardInterrupt) as info:
        async with run:
            await run.call("write_a")
            await run.call("write_b")
            await run.call("write_c")
            raise agent_error
    assert len(interrupted) == 1
    assert log == ["a", "b", "c", "undo c", "undo b", "undo a"]
    report = run.report
    assert report is not None
    # Every undo ran and succeeded; only a wait for its acknowledgement was cut short.
    assert report.status is RunStatus.COMPENSATED
    assert report.error is agent_error and info.value.__cause__ is agent_error
    _run_ended(cap, run.run_id)


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_cancellation_during_an_errors_unwind_propagates_after_it(
    cap: Captured, how: str
) -> None:
    # Async only. The agent fails; while its unwind runs, the task is cancelled (or its
    # timeout expires): the unwind finishes, then the cancellation is delivered.
    log: list[str] = []
    undoing = asyncio.Event()
    gate = asyncio.Event()

    async def slow_undo_b(n: int) -> None:
        undoing.set()
        await gate.wait()
        log.append("undo b")

    saga = cap.saga("x", tools=_three_writes(log, slow_undo_b))
    run = saga.run()
    agent_error = InjectedFailure("the agent failed")
    holder: dict[str, Any] = {}

    async def agent() -> None:
        async with asyncio.timeout(None) as deadline:
            holder["deadline"] = deadline
            async with run:
                await run.call("write_a")
                await run.call("write_b")
                await run.call("write_c")
                raise agent_error

    task = asyncio.ensure_future(agent())
    await undoing.wait()
    if how == "cancel":
        task.cancel()
    else:
        holder["deadline"].reschedule(asyncio.get_running_loop().time())
    # The timeout's callback runs on a later loop turn, and no event marks it.
    while not task.cancelling():  # noqa: ASYNC110
        await asyncio.sleep(0)
    gate.set()
    with pytest.raises(asyncio.CancelledError if how == "cancel" else TimeoutError):
        await task
    assert task.cancelled() is (how == "cancel")
    assert log == ["a", "b", "c", "undo c", "undo b", "undo a"]
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert run.report.error is agent_error
    _run_ended(cap, run.run_id)


async def test_an_escalation_handler_that_raises_never_leaves_the_run_open(
    cap: Captured, mode: Driver
) -> None:
    def undo_b_fails(n: int) -> None:
        raise InjectedFailure("ledger down")  # the run ends compensation_failed: it pages

    def pager_down(card: EscalationCard, report: SagaReport) -> None:
        raise RuntimeError("pager down")

    def exits(card: EscalationCard, report: SagaReport) -> None:
        raise SystemExit(3)

    agent_error = ValueError("the agent failed")

    async def fail(run: Any) -> None:
        async with run:
            await run.call("write_a")
            await run.call("write_b")
            raise agent_error

    def saga(handlers: list[Any]) -> Any:
        return cap.saga(
            "x",
            tools=_three_writes([], undo_b_fails),
            retry=RetryPolicy(attempts=1),
            escalation_handlers=handlers,
        )

    # An Exception from a handler is swallowed and counted; the next handler still pages.
    paged: list[EscalationCard] = []
    run = mode.run(saga([pager_down, lambda card, report: paged.append(card)]))
    with pytest.raises(ValueError) as info:
        await fail(run)
    assert info.value is agent_error and len(paged) == 1
    assert cap.metric("saga_telemetry_errors_total", kind="escalation_handler") == 1
    _run_ended(cap, run.run_id)
    # A handler's interrupt propagates, but only once the run has ended.
    run = mode.run(saga([exits]))
    with pytest.raises(SystemExit):
        await fail(run)
    assert run.report is not None and run.report.status is RunStatus.COMPENSATION_FAILED
    _run_ended(cap, run.run_id)
    [run_span] = cap.spans(phase="run", run_id=run.run_id)
    assert span_attrs(run_span)[sc.SAGA_RUN_STATUS] == "compensation_failed"


# -- a write interrupted before it returned ---------------------------------------
@pytest.mark.parametrize(
    ("step_class", "pivot", "status"),
    [
        ("compensable", False, RunStatus.COMPENSATION_FAILED),
        ("irreversible", False, RunStatus.COMPENSATION_FAILED),
        ("convergent", True, RunStatus.COMPENSATION_FAILED),  # a declared pivot
        ("convergent", False, RunStatus.COMPENSATED),  # nothing it could leave to undo
        ("read", False, RunStatus.COMPENSATED),
    ],
)
async def test_a_write_interrupted_before_it_returned_is_never_called_compensated(
    cap: Captured, mode: Driver, step_class: str, pivot: bool, status: RunStatus
) -> None:
    """Ctrl-C (or a cancellation) stops the agent's wait, not the write: a compensable or
    pivot step stopped before it returned may have taken effect with no undo stored. The
    run still unwinds what it pushed, then ends compensation_failed and escalates, the do
    span marked; the interrupt propagates unchanged. A tool's own exception is not this:
    it says the write did not happen."""
    undone: list[str] = []

    @tool("compensable", compensate="undo", compensate_args=lambda i: {"ref": i.result})
    def first() -> str:
        return "ref-1"

    @tool("convergent")
    def undo(ref: str) -> None:
        undone.append(ref)

    @tool(step_class, compensate="undo" if step_class == "compensable" else None,
          compensate_args=(lambda i: {"ref": "never"}) if step_class == "compensable" else None,
          pivot=pivot)  # fmt: skip
    def write() -> None:
        raise KeyboardInterrupt  # as if the person pressed Ctrl-C during its request

    escalated: list[Any] = []
    saga = cap.saga(
        "x",
        tools=[first, undo, write],
        escalation_handlers=[lambda card, report: escalated.append(card)],
    )
    run = mode.run(saga)
    with pytest.raises(KeyboardInterrupt):
        async with run:
            await run.call("first")
            await run.call("write")
    assert undone == ["ref-1"]
    report = run.report
    assert report is not None and report.status is status
    (do,) = [span_attrs(s) for s in cap.spans(phase="do") if span_attrs(s)[sc.SAGA_STEP_INDEX] == 1]
    if status is RunStatus.COMPENSATION_FAILED:
        assert "interrupted by KeyboardInterrupt" in do[sc.SAGA_COMPENSATION_UNSTORABLE]
        card = report.escalation_card()
        assert card is not None and escalated
        assert any("write" in t and "may have taken effect" in t for t in card.not_undone)
    else:
        assert sc.SAGA_COMPENSATION_UNSTORABLE not in do and not escalated
    assert contract_violations(cap.spans()) == []


async def test_a_write_cancelled_while_a_worker_thread_runs_it_escalates() -> None:
    """How frameworks run a sync tool: in a worker thread, which cancelling the agent's
    task does not stop. The write lands after the run has ended: the run must not say
    compensated (it said so, and nothing undid the credit)."""
    cap = capture()
    ledger: list[str] = []
    started, release, landed = threading.Event(), threading.Event(), threading.Event()

    def write_in_thread() -> str:
        started.set()
        release.wait(30)
        ledger.append("credit cr_1")
        landed.set()
        return "cr_1"

    @tool("compensable", compensate="reverse_credit",
          compensate_args=lambda i: {"credit_id": i.result})  # fmt: skip
    async def issue_credit() -> str:
        return await asyncio.to_thread(write_in_thread)

    @tool("convergent")
    async def reverse_credit(credit_id: str) -> None:
        ledger.append(f"reverse {credit_id}")

    run = cap.saga("refund", tools=[issue_credit, reverse_credit]).run()

    async def agent() -> None:
        async with run:
            await run.call("issue_credit")

    task = asyncio.ensure_future(agent())
    assert await asyncio.to_thread(started.wait, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert await asyncio.to_thread(landed.wait, 30)  # the worker finishes its write
    assert ledger == ["credit cr_1"]  # the write happened after all; nothing undid it
    assert run.report is not None and run.report.status is RunStatus.COMPENSATION_FAILED
    card = run.report.escalation_card()
    assert card is not None
    assert any("interrupted by CancelledError" in t for t in card.not_undone), card
    assert contract_violations(cap.spans()) == []


async def test_an_interrupt_while_the_undo_of_a_returned_write_is_built_escalates(
    cap: Captured, mode: Driver
) -> None:
    """Ctrl-C landing after a write returned, while its undo is captured (here in its
    compensate_args recipe): the write happened and nothing can undo it, so the step is
    recorded done with an undo error (not failed), the run unwinds what it pushed, ends
    compensation_failed and escalates that step; the interrupt propagates unchanged."""
    ledger: list[str] = []
    stop = KeyboardInterrupt("the person pressed Ctrl-C")

    def interrupted_recipe(info: Any) -> dict[str, Any]:
        raise stop  # the signal arrives while the undo is being built

    @tool("compensable", compensate="undo_hold", compensate_args=lambda i: {"id": i.result})
    def hold() -> str:
        ledger.append("hold")
        return "h1"

    @tool("compensable", compensate="undo_credit", compensate_args=interrupted_recipe)
    def credit() -> str:
        ledger.append("credit")
        return "cr1"

    @tool("convergent")
    def undo_hold(id: str) -> None:
        ledger.remove("hold")

    @tool("convergent")
    def undo_credit(id: str) -> None:
        ledger.remove("credit")  # never runs: no undo was stored

    escalated: list[EscalationCard] = []
    saga = cap.saga(
        "k",
        tools=[hold, credit, undo_hold, undo_credit],
        escalation_handlers=[lambda card, report: escalated.append(card)],
    )
    run = mode.run(saga)
    with pytest.raises(KeyboardInterrupt) as info:
        async with run:
            await run.call("hold")
            await run.call("credit")
    assert info.value is stop
    assert ledger == ["credit"]  # the hold was undone; the credit stands
    report = run.report
    assert report is not None and report.status is RunStatus.COMPENSATION_FAILED
    credit_step = report.steps[1]
    assert (credit_step.name, credit_step.ok, credit_step.compensation) == ("credit", True, None)
    assert credit_step.undo_error is not None
    assert "returned" in credit_step.undo_error and "KeyboardInterrupt" in credit_step.undo_error
    assert [s.name for s in report.steps] == ["hold", "credit"]  # recorded once, as done
    assert escalated and any("credit" in t for t in escalated[0].not_undone)
    # The do span says the write happened (OK) and that no undo was stored.
    (do,) = [s for s in cap.spans(phase="do") if span_attrs(s)[sc.SAGA_STEP_NAME] == "credit"]
    assert do.status.is_ok
    assert "KeyboardInterrupt" in span_attrs(do)[sc.SAGA_COMPENSATION_UNSTORABLE]
    assert contract_violations(cap.spans()) == []


# -- an undo's arguments -------------------------------------------------------------
def _batch_saga(cap: Captured, undo: Any) -> Any:
    @tool("compensable", compensate="undo_batch", compensate_args=lambda i: {"ids": i.result})
    def write_batch(n: int) -> list[str]:
        return [f"cr_{k}" for k in range(n)]

    undo_batch = tool("convergent", name="undo_batch")(undo)
    return cap.saga("m", tools=[write_batch, undo_batch], retry=RetryPolicy(attempts=3))


async def test_an_undo_that_mutates_its_arguments_changes_neither_its_retries_nor_the_record(
    cap: Captured, mode: Driver
) -> None:
    """Each undo attempt gets its arguments afresh, as stored: a helper that consumes the
    list it reverses, then fails, leaves the next attempt and the record left for recovery
    (the report, the escalation card) holding every reference the write returned."""
    seen: list[list[str]] = []

    def undo_batch(ids: list[str]) -> None:
        seen.append(list(ids))
        ids.pop()  # consumes its input as it reverses items
        raise RuntimeError("ledger down")

    run = mode.run(_batch_saga(cap, undo_batch))
    with pytest.raises(ValueError):
        async with run:
            await run.call("write_batch", n=3)
            raise ValueError("the agent failed")
    every = ["cr_0", "cr_1", "cr_2"]
    assert seen == [every] * 3
    report = run.report
    assert report is not None and report.status is RunStatus.COMPENSATION_FAILED
    assert report.compensations[0].compensation.args == {"ids": every}
    assert report.steps[0].compensation is not None
    assert report.steps[0].compensation.args == {"ids": every}
    card = report.escalation_card()
    assert card is not None and '"cr_2"' in card.not_undone[0]


async def test_an_undo_that_puts_a_non_json_value_in_its_arguments_still_closes_the_run(
    cap: Captured, mode: Driver
) -> None:
    """The undo annotates its list with a handle, then fails: the run still ends
    compensation_failed and escalates, and the agent's own error propagates unchanged
    (before, building the card raised a TypeError in its place, and the run never ended)."""

    def undo_batch(ids: list[Any]) -> None:
        ids.append(object())
        raise RuntimeError("ledger down")

    paged: list[EscalationCard] = []
    saga = _batch_saga(cap, undo_batch)
    saga.escalation_handlers = (lambda card, report: paged.append(card),)
    agent_error = ValueError("the agent failed")
    run = mode.run(saga)
    with pytest.raises(ValueError) as info:
        async with run:
            await run.call("write_batch", n=2)
            raise agent_error
    assert info.value is agent_error
    assert run.report is not None and run.report.status is RunStatus.COMPENSATION_FAILED
    assert len(paged) == 1
    _run_ended(cap, run.run_id)


async def test_the_escalation_card_quotes_the_undo_as_stored(cap: Captured, mode: Driver) -> None:
    """The card a person reads quotes each failed undo's arguments as stored (the JSON the
    sidecar holds and recovery runs), not the live record: an agent that put a non-JSON
    value into ``run.stack``'s arguments neither changes the undo nor breaks the report,
    and its own error still propagates unchanged once the run has ended."""
    seen: list[Any] = []

    def undo_batch(ids: list[Any]) -> None:
        seen.append(ids)
        raise RuntimeError("ledger down")

    paged: list[EscalationCard] = []
    saga = _batch_saga(cap, undo_batch)
    saga.escalation_handlers = (lambda card, report: paged.append(card),)
    agent_error = ValueError("the agent failed")
    run = mode.run(saga)
    with pytest.raises(ValueError) as info:
        async with run:
            await run.call("write_batch", n=2)
            run.stack[0].args["ids"].append(object())  # the agent's own mistake
            raise agent_error
    assert info.value is agent_error
    assert seen == [["cr_0", "cr_1"]] * 3
    assert run.report is not None and run.report.status is RunStatus.COMPENSATION_FAILED
    assert len(paged) == 1
    assert '{"ids": ["cr_0", "cr_1"]}' in paged[0].not_undone[0]
    _run_ended(cap, run.run_id)


async def test_an_interrupt_from_the_run_spans_end_still_lets_go_of_the_run(
    cap: Captured, mode: Driver
) -> None:
    """A span processor that raises SystemExit as the run's span ends (the SDK lets it out
    of span.end): the interrupt propagates, but the heartbeat no longer names the run and
    its report is set."""

    class Exits(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            if (span.attributes or {}).get(sc.SAGA_PHASE) == sc.PHASE_RUN:
                raise SystemExit(3)

    cap.provider.add_span_processor(Exits())
    saga = cap.saga("x", tools=_three_writes([], lambda n: None))
    run = mode.run(saga)
    with pytest.raises(SystemExit):
        async with run:
            await run.call("write_a")
    assert run.report is not None and run.report.status is RunStatus.COMPLETED
    assert run.run_id not in open_run_ids()


# -- writes still in flight when the run fails -------------------------------------
def _on_event(saga: Any, cap: Captured, name: str, seen: Any) -> None:
    """The saga's log events into ``cap.logs``, calling ``seen()`` as ``name`` is logged."""

    def keep(_logger: Any, _method: str, event: Any) -> Any:
        cap.logs.append(dict(event))
        if event.get("event") == name:
            seen()
        raise structlog.DropEvent

    saga.instr.log = structlog.wrap_logger(
        structlog.PrintLogger(), processors=[structlog.processors.add_log_level, keep]
    )


def _credit_and_fraud_check(
    cap: Captured, ledger: dict[str, int], credit: Any, **kwargs: Any
) -> Any:
    """issue_credit (the given function, async or sync), reverse_credit, and a fraud check
    that fails at once."""
    issue_credit = tool("compensable", name="issue_credit", compensate="reverse_credit",
                        compensate_args=lambda i: {"credit_id": i.result})(credit)  # fmt: skip

    @tool("convergent")
    def reverse_credit(credit_id: str) -> None:
        ledger.pop(credit_id)

    @tool("read")
    def check_fraud(order: int) -> None:
        raise RuntimeError("fraud service down")

    return cap.saga("par", tools=[issue_credit, reverse_credit, check_fraud], **kwargs)


async def test_the_unwind_waits_for_a_write_still_in_flight_and_undoes_it(cap: Captured) -> None:
    """asyncio.gather does not cancel the other calls when one fails: the credit is still
    in flight when the fraud check fails and the run's exit begins. The unwind waits for
    it, so its undo is pushed and run before the run ends compensated."""
    ledger: dict[str, int] = {}
    waiting, landed = asyncio.Event(), asyncio.Event()

    async def issue_credit(order: int) -> str:
        with contextlib.suppress(TimeoutError):  # without the wait, lands after the run
            await asyncio.wait_for(waiting.wait(), 5)
        ledger[f"cr_{order}"] = 25
        landed.set()
        return f"cr_{order}"

    saga = _credit_and_fraud_check(cap, ledger, issue_credit)
    _on_event(saga, cap, sc.EV_UNWIND_WAITING, waiting.set)
    run = saga.run()
    with pytest.raises(RuntimeError, match="fraud"):
        async with run:
            await asyncio.gather(
                run.call("issue_credit", order=1), run.call("check_fraud", order=1)
            )
    await asyncio.wait_for(landed.wait(), 10)
    assert ledger == {}  # the credit landed, and was reversed
    report = run.report
    assert report is not None and report.status is RunStatus.COMPENSATED
    assert [o.compensation.tool for o in report.compensations] == ["reverse_credit"]
    [waited] = cap.events(sc.EV_UNWIND_WAITING)
    assert waited["waiting"] == ["issue_credit"] and waited["level"] == "warning"
    [unwind] = cap.spans(phase="unwind")
    assert "reverse_credit" in str(span_attrs(unwind)[sc.SAGA_STACK])
    assert contract_violations(cap.spans()) == []


def test_the_unwind_of_a_sync_run_waits_for_a_write_in_another_thread(cap: Captured) -> None:
    """The same in a sync run whose calls go out from threads: the unwind waits (on a
    condition) for the credit a worker thread is still writing, then undoes it."""
    ledger: dict[str, int] = {}
    started, waiting, landed = threading.Event(), threading.Event(), threading.Event()

    def issue_credit(order: int) -> str:
        started.set()
        waiting.wait(5)  # without the wait, lands after the run
        ledger[f"cr_{order}"] = 25
        landed.set()
        return f"cr_{order}"

    saga = _credit_and_fraud_check(cap, ledger, issue_credit)
    _on_event(saga, cap, sc.EV_UNWIND_WAITING, waiting.set)
    run = saga.run_sync()
    worker = threading.Thread(target=lambda: run.call("issue_credit", order=1))
    with pytest.raises(RuntimeError, match="fraud"), run:
        worker.start()
        assert started.wait(10)
        run.call("check_fraud", order=1)
    worker.join(10)
    assert landed.is_set() and ledger == {}
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert [o.compensation.tool for o in run.report.compensations] == ["reverse_credit"]


def _assert_given_up_then_late(cap: Captured, run: Any, ledger: dict[str, int]) -> None:
    """The credit was still running past the bound: the run ended compensation_failed,
    escalating it; it landed later, loudly, and nothing undid it."""
    assert ledger == {"cr_1": 25}
    report = run.report
    assert report is not None and report.status is RunStatus.COMPENSATION_FAILED
    assert report.compensations == ()  # its undo was never pushed, so never run
    [given_up] = [s for s in report.steps if s.name == "issue_credit"]
    assert not given_up.ok and given_up.undo_error is not None
    assert "still running" in given_up.undo_error
    card = report.escalation_card()
    assert card is not None and any("issue_credit" in t for t in card.not_undone)
    [late] = cap.events(sc.EV_LATE_EFFECT)
    assert (late["level"], late["step"], late["run_id"]) == ("error", "issue_credit", run.run_id)
    assert late["compensation"]["args"] == {"credit_id": "cr_1"}  # what to undo by hand
    assert cap.metric("saga_compensation_failures_total", saga="par", step="issue_credit") == 1
    [do] = [s for s in cap.spans(phase="do") if span_attrs(s)[sc.SAGA_STEP_NAME] == "issue_credit"]
    assert sc.SAGA_COMPENSATION_ARGS not in span_attrs(do)
    assert "after its run" in str(span_attrs(do)[sc.SAGA_COMPENSATION_UNSTORABLE])
    assert contract_violations(cap.spans()) == []


async def test_a_write_still_running_past_the_bound_escalates_and_lands_loudly(
    cap: Captured,
) -> None:
    ledger: dict[str, int] = {}
    gate = asyncio.Event()

    async def issue_credit(order: int) -> str:
        await gate.wait()
        ledger[f"cr_{order}"] = 25
        return f"cr_{order}"

    saga = _credit_and_fraud_check(cap, ledger, issue_credit, settle_timeout=0)
    run = saga.run()
    with pytest.raises(RuntimeError, match="fraud"):
        async with run:
            credit = asyncio.ensure_future(run.call("issue_credit", order=1))
            await asyncio.sleep(0)  # the credit is in flight
            await run.call("check_fraud", order=1)
    assert ledger == {}
    gate.set()
    assert await credit == "cr_1"  # the call itself still returns what the tool did
    _assert_given_up_then_late(cap, run, ledger)


def test_a_sync_write_still_running_past_the_bound_escalates_and_lands_loudly(
    cap: Captured,
) -> None:
    ledger: dict[str, int] = {}
    started, gate = threading.Event(), threading.Event()

    def issue_credit(order: int) -> str:
        started.set()
        gate.wait(10)
        ledger[f"cr_{order}"] = 25
        return f"cr_{order}"

    saga = _credit_and_fraud_check(cap, ledger, issue_credit, settle_timeout=0)
    run = saga.run_sync()
    worker = threading.Thread(target=lambda: run.call("issue_credit", order=1))
    with pytest.raises(RuntimeError, match="fraud"), run:
        worker.start()
        assert started.wait(10)
        run.call("check_fraud", order=1)
    assert ledger == {}
    gate.set()
    worker.join(10)
    _assert_given_up_then_late(cap, run, ledger)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_settle_timeout_is_a_finite_bound(cap: Captured, bad: float) -> None:
    with pytest.raises(ConfigurationError, match=r"settle_timeout=.*default 30"):
        cap.saga("x", settle_timeout=bad)


# -- threads calling one sync run --------------------------------------------------
WORKERS, CALLS = 8, 40


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch every microsecond, so an unguarded read-modify-write of the run's
    state is interrupted between its read and its write, and a lost update shows."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _parallel_credits(
    cap: Captured,
    by_index: dict[int, str],
    undone: list[str],
    fail: tuple[int, int] | None = None,
    gate: Any = lambda: None,
) -> Any:
    """issue_credit(worker, n) returns its own reference and notes it under its step
    index, after ``gate()``; reverse_credit appends what it undoes; ``fail`` (worker, n)
    raises instead."""

    @tool("compensable", compensate="reverse_credit",
          compensate_args=lambda i: {"credit_id": i.result})  # fmt: skip
    def issue_credit(worker: int, n: int) -> str:
        if (worker, n) == fail:
            raise InjectedFailure(f"ledger refused credit {worker}/{n}")
        gate()
        call = current_call()
        assert call is not None
        credit = f"cr_{worker}_{n}"
        by_index[call.index] = credit
        return credit

    @tool("convergent")
    def reverse_credit(credit_id: str) -> None:
        undone.append(credit_id)

    return cap.saga("par", tools=[issue_credit, reverse_credit], settle_timeout=10)


def _calls_in_threads(
    run: Any,
    calls: int,
    refused: list[BaseException],
    failed: list[BaseException],
    stop: threading.Event,
) -> tuple[list[threading.Thread], list[list[str]]]:
    """WORKERS threads, each making ``calls`` calls of one run from a common start (a
    barrier): what each call returned, per worker. A call the run refuses (it is
    stopping) or that fails ends that worker; a failure also sets ``stop``."""
    barrier = threading.Barrier(WORKERS)
    returned: list[list[str]] = [[] for _ in range(WORKERS)]

    def worker(w: int) -> None:
        barrier.wait(10)
        for n in range(calls):
            try:
                returned[w].append(run.call("issue_credit", worker=w, n=n))
            except StepRefusedError as exc:
                refused.append(exc)
                return
            except BaseException as exc:
                failed.append(exc)
                stop.set()
                return

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    return threads, returned


def _do_spans_in_push_order(cap: Captured, run_id: str) -> list[tuple[int, str]]:
    """(index, credit) of each do span that pushed an undo, in the order the spans ended."""
    out = []
    for span in cap.spans(phase="do", run_id=run_id):
        attrs = span_attrs(span)
        if sc.SAGA_COMPENSATION_ARGS in attrs:
            credit = json.loads(str(attrs[sc.SAGA_COMPENSATION_ARGS]))["credit_id"]
            out.append((int(attrs[sc.SAGA_STEP_INDEX]), credit))
    return out


@pytest.mark.usefixtures("fast_switching")
def test_threads_calling_one_sync_run_each_get_their_own_step(cap: Captured) -> None:
    """Parallel tool calls on a thread pool, as agent frameworks make them: every call's
    undo is on the stack once, holding the reference that call returned, under an index
    of its own; the records, spans and metrics agree on it."""
    by_index: dict[int, str] = {}
    saga = _parallel_credits(cap, by_index, [])
    run = saga.run_sync()
    refused: list[BaseException] = []
    failed: list[BaseException] = []
    with run:
        threads, returned = _calls_in_threads(run, CALLS, refused, failed, threading.Event())
        for t in threads:
            t.join(30)
        stack = run.stack
    assert (refused, failed) == ([], [])
    report = run.report
    assert report is not None and report.status is RunStatus.COMPLETED
    credits = [c for per_worker in returned for c in per_worker]
    assert len(credits) == len(set(credits)) == WORKERS * CALLS
    # Indexes unique and dense, in the order the records were written.
    assert sorted(s.index for s in report.steps) == list(range(WORKERS * CALLS))
    for s in report.steps:
        assert s.ok and s.compensation is not None
        assert s.compensation.index == s.index
        assert s.compensation.args == {"credit_id": by_index[s.index]}  # its own reference
    # The stack holds each call's undo once, pushed in the order the records were.
    assert sorted(c.args["credit_id"] for c in stack) == sorted(credits)
    bottom_first = [(c.index, c.args["credit_id"]) for c in reversed(stack)]
    assert bottom_first == [(s.index, by_index[s.index]) for s in report.steps]
    # Each do span says the same, and ended as its undo was pushed.
    assert _do_spans_in_push_order(cap, run.run_id) == bottom_first
    assert cap.metric("saga_steps_total", saga="par", step="issue_credit", phase="do",
                      outcome="ok") == WORKERS * CALLS  # fmt: skip
    finished = [e for e in cap.events(sc.EV_STEP_FINISHED) if e["run_id"] == run.run_id]
    assert len(finished) == WORKERS * CALLS
    assert contract_violations(cap.spans()) == []


@pytest.mark.usefixtures("fast_switching")
def test_a_failing_thread_unwinds_every_undo_its_sibling_threads_pushed_once(cap: Captured) -> None:
    """One call fails while the other threads' calls are in flight: the run takes no new
    step, waits for those still running, and unwinds every undo pushed, each once, in
    reverse push order."""
    by_index: dict[int, str] = {}
    undone: list[str] = []
    stop, held, waiting = threading.Event(), threading.Event(), threading.Event()

    def gate() -> None:
        if stop.is_set():  # begun once the call failed: still running when the run exits
            held.set()
            waiting.wait(10)

    saga = _parallel_credits(cap, by_index, undone, fail=(3, CALLS // 2), gate=gate)
    _on_event(saga, cap, sc.EV_UNWIND_WAITING, waiting.set)
    run = saga.run_sync()
    refused: list[BaseException] = []
    failed: list[BaseException] = []
    threads: list[threading.Thread] = []
    with pytest.raises(InjectedFailure), run:
        # The others call until the run refuses them: some are in flight when it exits.
        threads, returned = _calls_in_threads(run, 100 * CALLS, refused, failed, stop)
        assert stop.wait(30) and held.wait(30)
        raise failed[0]  # the agent sees the failed call: the run exits with it
    for t in threads:
        t.join(30)
    assert [type(e) for e in failed] == [InjectedFailure]
    assert len(refused) == WORKERS - 1  # each other's next call: the run was stopping
    [waited] = cap.events(sc.EV_UNWIND_WAITING)  # for the calls the gate held
    assert waited["waiting"] and set(waited["waiting"]) == {"issue_credit"}
    report = run.report
    assert report is not None and report.status is RunStatus.COMPENSATED
    assert report.failed_step == "issue_credit"
    credits = [c for per_worker in returned for c in per_worker]
    pushed = [c for _, c in _do_spans_in_push_order(cap, run.run_id)]
    assert sorted(pushed) == sorted(credits)  # every call that returned pushed its undo
    assert undone == pushed[::-1]  # each undone once, in reverse push order
    assert [o.compensation.args["credit_id"] for o in report.compensations] == undone
    assert all(o.ok for o in report.compensations)
    ok_steps = [s for s in report.steps if s.ok]
    assert [by_index[s.index] for s in ok_steps] == pushed
    [unwind] = cap.spans(phase="unwind", run_id=run.run_id)
    listed = json.loads(str(span_attrs(unwind)[sc.SAGA_STACK]))
    assert [c["args"]["credit_id"] for c in listed] == undone
    assert run.stack == ()
    assert contract_violations(cap.spans()) == []
