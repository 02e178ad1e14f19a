"""The refund agent's tools, declared once with their classes and undo recipes."""

from __future__ import annotations

from typing import Any

from saga_otel import CallInfo, ToolRegistry, tool


class CloseDown(Exception):
    """The ticket system refuses to close tickets right now."""


def refund_tools(world: Any, *, close_fails: bool = False) -> ToolRegistry:
    """A registry bound to one world (a World or a RemoteWorld).

    ``close_fails`` breaks the step after the pivot.
    """

    @tool("read")
    def get_order(order_id: int) -> dict[str, Any]:
        return dict(world.orders[order_id])

    @tool(
        "compensable",
        compensate="reverse_credit",
        compensate_args=lambda i: {"credit_id": i.result["credit_id"]},
        describe="reverse credit {credit_id} ({amount} cents on order {order_id})",
    )
    def issue_credit(order_id: int, amount: int, idempotency_key: str) -> dict[str, Any]:
        return world.issue_credit(order_id, amount, idempotency_key)

    @tool("convergent")
    def reverse_credit(credit_id: str, idempotency_key: str) -> dict[str, Any]:
        return world.reverse_credit(credit_id, idempotency_key)

    def _previous(i: CallInfo) -> dict[str, Any]:
        return {"ticket_id": i.args["ticket_id"], "status": i.snapshot}

    @tool(
        "reversible",
        compensate="set_ticket_status",
        snapshot=lambda ticket_id, status: world.ticket_status(ticket_id),
        compensate_args=_previous,
        describe="set ticket {ticket_id} back to {status!s}",
    )
    def set_ticket_status(ticket_id: str, status: str) -> str:
        return world.set_ticket_status(ticket_id, status)

    @tool("irreversible")
    def send_reply(ticket_id: str, body: str, idempotency_key: str) -> dict[str, Any]:
        return world.send_reply(ticket_id, body, idempotency_key)

    @tool("convergent")
    def close_ticket(ticket_id: str) -> str:
        if close_fails:
            raise CloseDown(f"ticket system rejected close of {ticket_id} (503)")
        return world.set_ticket_status(ticket_id, "closed")

    return ToolRegistry(
        [get_order, issue_credit, reverse_credit, set_ticket_status, send_reply, close_ticket]
    )
