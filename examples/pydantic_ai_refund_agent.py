"""The refund agent on pydantic-ai: the agent's own tools, declared once, run as saga steps.

Run it: ``python -m examples.pydantic_ai_refund_agent [--mail-down]``. A scripted
model (pydantic-ai's FunctionModel: offline, no key) calls the tools as a real
one would. With the mail down the reply raises, the error escapes ``agent.run``
and the saga unwinds through the same tools: ticket reopened, credit reversed.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from examples.world import World
from saga_otel import Saga, SagaReport, configure, current_call
from saga_otel.adapters.pydantic_ai import Declare, SagaTools


def refund_toolset(world: World) -> FunctionToolset[None]:
    """The agent's tools, as any pydantic-ai agent would have them."""
    tools: FunctionToolset[None] = FunctionToolset()

    def key() -> str | None:
        call = current_call()  # the saga's stable key, so a retried write converges
        return call.idempotency_key if call else None

    @tools.tool_plain
    def get_order(order_id: int) -> dict[str, Any]:
        """Look an order up."""
        return dict(world.orders[order_id])

    @tools.tool_plain
    def get_ticket(ticket_id: str) -> dict[str, Any]:
        """A ticket's status."""
        return {"ticket_id": ticket_id, "status": world.ticket_status(ticket_id)}

    @tools.tool_plain
    def issue_credit(order_id: int, amount: int) -> dict[str, Any]:
        """Credit the customer."""
        return world.issue_credit(order_id, amount, key())

    @tools.tool_plain
    def reverse_credit(credit_id: str) -> dict[str, Any]:
        """Reverse a credit."""
        return world.reverse_credit(credit_id, key())

    @tools.tool_plain
    def set_ticket_status(ticket_id: str, status: str) -> dict[str, Any]:
        """Set a ticket's status."""
        return {"ticket_id": ticket_id, "status": world.set_ticket_status(ticket_id, status)}

    @tools.tool_plain
    def send_reply(ticket_id: str, body: str) -> dict[str, Any]:
        """Email the customer."""
        return world.send_reply(ticket_id, body, key())

    return tools


# pydantic-ai tools carry no class: each is declared once, here.
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


def scripted_model(script: list[tuple[str, str, dict[str, Any]]]) -> FunctionModel:
    """A model that makes the scripted calls one per turn, then answers."""
    turns = iter(script)

    def respond(_messages: list[ModelMessage], _info: AgentInfo) -> ModelResponse:
        step = next(turns, None)
        if step is None:
            return ModelResponse(parts=[TextPart("Refund done.")])
        call_id, name, args = step
        return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=call_id)])

    return FunctionModel(respond)


async def run_agent(saga: Saga, tools: SagaTools) -> SagaReport:
    agent = Agent(scripted_model(SCRIPT))
    run = saga.run()
    try:
        async with run:  # the saga run ends when the agent's run ends
            result = await agent.run("Refund order 4921.", toolsets=[tools.toolset(run)])
            print("agent:", result.output)
    except Exception as exc:
        print(f"the agent's run failed: {exc}")
    assert run.report is not None
    return run.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mail-down", action="store_true", help="the mail service is down")
    ns = parser.parse_args()
    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, if set
    world = World(mail_down=ns.mail_down)
    tools = SagaTools(refund_toolset(world), DECLARE)
    print(tools.review())
    try:
        report = asyncio.run(run_agent(Saga("refund", tools=tools.registry), tools))
    finally:
        export.shutdown()
    print(f"run {report.run_id}: {report.status.value}")
    print("ledger:", world.ledger)
    print("ticket:", world.tickets)


if __name__ == "__main__":
    main()
