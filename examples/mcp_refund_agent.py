"""The refund agent on MCP: the server's tools become saga steps through their annotations.

Run it: ``python -m examples.mcp_refund_agent [--mail-down]``. It prints the tool
mapping for review, then runs the refund the way a model would call the tools,
each call with the model's call id. With the mail down the reply fails and the
saga unwinds in reverse through the same MCP tools: the ticket is set back to
open and the credit reversed.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from mcp import Client

from examples.mcp_refund_server import refund_server
from examples.world import World
from saga_otel import Saga, SagaReport, configure
from saga_otel.adapters.mcp import Declare, McpTools, decode_result, load_tools

# What the annotations cannot say: which tool undoes which, with what arguments.
DECLARE = {
    "issue_credit": Declare(
        undo="reverse_credit",
        undo_args={"credit_id": "result.credit_id"},
        describe="reverse credit {credit_id}",
    ),
    # Overwrites the status: read it first, write it back to undo.
    "set_ticket_status": Declare(
        undo="set_ticket_status",
        snapshot="get_ticket",
        undo_args={"ticket_id": "args.ticket_id", "status": "snapshot.status"},
    ),
}

# The calls a model would make, each with the id the model gave it.
SCRIPT: list[tuple[str, str, dict[str, Any]]] = [
    ("call_1", "get_order", {"order_id": 4921}),
    ("call_2", "issue_credit", {"order_id": 4921, "amount": 2500}),
    ("call_3", "set_ticket_status", {"ticket_id": "T-9104", "status": "refunded"}),
    ("call_4", "send_reply", {"ticket_id": "T-9104", "body": "We credited 2500 cents."}),
]


async def run_script(saga: Saga, tools: McpTools) -> SagaReport:
    """One run: each scripted call goes through the run; a failure escaping it unwinds."""
    run = saga.run()
    try:
        async with run:
            session = tools.bind(run)
            for call_id, name, args in SCRIPT:
                result = await session.call_tool(name, args, call_id=call_id)
                print(f"  {call_id} {name} -> {decode_result(result)}")
    except Exception as exc:
        print(f"  the run failed: {exc}")
    assert run.report is not None
    return run.report


async def main_async(world: World) -> SagaReport:
    async with Client(refund_server(world)) as client:
        # The reply failing is the refund story's failure: ask for an unwind on tool errors.
        tools = await load_tools(client.session, DECLARE, unwind_on_tool_error=True)
        print(tools.review())
        return await run_script(Saga("refund", tools=tools.registry), tools)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mail-down", action="store_true", help="the mail service is down")
    ns = parser.parse_args()
    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, if set
    world = World(mail_down=ns.mail_down)
    try:
        report = asyncio.run(main_async(world))
    finally:
        export.shutdown()
    print(f"run {report.run_id}: {report.status.value}")
    print("ledger:", world.ledger)
    print("ticket:", world.tickets)


if __name__ == "__main__":
    main()
