"""The refund agent on the OpenAI Agents SDK: its function tools run as saga steps.

Run it: ``python -m examples.openai_agents_refund_agent [--mail-down]``. A scripted
``Model`` (offline, no key; the SDK's tracing export is off) asks for the calls a
real model would. The SDK hands a tool's exception to the model by default; this
agent asks for ``unwind_on_tool_error``, so with the mail down the failed reply
unwinds the saga through the same tools: ticket reopened, credit reversed.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    Model,
    ModelResponse,
    Runner,
    Usage,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from examples.world import World
from saga_otel import Saga, SagaReport, configure, current_call
from saga_otel.adapters.openai_agents import Declare, SagaTools


def refund_tools(world: World) -> list[FunctionTool]:
    """The agent's function tools, as any Agents SDK agent would have them."""

    def key() -> str | None:
        call = current_call()  # the saga's stable key, so a retried write converges
        return call.idempotency_key if call else None

    @function_tool
    def get_order(order_id: int) -> dict[str, Any]:
        """Look an order up."""
        return dict(world.orders[order_id])

    @function_tool
    def get_ticket(ticket_id: str) -> dict[str, Any]:
        """A ticket's status."""
        return {"ticket_id": ticket_id, "status": world.ticket_status(ticket_id)}

    @function_tool
    def issue_credit(order_id: int, amount: int) -> dict[str, Any]:
        """Credit the customer."""
        return world.issue_credit(order_id, amount, key())

    @function_tool
    def reverse_credit(credit_id: str) -> dict[str, Any]:
        """Reverse a credit."""
        return world.reverse_credit(credit_id, key())

    @function_tool
    def set_ticket_status(ticket_id: str, status: str) -> dict[str, Any]:
        """Set a ticket's status."""
        return {"ticket_id": ticket_id, "status": world.set_ticket_status(ticket_id, status)}

    @function_tool
    def send_reply(ticket_id: str, body: str) -> dict[str, Any]:
        """Email the customer."""
        return world.send_reply(ticket_id, body, key())

    return [get_order, get_ticket, issue_credit, reverse_credit, set_ticket_status, send_reply]


# Function tools carry no class: each is declared once, here.
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


class ScriptedModel(Model):
    """A Model that asks for the scripted calls one per turn, then answers."""

    def __init__(self, script: list[tuple[str, str, dict[str, Any]]]) -> None:
        self.turns = iter(script)
        self.inputs: list[Any] = []  # what the model was shown each turn

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        self.inputs.append(kwargs.get("input", args[1] if len(args) > 1 else None))
        step = next(self.turns, None)
        if step is None:
            text = ResponseOutputText(type="output_text", text="Refund done.", annotations=[])
            item: Any = ResponseOutputMessage(
                id="msg", type="message", role="assistant", status="completed", content=[text]
            )
        else:
            call_id, name, args_ = step
            item = ResponseFunctionToolCall(
                type="function_call", call_id=call_id, name=name, arguments=_json(args_)
            )
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


async def run_agent(saga: Saga, tools: SagaTools, model: Model) -> SagaReport:
    run = saga.run()
    try:
        async with run:  # the saga run ends when the agent's run ends
            agent = Agent(name="refunds", model=model, tools=tools.bind(run))
            result = await Runner.run(agent, "Refund order 4921.")
            print("agent:", result.final_output)
    except Exception as exc:
        print(f"the agent's run failed: {exc}")
    assert run.report is not None
    return run.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mail-down", action="store_true", help="the mail service is down")
    ns = parser.parse_args()
    set_tracing_disabled(True)  # no export to OpenAI: the saga's spans go to the sidecar
    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, if set
    world = World(mail_down=ns.mail_down)
    tools = SagaTools(refund_tools(world), DECLARE, unwind_on_tool_error=True)
    print(tools.review())
    try:
        saga = Saga("refund", tools=tools.registry)
        report = asyncio.run(run_agent(saga, tools, ScriptedModel(SCRIPT)))
    finally:
        export.shutdown()
    print(f"run {report.run_id}: {report.status.value}")
    print("ledger:", world.ledger)
    print("ticket:", world.tickets)


if __name__ == "__main__":
    main()
