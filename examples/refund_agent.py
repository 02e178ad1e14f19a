"""The refund agent: the model picks tools at runtime; the saga pushes one undo per write.

Run it: ``python -m examples.refund_agent [--mail-down] [--close-fails]``; set
``SAGA_OTEL_SIDECAR_ENDPOINT`` (e.g. ``http://127.0.0.1:4318``) to send its spans to a sidecar.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from examples.refund_tools import refund_tools
from examples.world import World
from saga_otel import Run, Saga, SagaReport, configure


async def refund_agent(run: Run, order_id: int = 4921) -> dict[str, Any]:
    """What a model-driven dispatcher would do, one tool call at a time."""
    order = await run.call("get_order", order_id=order_id)
    credit = await run.call("issue_credit", order_id=order_id, amount=order["amount"])
    await run.call("set_ticket_status", ticket_id=order["ticket_id"], status="refunded")
    reply = await run.call(
        "send_reply",
        ticket_id=order["ticket_id"],
        body=f"We credited {order['amount']} cents ({credit['credit_id']}).",
    )
    await run.call("close_ticket", ticket_id=order["ticket_id"])
    return {"credit": credit, "reply": reply}


async def run_refund(saga: Saga, order_id: int = 4921) -> SagaReport:
    """One run; the agent's exception (if any) is re-raised by the run and caught here."""
    run = saga.run()
    try:
        async with run:
            await refund_agent(run, order_id)
    except Exception:
        pass  # the report below says what happened; the exception is report.error
    assert run.report is not None
    return run.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mail-down", action="store_true", help="the mail service is down")
    parser.add_argument("--close-fails", action="store_true", help="fail after the pivot")
    ns = parser.parse_args()
    # With SAGA_OTEL_SIDECAR_ENDPOINT set, the spans go to that sidecar; without, nowhere.
    export = configure()
    world = World(mail_down=ns.mail_down)
    saga = Saga("refund", tools=refund_tools(world, close_fails=ns.close_fails))
    try:
        report = asyncio.run(run_refund(saga))
    finally:
        export.shutdown()
    print(f"run {report.run_id}: {report.status.value}")
    print("ledger:", world.ledger)
    print("ticket:", world.tickets)
    card = report.escalation_card()
    if card is not None:
        print(card.render())


if __name__ == "__main__":
    main()
