"""The pydantic-ai adapter with a real Agent and its FunctionModel (offline, no key)."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import pytest
from pydantic import Field
from pydantic_ai import Agent, ModelRetry, RunContext, ToolDefinition
from pydantic_ai import Tool as PaiTool
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.toolsets import FunctionToolset

from examples.pydantic_ai_refund_agent import DECLARE, SCRIPT, refund_toolset, scripted_model
from examples.world import ServiceDown, World
from saga_otel import ConfigurationError, RunStatus, StepClass
from saga_otel import semconv as sc
from saga_otel.adapters.pydantic_ai import Declare, SagaTools, ToolErrorUnwind
from saga_otel.testing import Captured, capture, contract_violations, span_attrs


@pytest.fixture
def cap() -> Captured:
    return capture()


async def test_refund_story_unwinds_in_reverse_through_the_agents_tools(cap: Captured) -> None:
    world = World(mail_down=True)
    tools = SagaTools(refund_toolset(world), DECLARE)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(ServiceDown):
        async with run:
            await Agent(scripted_model(SCRIPT)).run("refund", toolsets=[tools.toolset(run)])
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0 and world.tickets == {"T-9104": "open"}
    assert contract_violations(cap.spans()) == []
    dos = [span_attrs(s) for s in cap.spans(phase="do")]
    assert [d[sc.GEN_AI_TOOL_CALL_ID] for d in dos] == ["call_1", "call_2", "call_3", "call_4"]
    assert [d[sc.SAGA_STEP_CLASS] for d in dos] == [
        "read",
        "compensable",
        "reversible",
        "irreversible",
    ]
    undos = [span_attrs(s) for s in cap.spans(phase="compensate")]
    assert [u[sc.SAGA_COMPENSATION_TOOL] for u in undos] == ["set_ticket_status", "reverse_credit"]
    assert json.loads(undos[1][sc.SAGA_COMPENSATION_ARGS]) == {"credit_id": "cr_9104_4921"}
    # The do ran under the saga's idempotency key (read through current_call()).
    assert world._keys and all(k.startswith(run.run_id) for k in world._keys)


def _retrying_toolset(world: World) -> FunctionToolset[None]:
    tools = refund_toolset(world)

    @tools.tool_plain
    def notify(ticket_id: str) -> str:
        """A flaky notification."""
        raise ModelRetry(f"ticket {ticket_id} is locked, try later")

    return tools


SCRIPT_WITH_RETRY = [
    SCRIPT[1],
    ("call_n", "notify", {"ticket_id": "T-9104"}),
    SCRIPT[2],
]


async def test_model_retry_is_a_failed_step_handed_back_to_the_model(cap: Captured) -> None:
    world = World()
    tools = SagaTools(
        _retrying_toolset(world), {**DECLARE, "notify": Declare(step_class="convergent")}
    )
    seen: list[str] = []

    def respond(messages: list[ModelMessage], _info: AgentInfo) -> ModelResponse:
        seen.append(json.dumps([str(p) for p in messages[-1].parts]))
        if len(seen) <= len(SCRIPT_WITH_RETRY):
            call_id, name, args = SCRIPT_WITH_RETRY[len(seen) - 1]
            return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=call_id)])
        return ModelResponse(parts=[TextPart("ok")])

    async with cap.saga("refund", tools=tools.registry).run() as run:
        result = await Agent(FunctionModel(respond)).run("go", toolsets=[tools.toolset(run)])
    assert result.output == "ok"
    assert "is locked, try later" in seen[2]  # the model read the tool's error
    assert run.report is not None and run.report.status is RunStatus.COMPLETED
    assert [(s.name, s.ok) for s in run.report.steps] == [
        ("issue_credit", True),
        ("notify", False),
        ("set_ticket_status", True),
    ]
    assert cap.spans(phase="unwind") == [] and world.balance(4921) == 2500


async def test_unwind_on_tool_error_unwinds_instead(cap: Captured) -> None:
    world = World()
    tools = SagaTools(
        _retrying_toolset(world),
        {**DECLARE, "notify": Declare(step_class="convergent")},
        unwind_on_tool_error=True,
    )
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(ToolErrorUnwind, match="is locked"):
        async with run:
            agent = Agent(scripted_model(SCRIPT_WITH_RETRY))
            await agent.run("go", toolsets=[tools.toolset(run)])
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_retries_exhausted_escape_the_agent_and_unwind(cap: Captured) -> None:
    world = World()
    tools = SagaTools(
        _retrying_toolset(world), {**DECLARE, "notify": Declare(step_class="convergent")}
    )
    script = [SCRIPT[1], *[("call_n", "notify", {"ticket_id": "T-9104"})] * 5]
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(UnexpectedModelBehavior):
        async with run:
            agent = Agent(scripted_model(script), retries=2)
            await agent.run("go", toolsets=[tools.toolset(run)])
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_cancelling_the_agent_unwinds(cap: Captured) -> None:
    world = World()
    toolset = refund_toolset(world)
    stalled = asyncio.Event()

    @toolset.tool_plain
    async def wait_for_human() -> str:
        stalled.set()
        await asyncio.Event().wait()
        return "never"

    tools = SagaTools(toolset, {**DECLARE, "wait_for_human": Declare(step_class="read")})
    run = cap.saga("refund", tools=tools.registry).run()
    script = [SCRIPT[1], ("call_w", "wait_for_human", {})]

    async def agent() -> None:
        async with run:
            await Agent(scripted_model(script)).run("go", toolsets=[tools.toolset(run)])

    task = asyncio.create_task(agent())
    await stalled.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_a_tool_taking_run_context_gets_it(cap: Captured) -> None:
    toolset: FunctionToolset[str] = FunctionToolset()

    @toolset.tool
    def whoami(ctx: RunContext[str]) -> str:
        """Who runs."""
        return f"{ctx.deps}:{ctx.tool_call_id}"

    tools = SagaTools(toolset, {"whoami": Declare(step_class="read")})
    async with cap.saga("t", tools=tools.registry).run() as run:
        agent = Agent(TestModel(call_tools=["whoami"]), deps_type=str)
        result = await agent.run("go", deps="alice", toolsets=[tools.toolset(run)])
    assert "alice:" in result.output
    (do,) = cap.spans(phase="do")
    assert span_attrs(do)[sc.GEN_AI_TOOL_CALL_ID] in result.output


def test_undeclared_tools_are_refused_listing_each() -> None:
    def a() -> None: ...

    def b() -> None: ...

    with pytest.raises(ConfigurationError, match=r"no declaration\): a, b\."):
        SagaTools([a, b])
    tools = SagaTools([a, b], {"a": Declare(step_class="read")}, unannotated="irreversible")
    assert tools.registry.get("b").step_class is StepClass.IRREVERSIBLE
    assert "default" in tools.review().splitlines()[2]


def test_an_undo_taking_run_context_is_refused() -> None:
    toolset: FunctionToolset[None] = FunctionToolset()

    @toolset.tool_plain
    def do(x: int) -> int:
        return x

    @toolset.tool
    def undo(ctx: RunContext[None], x: int) -> int:
        return x

    with pytest.raises(ConfigurationError, match="takes a RunContext"):
        SagaTools(toolset, {"do": Declare(undo="undo"), "undo": Declare(step_class="convergent")})


class Booth:
    """A seat to hold, whose release runs through pydantic-ai and says what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def toolset(self) -> FunctionToolset[None]:
        tools: FunctionToolset[None] = FunctionToolset()

        @tools.tool_plain
        def hold(seat: int) -> dict[str, str]:
            """Hold a seat; the booking system answers with the seat as text."""
            self.seen.append(("hold", seat))
            return {"seat": str(seat)}

        def audit(ctx: RunContext[None], seat: int) -> None:
            # pydantic-ai's args_validator hook: only pydantic-ai's call path runs it.
            self.seen.append(("validated", ctx.tool_name, ctx.tool_call_id, seat))

        @tools.tool_plain(args_validator=audit)
        def release(seat: Annotated[int, Field(ge=1)]) -> str:
            """Release a seat."""
            self.seen.append(("release", seat, type(seat).__name__))
            return "released"

        @tools.tool_plain
        def pay(seat: int) -> str:
            """Pay; the card is declined."""
            raise RuntimeError("card declined")

        return tools


BOOTH_SCRIPT = [("call_h", "hold", {"seat": 7}), ("call_p", "pay", {"seat": 7})]


async def _booth_run(cap: Captured, booth: Booth, undo_args: dict[str, Any]) -> Any:
    tools = SagaTools(
        booth.toolset(),
        {
            "hold": Declare(undo="release", undo_args=undo_args),
            "release": Declare(step_class="convergent"),
            "pay": Declare(step_class="irreversible"),
        },
    )
    run = cap.saga("booking", tools=tools.registry).run()
    with pytest.raises(RuntimeError, match="card declined"):
        async with run:
            await Agent(scripted_model(BOOTH_SCRIPT)).run("book", toolsets=[tools.toolset(run)])
    assert run.report is not None
    return run.report


async def test_the_undo_runs_through_pydantic_ais_own_tool_call(cap: Captured) -> None:
    booth = Booth()
    report = await _booth_run(cap, booth, {"seat": "result.seat"})
    assert report.status is RunStatus.COMPENSATED
    # The undo's argument came from the result as "7": pydantic-ai's schema made it the int
    # the function declares, and its args_validator saw the call, named, with the key as id.
    (validated, released) = booth.seen[1:]
    assert released == ("release", 7, "int")
    assert validated[:2] == ("validated", "release") and validated[3] == 7
    assert validated[2] == f"{report.run_id}:0:compensate"


async def test_undo_args_pydantic_ai_rejects_fail_the_compensation(cap: Captured) -> None:
    booth = Booth()
    report = await _booth_run(cap, booth, {"seat": 0})  # the schema says seat >= 1
    assert report.status is RunStatus.COMPENSATION_FAILED
    (failed,) = report.compensations_failed
    assert "greater than or equal to 1" in (failed.error or "")
    assert [s[0] for s in booth.seen] == ["hold"]  # the function never ran


async def test_the_snapshot_runs_through_pydantic_ai_too(cap: Captured) -> None:
    world = World(mail_down=True)
    toolset = refund_toolset(world)
    asked: list[str | None] = []

    @toolset.tool_plain(args_validator=lambda ctx, ticket_id: asked.append(ctx.tool_call_id))
    def peek_ticket(ticket_id: str) -> dict[str, Any]:
        """A ticket's status, audited."""
        return {"ticket_id": ticket_id, "status": world.ticket_status(ticket_id)}

    declare = {
        **DECLARE,
        "set_ticket_status": Declare(
            undo="set_ticket_status",
            snapshot="peek_ticket",
            undo_args={"ticket_id": "args.ticket_id", "status": "snapshot.status"},
        ),
        "peek_ticket": Declare(step_class="read"),
    }
    tools = SagaTools(toolset, declare)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(ServiceDown):
        async with run:
            await Agent(scripted_model(SCRIPT)).run("refund", toolsets=[tools.toolset(run)])
    assert world.tickets == {"T-9104": "open"}
    assert asked == ["saga-otel:peek_ticket"]  # once, before set_ticket_status wrote


async def test_a_snapshot_is_frozen_when_read(cap: Captured) -> None:
    """The read tool returns the stored object, which the write mutates: the undo still
    restores the status read before the write."""
    tickets = {"T-1": {"ticket_id": "T-1", "status": "open"}}

    def get_ticket(ticket_id: str) -> dict[str, str]:
        return tickets[ticket_id]

    def set_ticket_status(ticket_id: str, status: str) -> dict[str, str]:
        tickets[ticket_id]["status"] = status
        return tickets[ticket_id]

    def pay() -> str:
        raise RuntimeError("card declined")

    tools = SagaTools(
        [get_ticket, set_ticket_status, pay],
        {
            "get_ticket": Declare(step_class="read"),
            "pay": Declare(step_class="irreversible"),
            "set_ticket_status": Declare(
                undo="set_ticket_status",
                snapshot="get_ticket",
                undo_args={"ticket_id": "args.ticket_id", "status": "snapshot.status"},
            ),
        },
    )
    script = [("c1", "set_ticket_status", {"ticket_id": "T-1", "status": "refunded"}),
              ("c2", "pay", {})]  # fmt: skip
    run = cap.saga("s", tools=tools.registry).run()
    with pytest.raises(RuntimeError, match="card declined"):
        async with run:
            await Agent(scripted_model(script)).run("go", toolsets=[tools.toolset(run)])
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert tickets["T-1"]["status"] == "open"


async def test_an_undo_runs_its_own_prepare_alone(cap: Captured) -> None:
    """Another tool's prepare reads the agent's deps, which no unwind has: only the undo's
    own prepare runs with it, so the undo is not failed by a tool it never calls."""
    booth = Booth()
    toolset = booth.toolset()
    prepared: list[tuple[str, Any]] = []

    async def admins_only(ctx: RunContext[Any], tool_def: ToolDefinition) -> ToolDefinition | None:
        return tool_def if ctx.deps["admin"] else None

    async def noted(ctx: RunContext[Any], tool_def: ToolDefinition) -> ToolDefinition:
        prepared.append((tool_def.name, ctx.deps))
        return tool_def

    toolset.add_tool(PaiTool(lambda seat: "gone", name="evict", prepare=admins_only))
    toolset.tools["release"].prepare = noted
    tools = SagaTools(
        toolset,
        {
            "hold": Declare(undo="release", undo_args={"seat": "result.seat"}),
            "release": Declare(step_class="convergent"),
            "pay": Declare(step_class="irreversible"),
            "evict": Declare(step_class="irreversible"),
        },
    )
    run = cap.saga("booking", tools=tools.registry).run()
    with pytest.raises(RuntimeError, match="card declined"):
        async with run:
            agent = Agent(scripted_model(BOOTH_SCRIPT), deps_type=dict)
            await agent.run("book", deps={"admin": False}, toolsets=[tools.toolset(run)])
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert booth.seen[-1] == ("release", 7, "int")
    assert prepared[-1] == ("release", None)  # the undo's own prepare ran, in the unwind
