"""The refund world as an MCP server, its tools annotated the way MCP servers do.

``refund_server(world)`` builds it in process (tests and the example connect to it
through memory streams); ``python -m examples.mcp_refund_server`` serves a fresh
world over stdio, for ``saga-otel mcp-tools`` to review, and ``--http PORT`` over
streamable HTTP on 127.0.0.1 (``http://127.0.0.1:PORT/mcp``), so an agent and a
recovery process use the same server.
"""

from __future__ import annotations

import argparse
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

from examples.world import ServiceDown, World

READ = ToolAnnotations(read_only_hint=True)
# Additive, and retried with the same key it converges; undone by reverse_credit.
ADDITIVE = ToolAnnotations(destructive_hint=False, idempotent_hint=True)
# Overwrites the ticket's status: destructive, but the client can write the old one back.
OVERWRITE = ToolAnnotations(destructive_hint=True, idempotent_hint=True)
# Email leaves the building: nothing undoes it.
SEND = ToolAnnotations(destructive_hint=True, idempotent_hint=False, open_world_hint=True)


def refund_server(world: World) -> MCPServer:
    server = MCPServer("refund-world")

    @server.tool(annotations=READ)
    def get_order(order_id: int) -> dict[str, Any]:
        return dict(world.orders[order_id])

    @server.tool(annotations=READ)
    def get_ticket(ticket_id: str) -> dict[str, Any]:
        return {"ticket_id": ticket_id, "status": world.ticket_status(ticket_id)}

    @server.tool(annotations=READ)
    def get_balance(order_id: int) -> dict[str, Any]:
        return {"order_id": order_id, "balance": world.balance(order_id)}

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=False))
    def issue_credit(order_id: int, amount: int, idempotency_key: str = "") -> dict[str, Any]:
        return world.issue_credit(order_id, amount, idempotency_key or None)

    @server.tool(annotations=ADDITIVE)
    def reverse_credit(credit_id: str, idempotency_key: str = "") -> dict[str, Any]:
        try:
            return world.reverse_credit(credit_id, idempotency_key or None)
        except ServiceDown as exc:
            raise ToolError(str(exc)) from exc

    @server.tool(annotations=OVERWRITE)
    def set_ticket_status(ticket_id: str, status: str) -> dict[str, Any]:
        return {"ticket_id": ticket_id, "status": world.set_ticket_status(ticket_id, status)}

    @server.tool(annotations=SEND)
    def send_reply(ticket_id: str, body: str, idempotency_key: str = "") -> dict[str, Any]:
        try:
            return world.send_reply(ticket_id, body, idempotency_key or None)
        except ServiceDown as exc:
            raise ToolError(str(exc)) from exc

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve HTTP on 127.0.0.1:PORT")
    ns = parser.parse_args()
    server = refund_server(World())
    if ns.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=ns.http)


if __name__ == "__main__":
    main()
