"""What the framework refund examples share: the tools, their declarations, the model's script.

The tools are plain functions; each framework's example wraps them as that
framework's tools (``FunctionToolset``, ``langchain_core.tools.tool``,
``agents.function_tool``), as an agent built on it would. A tool wanting the
saga's stable idempotency key reads it from ``current_call()``: it is not a
parameter, so the model never sees it.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from examples.world import World
from saga_otel import Run, Saga, SagaReport, ToolRegistry, configure, current_call
from saga_otel.adapters import Declare


def refund_functions(world: World) -> list[Callable[..., Any]]:
    """The agent's tools, bound to one world."""

    def key() -> str | None:
        call = current_call()  # the saga's stable key, so a retried write converges
        return call.idempotency_key if call else None

    def get_order(order_id: int) -> dict[str, Any]:
        """Look an order up."""
        return dict(world.orders[order_id])

    def get_ticket(ticket_id: str) -> dict[str, Any]:
        """A ticket's status."""
        return {"ticket_id": ticket_id, "status": world.ticket_status(ticket_id)}

    def issue_credit(order_id: int, amount: int) -> dict[str, Any]:
        """Credit the customer."""
        return world.issue_credit(order_id, amount, key())

    def reverse_credit(credit_id: str) -> dict[str, Any]:
        """Reverse a credit."""
        return world.reverse_credit(credit_id, key())

    def set_ticket_status(ticket_id: str, status: str) -> dict[str, Any]:
        """Set a ticket's status."""
        return {"ticket_id": ticket_id, "status": world.set_ticket_status(ticket_id, status)}

    def send_reply(ticket_id: str, body: str) -> dict[str, Any]:
        """Email the customer."""
        return world.send_reply(ticket_id, body, key())

    return [get_order, get_ticket, issue_credit, reverse_credit, set_ticket_status, send_reply]


# These frameworks' tools carry no class: each is declared once, here.
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

# The calls a model would make, each with the id the model gave it.
SCRIPT: list[tuple[str, str, dict[str, Any]]] = [
    ("call_1", "get_order", {"order_id": 4921}),
    ("call_2", "issue_credit", {"order_id": 4921, "amount": 2500}),
    ("call_3", "set_ticket_status", {"ticket_id": "T-9104", "status": "refunded"}),
    ("call_4", "send_reply", {"ticket_id": "T-9104", "body": "We credited 2500 cents."}),
]

PROMPT = "Refund order 4921."


class Tools(Protocol):
    """An adapter's ``SagaTools``, as the example runs it."""

    @property
    def registry(self) -> ToolRegistry: ...

    def review(self) -> str: ...


T = TypeVar("T", bound=Tools)


async def run_agent(saga: Saga, agent: Callable[[Run], Awaitable[str]]) -> SagaReport:
    """One saga run around one agent run: the saga run ends when the agent's run ends."""
    run = saga.run()
    try:
        async with run:
            print("agent:", await agent(run))
    except Exception as exc:
        print(f"the agent's run failed: {exc}")
    assert run.report is not None
    return run.report


def main(
    description: str | None,
    tools_for: Callable[[World], T],
    agent: Callable[[T, Run], Awaitable[str]],
) -> None:
    """The command line every framework refund example takes: ``--mail-down``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mail-down", action="store_true", help="the mail service is down")
    world = World(mail_down=parser.parse_args().mail_down)
    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, if set
    tools = tools_for(world)
    print(tools.review())
    try:
        saga = Saga("refund", tools=tools.registry)
        report = asyncio.run(run_agent(saga, lambda run: agent(tools, run)))
    finally:
        export.shutdown()
    print_outcome(world, report)


def print_outcome(world: World, report: SagaReport) -> None:
    print(f"run {report.run_id}: {report.status.value}")
    print("ledger:", world.ledger)
    print("ticket:", world.tickets)
