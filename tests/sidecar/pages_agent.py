"""A real agent for the browser tests: one checkout run that ends the way ``--mode`` says.

``compensated``: a step before the pivot fails and both undos work.
``compensation_failed``: the same, but billing refuses the refund.
``stuck``: the step after the pivot (an e-mail already sent) fails.
``orphaned``: prints ``{"event": "paused", ...}`` after the charge and waits to be killed.
Prints one JSON line ``{"run_id": ..., "status": ...}`` when the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from saga_otel import RetryPolicy, Saga, ToolRegistry, configure, tool

MODES = ("compensated", "compensation_failed", "stuck", "orphaned")


class Refused(Exception):
    """A backend said no."""


def tools(mode: str) -> ToolRegistry:
    @tool(
        "compensable",
        compensate="refund_charge",
        compensate_args=lambda i: {"charge_id": i.result["charge_id"]},
        describe="refund charge {charge_id}",
    )
    def charge_card(order: str, amount: int) -> dict[str, Any]:
        return {"charge_id": f"ch_{order}"}

    @tool("convergent")
    def refund_charge(charge_id: str) -> str:
        if mode == "compensation_failed":
            raise Refused(f"billing refused the refund of {charge_id} (503)")
        return "refunded"

    @tool(
        "reversible",
        compensate="release_stock",
        compensate_args=lambda i: {"hold_id": i.result},
        describe="release stock hold {hold_id}",
    )
    def hold_stock(sku: str) -> str:
        return f"hold_{sku}"

    @tool("convergent")
    def release_stock(hold_id: str) -> str:
        return f"released {hold_id}"

    @tool("read")
    def check_fraud(order: str) -> str:
        raise Refused(f"fraud service timed out on order {order}")

    @tool("irreversible")
    def send_receipt(order: str, to: str) -> str:
        return f"sent receipt for {order} to {to}"

    @tool("convergent")
    def ship_order(order: str) -> str:
        raise Refused(f"warehouse rejected order {order}: address incomplete")

    return ToolRegistry(
        [charge_card, refund_charge, hold_stock, release_stock, check_fraud, send_receipt,
         ship_order]
    )  # fmt: skip


async def checkout(saga: Saga, mode: str, order: str) -> None:
    run = saga.run()
    try:
        async with run:
            await run.call("charge_card", order=order, amount=4200)
            if mode == "orphaned":
                print(json.dumps({"event": "paused", "run_id": run.run_id}), flush=True)
                await asyncio.sleep(3600)  # the test kills us here
            await run.call("hold_stock", sku="SKU-7")
            if mode == "stuck":
                await run.call("send_receipt", order=order, to="ana@example.com")
                await run.call("ship_order", order=order)
            else:
                await run.call("check_fraud", order=order)
    except Exception:
        pass  # the report says how it ended
    assert run.report is not None
    print(json.dumps({"run_id": run.run_id, "status": run.report.status.value}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--otlp", required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--order", default="A-1001")
    p.add_argument("--token", default=None)
    ns = p.parse_args()
    headers = {"Authorization": f"Bearer {ns.token}"} if ns.token else None
    export = configure(ns.otlp, headers=headers)
    saga = Saga(
        "checkout", tools=tools(ns.mode), retry=RetryPolicy(attempts=2, initial=0.01, maximum=0.02)
    )
    asyncio.run(checkout(saga, ns.mode, ns.order))
    export.shutdown()


if __name__ == "__main__":
    main()
