"""The refund agent on MCP: the server's tools become saga steps through their annotations.

Run it: ``python -m examples.mcp_refund_agent [--mail-down]``. It prints the tool
mapping for review, then runs the refund the way a model would call the tools,
each call with the model's call id. With the mail down the reply fails and the
saga unwinds in reverse through the same MCP tools: the ticket is set back to
open and the credit reversed.

``--server URL`` uses an MCP server over HTTP (``python -m
examples.mcp_refund_server --http PORT``) instead of one in process;
``--pause-after TOOL`` prints the run id and waits there, to be killed. Then
``SAGA_MCP_SERVER=URL saga-otel recover RUN_ID --tools
examples.mcp_refund_agent:recovery_registry`` unwinds it through the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from mcp import Client

from examples.framework_refund import SCRIPT, print_outcome
from examples.mcp_refund_server import refund_server
from examples.world import World
from saga_otel import Saga, SagaReport, ToolRegistry, configure
from saga_otel.adapters.mcp import (
    Declare,
    McpTools,
    blocking_registry,
    decode_result,
    load_tools,
)

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


async def run_script(saga: Saga, tools: McpTools, pause_after: str | None = None) -> SagaReport:
    """One run: each scripted call goes through the run; a failure escaping it unwinds."""
    run = saga.run()
    try:
        async with run:
            session = tools.bind(run)
            for call_id, name, args in SCRIPT:
                result = await session.call_tool(name, args, call_id=call_id)
                print(f"  {call_id} {name} -> {decode_result(result)}")
                if name == pause_after:
                    print(json.dumps({"run_id": run.run_id}), flush=True)
                    await asyncio.Event().wait()  # until killed
    except Exception as exc:
        print(f"  the run failed: {exc}")
    assert run.report is not None
    return run.report


async def main_async(
    world: World, server: str | None = None, pause_after: str | None = None
) -> SagaReport:
    async with Client(server or refund_server(world)) as client:
        # The reply failing is the refund story's failure: ask for an unwind on tool errors.
        tools = await load_tools(client.session, DECLARE, unwind_on_tool_error=True)
        print(tools.review())
        return await run_script(Saga("refund", tools=tools.registry), tools, pause_after)


def recovery_registry() -> ToolRegistry:
    """For ``saga-otel recover --tools examples.mcp_refund_agent:recovery_registry``:
    the same server's tools, declared the same way, as blocking functions."""
    url = os.environ.get("SAGA_MCP_SERVER")
    if not url:
        raise RuntimeError(
            "set SAGA_MCP_SERVER to the MCP server's URL, e.g. http://127.0.0.1:8000/mcp"
        )
    return blocking_registry(lambda: Client(url), DECLARE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mail-down", action="store_true", help="the mail service is down")
    parser.add_argument("--server", metavar="URL", help="an MCP server over HTTP, not in process")
    parser.add_argument("--pause-after", metavar="TOOL", help="print the run id there and wait")
    ns = parser.parse_args()
    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, if set
    world = World(mail_down=ns.mail_down)
    try:
        report = asyncio.run(main_async(world, ns.server, ns.pause_after))
    finally:
        export.shutdown()
    print_outcome(world, report)


if __name__ == "__main__":
    main()
