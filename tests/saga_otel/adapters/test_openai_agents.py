"""The OpenAI Agents SDK adapter with a real Agent and Runner and a scripted Model (no network)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from agents import (
    Agent,
    FunctionTool,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.tool_context import ToolContext
from pydantic import Field

from examples.openai_agents_refund_agent import DECLARE, SCRIPT, ScriptedModel, refund_tools
from examples.world import ServiceDown, World
from saga_otel import ConfigurationError, RunStatus, StepClass
from saga_otel import semconv as sc
from saga_otel.adapters.openai_agents import Declare, SagaTools, ToolErrorUnwind
from saga_otel.testing import Captured, capture, contract_violations, span_attrs


@pytest.fixture(autouse=True)
def no_sdk_tracing() -> Iterator[None]:
    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI
    yield


@pytest.fixture
def cap() -> Captured:
    return capture()


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


async def test_refund_story_unwinds_in_reverse_through_the_function_tools(cap: Captured) -> None:
    world = World(mail_down=True)
    tools = SagaTools(refund_tools(world), DECLARE, unwind_on_tool_error=True)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(Exception) as escaped:
        async with run:
            agent = Agent(name="r", model=ScriptedModel(SCRIPT), tools=tools.bind(run))
            await Runner.run(agent, "refund")
    assert _caused_by(escaped.value, ToolErrorUnwind) and _caused_by(escaped.value, ServiceDown)
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


async def test_by_default_a_tool_error_is_a_failed_step_the_model_reads(cap: Captured) -> None:
    world = World(mail_down=True)
    tools = SagaTools(refund_tools(world), DECLARE)
    model = ScriptedModel(SCRIPT)
    async with cap.saga("refund", tools=tools.registry).run() as run:
        agent = Agent(name="r", model=model, tools=tools.bind(run))
        result = await Runner.run(agent, "refund")
    assert result.final_output == "Refund done."
    last_output = [i for i in model.inputs[-1] if i.get("type") == "function_call_output"][-1]
    assert last_output["call_id"] == "call_4"  # the SDK's default failure message, for the model
    assert "error occurred while running the tool" in last_output["output"]
    assert run.report is not None and run.report.status is RunStatus.COMPLETED
    assert [(s.name, s.ok) for s in run.report.steps][-1] == ("send_reply", False)
    assert cap.spans(phase="unwind") == [] and world.balance(4921) == 2500


async def test_a_tool_without_failure_handling_escapes_and_unwinds(cap: Captured) -> None:
    world = World(mail_down=True)
    tools_list = refund_tools(world)

    @function_tool(failure_error_function=None)
    def send_reply(ticket_id: str, body: str) -> dict[str, Any]:
        """Email the customer."""
        return world.send_reply(ticket_id, body)

    tools_list[-1] = send_reply
    tools = SagaTools(tools_list, DECLARE)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(Exception) as escaped:
        async with run:
            agent = Agent(name="r", model=ScriptedModel(SCRIPT), tools=tools.bind(run))
            await Runner.run(agent, "refund")
    assert _caused_by(escaped.value, ServiceDown)
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_cancelling_the_runner_unwinds(cap: Captured) -> None:
    world = World()
    stalled = asyncio.Event()

    @function_tool
    async def wait_for_human() -> str:
        """Wait for a person."""
        stalled.set()
        await asyncio.Event().wait()
        return "never"

    tools = SagaTools(
        [*refund_tools(world), wait_for_human],
        {**DECLARE, "wait_for_human": Declare(step_class="read")},
    )
    run = cap.saga("refund", tools=tools.registry).run()

    async def agent() -> None:
        async with run:
            model = ScriptedModel([SCRIPT[1], ("call_w", "wait_for_human", {})])
            await Runner.run(Agent(name="r", model=model, tools=tools.bind(run)), "go")

    task = asyncio.create_task(agent())
    await stalled.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


def test_undeclared_tools_are_refused_and_undos_must_take_no_context() -> None:
    with pytest.raises(ConfigurationError, match=r"no declaration\): get_order, get_ticket, "):
        SagaTools(refund_tools(World()), {"issue_credit": DECLARE["issue_credit"]})
    tools = SagaTools(refund_tools(World()), unannotated="irreversible")
    assert tools.registry.get("get_order").step_class is StepClass.IRREVERSIBLE

    @function_tool
    def do(x: int) -> int:
        """Do."""
        return x

    @function_tool
    def undo(ctx: RunContextWrapper[Any], x: int) -> int:
        """Undo."""
        return x

    with pytest.raises(ConfigurationError, match="takes a context"):
        SagaTools(
            [do, undo], {"do": Declare(undo="undo"), "undo": Declare(step_class="convergent")}
        )
    with pytest.raises(ConfigurationError, match="is not a FunctionTool: wrap it"):
        SagaTools([print], {})  # type: ignore[list-item]


class Booth:
    """A seat to hold, whose release runs through the SDK and says what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def tools(self) -> list[FunctionTool]:
        @function_tool
        def hold(seat: int) -> dict[str, str]:
            """Hold a seat; the booking system answers with the seat as text."""
            self.seen.append(("hold", seat))
            return {"seat": str(seat)}

        @function_tool
        def release(seat: Annotated[int, Field(ge=1)]) -> str:
            """Release a seat."""
            self.seen.append(("release", seat, type(seat).__name__))
            return "released"

        @function_tool(failure_error_function=None)
        def pay(seat: int) -> str:
            """Pay; the card is declined."""
            raise RuntimeError("card declined")

        return [hold, release, pay]


BOOTH_SCRIPT = [("call_h", "hold", {"seat": 7}), ("call_p", "pay", {"seat": 7})]


async def _booth_run(cap: Captured, tools_list: list[FunctionTool], undo_args: Any) -> Any:
    tools = SagaTools(
        tools_list,
        {
            "hold": Declare(undo="release", undo_args=undo_args),
            "release": Declare(step_class="convergent"),
            "pay": Declare(step_class="irreversible"),
        },
    )
    run = cap.saga("booking", tools=tools.registry).run()
    with pytest.raises(Exception) as escaped:
        async with run:
            agent = Agent(name="b", model=ScriptedModel(BOOTH_SCRIPT), tools=tools.bind(run))
            await Runner.run(agent, "book")
    assert "card declined" in str(escaped.value)
    assert run.report is not None
    return run.report


async def test_the_undo_runs_through_the_function_tools_own_pipeline(cap: Captured) -> None:
    booth = Booth()
    report = await _booth_run(cap, booth.tools(), {"seat": "result.seat"})
    assert report.status is RunStatus.COMPENSATED
    # The undo's argument came from the result as "7": the SDK's schema made it an int.
    assert booth.seen == [("hold", 7), ("release", 7, "int")]


async def test_undo_args_the_sdk_rejects_fail_the_compensation(cap: Captured) -> None:
    booth = Booth()
    report = await _booth_run(cap, booth.tools(), {"seat": 0})  # the schema says seat >= 1
    assert report.status is RunStatus.COMPENSATION_FAILED
    (failed,) = report.compensations_failed
    assert failed.error == "ModelBehaviorError: Invalid JSON input for tool release"  # the SDK's
    assert booth.seen == [("hold", 7)]  # the function never ran


async def test_an_undo_with_no_python_function_runs_by_its_on_invoke_tool(cap: Captured) -> None:
    """A FunctionTool built by hand has only its on_invoke_tool: the unwind calls that, with
    a ToolContext built for it and the arguments as JSON, as the SDK would."""
    booth = Booth()
    hold, _, pay = booth.tools()
    calls: list[tuple[str, str, str, Any]] = []

    async def on_invoke(ctx: ToolContext[Any], input_json: str) -> str:
        calls.append((ctx.tool_name, ctx.tool_call_id, input_json, ctx.context))
        return "released"

    release = FunctionTool(
        name="release",
        description="Release a seat.",
        params_json_schema={
            "type": "object",
            "properties": {"seat": {"type": "string"}},
            "required": ["seat"],
            "additionalProperties": False,
        },
        on_invoke_tool=on_invoke,
    )
    report = await _booth_run(cap, [hold, release, pay], {"seat": "result.seat"})
    assert report.status is RunStatus.COMPENSATED
    assert calls == [("release", f"{report.run_id}:0:compensate", '{"seat": "7"}', None)]


async def test_an_undo_that_cannot_be_stored_escapes_and_is_never_the_models(
    cap: Captured,
) -> None:
    """The saga's own errors are not the tool's: a write whose undo could not be stored
    is loud (it escapes Runner.run), never a "try again" message that repeats the write."""
    booth = Booth()
    _, release, pay = booth.tools()

    @function_tool
    def hold(seat: int) -> dict[str, float]:
        """Hold a seat; the answer carries no storable reference."""
        booth.seen.append(("hold", seat))
        return {"seat": float("nan")}

    script = [("call_h", "hold", {"seat": 7}), ("call_h2", "hold", {"seat": 7})]
    model = ScriptedModel(script)
    tools = SagaTools(
        [hold, release, pay],
        {
            "hold": Declare(undo="release", undo_args={"seat": "result.seat"}),
            "release": Declare(step_class="convergent"),
            "pay": Declare(step_class="irreversible"),
        },
    )
    run = cap.saga("booking", tools=tools.registry).run()
    with pytest.raises(Exception) as escaped:
        async with run:
            await Runner.run(Agent(name="b", model=model, tools=tools.bind(run)), "book")
    assert _caused_by(escaped.value, ConfigurationError)
    assert "could not be stored" in str(escaped.value)
    assert booth.seen == [("hold", 7)]  # the write ran once: the model never heard of it
    assert len(model.inputs) == 1
    assert run.report is not None and run.report.status is RunStatus.COMPENSATION_FAILED


async def test_a_snapshot_that_fails_is_the_tools_error_for_the_model(cap: Captured) -> None:
    world = World()
    tools_list = refund_tools(world)

    @function_tool
    def get_ticket(ticket_id: str) -> dict[str, Any]:
        """A ticket's status; the ticket system is down."""
        raise RuntimeError("ticket system down")

    tools_list[1] = get_ticket
    model = ScriptedModel([SCRIPT[2]])
    tools = SagaTools(tools_list, DECLARE)
    async with cap.saga("refund", tools=tools.registry).run() as run:
        result = await Runner.run(Agent(name="r", model=model, tools=tools.bind(run)), "go")
    assert result.final_output == "Refund done."
    last_output = [i for i in model.inputs[-1] if i.get("type") == "function_call_output"][-1]
    assert "error occurred while running the tool" in last_output["output"]
    assert run.report is not None and run.report.status is RunStatus.COMPLETED
    assert world.tickets == {"T-9104": "open"}  # the write never ran
