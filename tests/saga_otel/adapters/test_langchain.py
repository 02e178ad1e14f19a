"""The LangChain adapter in a real LangGraph graph, with langchain_core's fake chat model."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import pytest
from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool, InjectedToolCallId, ToolException, tool

from examples.langgraph_refund_agent import (
    DECLARE,
    SCRIPT,
    build_graph,
    refund_tools,
    scripted_model,
)
from examples.world import ServiceDown, World
from saga_otel import ConfigurationError, RunStatus
from saga_otel import semconv as sc
from saga_otel.adapters.langchain import Declare, SagaTools, ToolErrorUnwind
from saga_otel.testing import Captured, capture, contract_violations, span_attrs


@pytest.fixture
def cap() -> Captured:
    return capture()


async def test_refund_story_unwinds_in_reverse_through_the_langchain_tools(
    cap: Captured,
) -> None:
    world = World(mail_down=True)
    tools = SagaTools(refund_tools(world), DECLARE)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(ServiceDown):
        async with run:
            graph = build_graph(scripted_model(SCRIPT), tools.bind(run))
            await graph.ainvoke({"messages": [("user", "refund")]})
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
    assert json.loads(undos[0][sc.SAGA_COMPENSATION_ARGS]) == {
        "ticket_id": "T-9104",
        "status": "open",
    }


def _with_flaky(world: World) -> list[BaseTool]:
    @tool
    def notify(ticket_id: str) -> str:
        """A flaky notification."""
        raise ToolException(f"ticket {ticket_id} is locked, try later")

    notify.handle_tool_error = True  # LangChain hands the error to the model as a ToolMessage
    return [*refund_tools(world), notify]


FLAKY_SCRIPT = [SCRIPT[1], ("call_n", "notify", {"ticket_id": "T-9104"}), SCRIPT[2]]
FLAKY_DECLARE = {**DECLARE, "notify": Declare(step_class="convergent")}


async def test_a_handled_tool_error_is_a_failed_step_handed_to_the_model(cap: Captured) -> None:
    world = World()
    tools = SagaTools(_with_flaky(world), FLAKY_DECLARE)
    async with cap.saga("refund", tools=tools.registry).run() as run:
        graph = build_graph(scripted_model(FLAKY_SCRIPT), tools.bind(run))
        out = await graph.ainvoke({"messages": [("user", "go")]})
    handed = [m for m in out["messages"] if isinstance(m, ToolMessage) and m.status == "error"]
    assert len(handed) == 1 and "is locked" in str(handed[0].content)
    assert handed[0].tool_call_id == "call_n"
    assert run.report is not None and run.report.status is RunStatus.COMPLETED
    assert [(s.name, s.ok) for s in run.report.steps] == [
        ("issue_credit", True),
        ("notify", False),
        ("set_ticket_status", True),
    ]
    assert cap.spans(phase="unwind") == [] and world.balance(4921) == 2500


async def test_unwind_on_tool_error_unwinds_instead(cap: Captured) -> None:
    world = World()
    tools = SagaTools(_with_flaky(world), FLAKY_DECLARE, unwind_on_tool_error=True)
    run = cap.saga("refund", tools=tools.registry).run()
    with pytest.raises(ToolErrorUnwind, match="is locked"):
        async with run:
            graph = build_graph(scripted_model(FLAKY_SCRIPT), tools.bind(run))
            await graph.ainvoke({"messages": [("user", "go")]})
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_cancelling_the_graph_unwinds(cap: Captured) -> None:
    world = World()
    stalled = asyncio.Event()

    @tool
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
            script = [SCRIPT[1], ("call_w", "wait_for_human", {})]
            await build_graph(scripted_model(script), tools.bind(run)).ainvoke(
                {"messages": [("user", "go")]}
            )

    task = asyncio.create_task(agent())
    await stalled.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert world.balance(4921) == 0


async def test_bound_tools_keep_name_description_and_schema(cap: Captured) -> None:
    original = refund_tools(World())
    tools = SagaTools(original, DECLARE)
    async with cap.saga("refund", tools=tools.registry).run() as run:
        bound = tools.bind(run)
        assert [(t.name, t.description, t.args) for t in bound] == [
            (t.name, t.description, t.args) for t in original
        ]
        with pytest.raises(ConfigurationError, match="ainvoke"):
            bound[0].invoke({"order_id": 4921})
        got: Any = await bound[0].ainvoke({"order_id": 4921})
    assert got["ticket_id"] == "T-9104"


def test_undeclared_tools_are_refused_listing_each() -> None:
    with pytest.raises(ConfigurationError, match=r"no declaration\): get_order, get_ticket, "):
        SagaTools(refund_tools(World()), {"issue_credit": DECLARE["issue_credit"]})
    with pytest.raises(ConfigurationError, match="not a LangChain tool"):
        SagaTools([print], {})  # type: ignore[list-item]


async def test_a_tool_taking_its_call_id_gets_the_models_and_its_undo_the_key(
    cap: Captured,
) -> None:
    """InjectedToolCallId: LangChain fills it from the ToolCall. The model's call gets the
    model's id, the undo (no ToolCall: no model asked for it) the compensation's key."""
    seen: list[tuple[str, str]] = []

    @tool
    def hold(seat: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> dict[str, int]:
        """Hold a seat."""
        seen.append(("hold", tool_call_id))
        return {"seat": seat}

    @tool
    def release(seat: int, call: Annotated[str, InjectedToolCallId]) -> str:
        """Release a seat."""
        seen.append(("release", call))
        return "released"

    tools = SagaTools(
        [hold, release],
        {"hold": Declare(undo="release"), "release": Declare(step_class="convergent")},
    )
    run = cap.saga("booking", tools=tools.registry).run()
    with pytest.raises(RuntimeError, match="card declined"):
        async with run:
            call = {"type": "tool_call", "id": "call_1", "name": "hold", "args": {"seat": 7}}
            out = await tools.bind(run)[0].ainvoke(call)
            raise RuntimeError("card declined")
    assert isinstance(out, ToolMessage) and out.tool_call_id == "call_1"
    assert json.loads(str(out.content)) == {"seat": 7}
    assert run.report is not None and run.report.status is RunStatus.COMPENSATED
    assert seen == [("hold", "call_1"), ("release", f"{run.run_id}:0:compensate")]


class _Search(BaseTool):
    """A BaseTool subclass declaring no args_schema: LangChain reads it from _run."""

    name: str = "search"
    description: str = "Search the orders."

    def _run(self, query: str, limit: int = 5) -> str:
        return f"{limit} hits for {query}"


async def test_a_subclass_without_a_schema_keeps_the_one_from_its_run(cap: Captured) -> None:
    original = _Search()
    tools = SagaTools([original], {"search": Declare(step_class="read")})
    async with cap.saga("s", tools=tools.registry).run() as run:
        (bound,) = tools.bind(run)
        shown = bound.tool_call_schema.model_json_schema()  # type: ignore[union-attr]
        assert bound.args == original.args and set(shown["properties"]) == {"query", "limit"}
        assert await bound.ainvoke({"query": "x", "limit": "2"}) == "2 hits for x"


async def test_bound_tools_keep_return_direct_artifacts_and_validation_handling(
    cap: Captured,
) -> None:
    @tool(return_direct=True, response_format="content_and_artifact")
    def search(q: str) -> tuple[str, dict[str, list[int]]]:
        """Search."""
        return f"1 hit for {q}", {"rows": [1, 2, 3]}

    search.handle_validation_error = "bad arguments, try again"
    tools = SagaTools([search], {"search": Declare(step_class="read")})
    async with cap.saga("s", tools=tools.registry).run() as run:
        (bound,) = tools.bind(run)
        assert bound.return_direct and bound.response_format == "content_and_artifact"
        call = {"type": "tool_call", "id": "c1", "name": "search", "args": {"q": "x"}}
        message = await bound.ainvoke(call)
        bad = await bound.ainvoke({**call, "id": "c2", "args": {"q": None}})
    assert (message.content, message.artifact) == ("1 hit for x", {"rows": [1, 2, 3]})
    assert bad.content == "bad arguments, try again" and bad.tool_call_id == "c2"
    assert run.report is not None and [s.name for s in run.report.steps] == ["search"]
