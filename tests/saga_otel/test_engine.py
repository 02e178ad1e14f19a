"""The saga engine: refund and release scenarios, pivot rules, recovery, cancellation."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from examples.refund_agent import refund_agent, run_refund
from examples.refund_tools import CloseDown, refund_tools
from examples.release_saga import RELEASE_STEPS, Release, release
from examples.world import ServiceDown, World
from saga_otel import (
    EscalationCard,
    RetryPolicy,
    RunStatus,
    SagaReport,
    Step,
    StepRefusedError,
    ToolRegistry,
    ValidationRejectedError,
    current_call,
    idempotency_key,
    tool,
)
from saga_otel.testing import Captured, FailureInjector, InjectedFailure, capture


@pytest.fixture
def cap() -> Captured:
    return capture()


# -- refund scenario ------------------------------------------------------------
async def test_refund_completes_and_pushes_one_undo_per_reversible_write(cap: Captured) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    run = saga.run()
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


async def test_mail_down_unwinds_in_reverse_with_a_reversing_ledger_entry(cap: Captured) -> None:
    world = World(mail_down=True)
    report = await run_refund(cap.saga("refund", tools=refund_tools(world)))
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


async def test_runtime_api_reraises_the_agents_exception_unchanged(cap: Captured) -> None:
    world = World(mail_down=True)
    saga = cap.saga("refund", tools=refund_tools(world))
    run = saga.run()
    with pytest.raises(ServiceDown) as info:
        async with run:
            await refund_agent(run)
    assert run.report is not None
    assert run.report.error is info.value


def test_sync_twin_unwinds_too(cap: Captured) -> None:
    world = World(mail_down=True)
    saga = cap.saga("refund", tools=refund_tools(world))
    run = saga.run_sync()
    with pytest.raises(ServiceDown), run:
        order = run.call("get_order", order_id=4921)
        run.call("issue_credit", order_id=4921, amount=order["amount"])
        run.call("send_reply", ticket_id="T-9104", body="hi")
    assert run.report is not None
    assert run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_failed_compensation_is_retried_recorded_and_escalated(cap: Captured) -> None:
    world = World(mail_down=True)
    injector = FailureInjector().fail("reverse_credit", phase="compensate")
    escalations: list[EscalationCard] = []
    saga = cap.saga(
        "refund",
        tools=injector.wrap(refund_tools(world)),
        retry=RetryPolicy(attempts=3),
        escalation_handlers=[lambda card, report: escalations.append(card)],
    )
    report = await run_refund(saga)
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


async def test_transient_compensation_failure_is_carried_by_retries(cap: Captured) -> None:
    world = World(mail_down=True)
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    injector = FailureInjector().fail("reverse_credit", phase="compensate", times=2)
    saga = cap.saga(
        "refund",
        tools=injector.wrap(refund_tools(world)),
        retry=RetryPolicy(attempts=4, initial=0.5, multiplier=2, jitter=0),
        async_sleep=sleep,
    )
    report = await run_refund(saga)
    assert report.status is RunStatus.COMPENSATED
    assert slept == [0.5, 1.0]  # exponential backoff through the injected sleep
    assert world.balance(4921) == 0


async def test_per_tool_retry_policy_overrides_the_sagas(cap: Captured) -> None:
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
    saga = cap.saga("refund", tools=injector.wrap(custom), retry=RetryPolicy(attempts=2))
    report = await run_refund(saga)
    assert report.status is RunStatus.COMPENSATED
    assert report.compensations[-1].attempts == 6


async def test_failure_after_the_pivot_is_stuck_and_never_unwinds(cap: Captured) -> None:
    world = World()
    escalated: list[SagaReport] = []
    saga = cap.saga(
        "refund",
        tools=refund_tools(world, close_fails=True),
        escalation_handlers=[lambda card, report: escalated.append(report)],
    )
    report = await run_refund(saga)
    assert report.status is RunStatus.STUCK
    assert report.compensations == ()
    assert world.balance(4921) == 2500  # nothing was undone
    assert report.irreversible_steps == ("send_reply",)
    assert [p.tool for p in report.pending] == ["close_ticket"]
    assert escalated and escalated[0] is report
    card = report.escalation_card()
    assert card is not None and "send_reply" in card.render()


async def test_forward_recovery_completes_a_stuck_run_idempotently(cap: Captured) -> None:
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
    saga = cap.saga("refund", tools=tools, recovery_retry=RetryPolicy(attempts=5, jitter=0))
    report = await run_refund(saga)
    assert report.status is RunStatus.STUCK
    resumed = await saga.resume(report)
    assert resumed.status is RunStatus.COMPLETED
    assert resumed.run_id == report.run_id
    assert world.tickets["T-9104"] == "closed"
    # Every attempt, first run and resumption alike, carried the same key.
    assert len(set(keys)) == 1 and keys[0] == idempotency_key(report.run_id, 4)
    assert len(world.outbox) == 1  # the reply was not sent twice


async def test_resume_refuses_a_run_that_is_not_stuck(cap: Captured) -> None:
    report = await run_refund(cap.saga("refund", tools=refund_tools(World(mail_down=True))))
    with pytest.raises(StepRefusedError, match="only a stuck run"):
        await cap.saga("refund", tools=refund_tools(World())).resume(report)


# -- pivot rules -------------------------------------------------------------------
async def test_irreversible_call_is_refused_while_another_write_is_in_flight(
    cap: Captured,
) -> None:
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


async def test_reversible_write_after_the_pivot_is_refused_unless_allowed(cap: Captured) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    with pytest.raises(StepRefusedError, match="allow_writes_after_pivot"):
        async with saga.run() as run:
            await run.call("send_reply", ticket_id="T-9104", body="x")
            await run.call("issue_credit", order_id=4921, amount=1)
    assert world.ledger == []  # refused before any side effect
    lenient = cap.saga("refund", tools=refund_tools(world), allow_writes_after_pivot=True)
    async with lenient.run() as run:
        await run.call("send_reply", ticket_id="T-9104", body="x")
        await run.call("issue_credit", order_id=4921, amount=1)
    assert len(world.ledger) == 1


# -- classes, records, registry ---------------------------------------------------
async def test_reads_and_convergent_writes_push_nothing(cap: Captured) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    async with saga.run() as run:
        await run.call("get_order", order_id=4921)
        await run.call("close_ticket", ticket_id="T-9104")
        assert run.stack == ()


async def test_unknown_compensation_tool_fails_loudly_not_silently(cap: Captured) -> None:
    @tool("compensable", compensate="gone", compensate_args=lambda i: {})
    def write() -> int:
        return 1

    saga = cap.saga("x", tools=[write])
    run = saga.run()
    with pytest.raises(RuntimeError):
        async with run:
            await run.call("write")
            raise RuntimeError("boom")
    assert run.report is not None
    assert run.report.status is RunStatus.COMPENSATION_FAILED
    assert "no tool named 'gone'" in (run.report.compensations_failed[0].error or "")


async def test_tools_see_their_call_context_and_idempotency_key(cap: Captured) -> None:
    seen: list[Any] = []

    @tool("convergent")
    def probe() -> None:
        seen.append(current_call())

    saga = cap.saga("x", tools=[probe])
    async with saga.run() as run:
        await run.call("probe")
    assert seen[0].run_id == run.run_id
    assert seen[0].idempotency_key == f"{run.run_id}:0"
    assert current_call() is None


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


def test_fixed_plan_sync_twin(cap: Captured) -> None:
    log: list[str] = []
    steps = [
        Step("a", do=lambda c: log.append("a"), compensate=lambda c: log.append("undo a")),
        Step("b", do=lambda c: log.append("b"), compensate=lambda c: log.append("undo b")),
        Step("c", do=lambda c: (_ for _ in ()).throw(ValueError("c broke"))),
    ]
    report = cap.saga("plan").execute_sync(steps)
    assert report.status is RunStatus.COMPENSATED
    assert log == ["a", "b", "undo b", "undo a"]
    assert isinstance(report.error, ValueError)


async def test_runtime_validation_rejects(cap: Captured) -> None:
    sent: list[str] = []

    def check(body: str) -> None:
        if not body:
            raise ValueError("empty reply")

    send = tool("irreversible", name="send", validate=check)(lambda body: sent.append(body))
    saga = cap.saga("x", tools=[send])
    with pytest.raises(ValidationRejectedError, match="empty reply"):
        async with saga.run(validate=[("send", {"body": ""})]) as run:
            await run.call("send", body="")
    assert sent == []
    async with saga.run(validate=[("send", {"body": "hi"})]) as run:
        await run.call("send", body="hi")
    assert sent == ["hi"]


# -- cancellation, interrupts, concurrency ---------------------------------------------
async def test_cancelled_task_still_unwinds_with_shielded_compensations(cap: Captured) -> None:
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


def test_keyboard_interrupt_unwinds_before_propagating(cap: Captured) -> None:
    world = World()
    saga = cap.saga("refund", tools=refund_tools(world))
    run = saga.run_sync()
    with pytest.raises(KeyboardInterrupt), run:
        run.call("issue_credit", order_id=4921, amount=2500)
        raise KeyboardInterrupt
    assert world.balance(4921) == 0
    assert run.report is not None and run.report.failed_step == "(agent)"


def test_many_runs_in_threads_share_no_state(cap: Captured) -> None:
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
    world = World(mail_down=True)
    saga = cap.saga("refund", tools=refund_tools(world))
    reports = await asyncio.gather(*(run_refund(saga) for _ in range(25)))
    assert {r.status for r in reports} == {RunStatus.COMPENSATED}
    assert len({r.run_id for r in reports}) == 25
    assert world.balance(4921) == 0
    assert all(len(r.compensations) == 2 for r in reports)


def test_release_steps_are_ordered_pivot_last() -> None:
    assert [s.pivot for s in RELEASE_STEPS] == [False, False, True]
