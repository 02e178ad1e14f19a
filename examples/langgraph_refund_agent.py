"""The refund agent as a LangGraph graph whose ToolNode runs LangChain tools as saga steps.

Run it: ``python -m examples.langgraph_refund_agent [--mail-down]``. A fake chat
model from langchain_core (offline, no key) asks for the tool calls a real one
would. With the mail down the reply raises, the error escapes the graph, and
the saga unwinds through the same tools: ticket reopened, credit reversed.
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage
from langchain_core.tools import BaseTool, tool
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition

from examples import framework_refund
from examples.framework_refund import DECLARE, PROMPT, SCRIPT, refund_functions
from examples.world import World
from saga_otel import Run
from saga_otel.adapters.langchain import SagaTools

__all__ = ["DECLARE", "SCRIPT", "build_graph", "refund_tools", "scripted_model"]


def refund_tools(world: World) -> list[BaseTool]:
    """The agent's LangChain tools, as any LangGraph agent would have them."""
    return [tool(fn) for fn in refund_functions(world)]


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


async def agent(tools: SagaTools, run: Run) -> str:
    graph = build_graph(scripted_model(SCRIPT), tools.bind(run))
    out = await graph.ainvoke({"messages": [("user", PROMPT)]})
    return str(out["messages"][-1].content)


if __name__ == "__main__":
    framework_refund.main(__doc__, lambda world: SagaTools(refund_tools(world), DECLARE), agent)
