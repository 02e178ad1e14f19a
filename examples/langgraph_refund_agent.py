"""The refund agent as a LangGraph graph whose ToolNode runs LangChain tools as saga steps.

Run it: ``python -m examples.langgraph_refund_agent [--mail-down]``. A fake chat
model from langchain_core (offline, no key) asks for the tool calls a real one
would. With the mail down the reply raises, the error escapes the graph, and
the saga unwinds through the same tools: ticket reopened, credit reversed.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Annotated, Any, TypedDict

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage
from langchain_core.tools import BaseTool, tool
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition

from examples.world import World
from saga_otel import Saga, SagaReport, configure, current_call
from saga_otel.adapters.langchain import Declare, SagaTools


def refund_tools(world: World) -> list[BaseTool]:
    """The agent's LangChain tools, as any LangGraph agent would have them."""

    def key() -> str | None:
        call = current_call()  # the saga's stable key, so a retried write converges
        return call.idempotency_key if call else None

    @tool
    def get_order(order_id: int) -> dict[str, Any]:
        """Look an order up."""
        return dict(world.orders[order_id])

    @tool
    def get_ticket(ticket_id: str) -> dict[str, Any]:
        """A ticket's status."""
        return {"ticket_id": ticket_id, "status": world.ticket_status(ticket_id)}

    @tool
    def issue_credit(order_id: int, amount: int) -> dict[str, Any]:
        """Credit the customer."""
        return world.issue_credit(order_id, amount, key())

    @tool
    def reverse_credit(credit_id: str) -> dict[str, Any]:
        """Reverse a credit."""
        return world.reverse_credit(credit_id, key())

    @tool
    def set_ticket_status(ticket_id: str, status: str) -> dict[str, Any]:
        """Set a ticket's status."""
        return {"ticket_id": ticket_id, "status": world.set_ticket_status(ticket_id, status)}

    @tool
    def send_reply(ticket_id: str, body: str) -> dict[str, Any]:
        """Email the customer."""
        return world.send_reply(ticket_id, body, key())

    return [get_order, get_ticket, issue_credit, reverse_credit, set_ticket_status, send_reply]


# LangChain tools carry no class: each is declared once, here.
DECLARE = {
    "get_order": Declare(step_class="read"),
    "get_ticket": Declare(step_class="read"),
    "issue_credit": Declare(undo="reverse_credit", undo_args={"credit_id": "result.credit_id"}),
    "reverse_credit": Declare(step_class="convergent"),
    "set_ticket_status": Declare(
        undo="set_ticket_status",
        snapshot="get_ticket",
        undo_args={"ticket_id": "args.ticket_id", "status": "snapshot.status"},
    ),
    "send_reply": Declare(step_class="irreversible"),
}

SCRIPT: list[tuple[str, str, dict[str, Any]]] = [
    ("call_1", "get_order", {"order_id": 4921}),
    ("call_2", "issue_credit", {"order_id": 4921, "amount": 2500}),
    ("call_3", "set_ticket_status", {"ticket_id": "T-9104", "status": "refunded"}),
    ("call_4", "send_reply", {"ticket_id": "T-9104", "body": "We credited 2500 cents."}),
]


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def scripted_model(script: list[tuple[str, str, dict[str, Any]]]) -> GenericFakeChatModel:
    """A fake chat model that asks for the scripted calls one per turn, then answers."""
    turns = [
        AIMessage("", tool_calls=[{"name": name, "args": args, "id": call_id}])
        for call_id, name, args in script
    ]
    return GenericFakeChatModel(messages=iter([*turns, AIMessage("Refund done.")]))


def build_graph(model: GenericFakeChatModel, tools: list[BaseTool]) -> Any:
    """The usual agent loop: the model, then a ToolNode while the model asks for tools."""

    def agent(state: State) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


async def run_graph(saga: Saga, tools: SagaTools) -> SagaReport:
    run = saga.run()
    try:
        async with run:  # the saga run ends when the graph's run ends
            graph = build_graph(scripted_model(SCRIPT), tools.bind(run))
            out = await graph.ainvoke({"messages": [("user", "Refund order 4921.")]})
            print("agent:", out["messages"][-1].content)
    except Exception as exc:
        print(f"the graph's run failed: {exc}")
    assert run.report is not None
    return run.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mail-down", action="store_true", help="the mail service is down")
    ns = parser.parse_args()
    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, if set
    world = World(mail_down=ns.mail_down)
    tools = SagaTools(refund_tools(world), DECLARE)
    print(tools.review())
    try:
        report = asyncio.run(run_graph(Saga("refund", tools=tools.registry), tools))
    finally:
        export.shutdown()
    print(f"run {report.run_id}: {report.status.value}")
    print("ledger:", world.ledger)
    print("ticket:", world.tickets)


if __name__ == "__main__":
    main()
