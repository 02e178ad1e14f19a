"""An agent process for the demo and the end-to-end tests.

It exports its saga spans to the sidecar (durably), runs one refund against
the world server and prints one JSON line with the run id and status.
``--pause-after issue_credit`` stops right after that call returned, prints
``{"event": "paused", ...}`` and waits, so a test can kill it there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from examples.refund_tools import refund_tools
from examples.world_server import RemoteWorld
from saga_otel import Run, Saga, configure, start_metrics_server


async def agent(run: Run, pause_after: str | None, order_id: int) -> None:
    def checkpoint(step: str) -> None:
        if pause_after == step:
            print(json.dumps({"event": "paused", "run_id": run.run_id, "after": step}), flush=True)
            time.sleep(3600)  # the test kills us here

    order = await run.call("get_order", order_id=order_id)
    checkpoint("get_order")
    credit = await run.call("issue_credit", order_id=order_id, amount=order["amount"])
    checkpoint("issue_credit")
    await run.call("set_ticket_status", ticket_id=order["ticket_id"], status="refunded")
    checkpoint("set_ticket_status")
    await run.call(
        "send_reply",
        ticket_id=order["ticket_id"],
        body=f"We credited {order['amount']} cents ({credit['credit_id']}).",
    )
    await run.call("close_ticket", ticket_id=order["ticket_id"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", required=True, help="the world server's URL")
    p.add_argument("--otlp", required=True, help="the sidecar's OTLP/HTTP base URL")
    p.add_argument("--pause-after", default=None)
    p.add_argument("--close-fails", action="store_true")
    p.add_argument("--order", type=int, default=4921)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--metrics-port", type=int, default=None)
    ns = p.parse_args()
    export = configure(ns.otlp)
    if ns.metrics_port is not None:
        start_metrics_server(ns.metrics_port)
    saga = Saga("refund", tools=refund_tools(RemoteWorld(ns.world), close_fails=ns.close_fails))

    async def one() -> None:
        run = saga.run()
        try:
            async with run:
                await agent(run, ns.pause_after, ns.order)
        except Exception:
            pass  # the report says how it ended
        assert run.report is not None
        print(json.dumps({"run_id": run.run_id, "status": run.report.status.value}), flush=True)

    for _ in range(ns.runs):
        asyncio.run(one())
    export.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
