"""Instrument the saga runner you already have with observed().

``run_saga`` below stands for your existing runner: it is untouched. The ten
lines in ``instrumented`` are all it takes for its steps to emit the same
spans, log events and metrics as a Saga run.
"""

from __future__ import annotations

import asyncio
from typing import Any

from examples.world import World


class CreditStep:
    name = "issue_credit"

    def __init__(self, world: World) -> None:
        self.world, self.credit = world, None

    async def do(self, ctx: dict[str, Any]) -> None:
        self.credit = self.world.issue_credit(ctx["order_id"], ctx["amount"])

    async def compensate(self, ctx: dict[str, Any]) -> None:
        self.world.reverse_credit(self.credit["credit_id"])  # type: ignore[index]


class ReplyStep:
    name = "send_reply"

    def __init__(self, world: World) -> None:
        self.world = world

    async def do(self, ctx: dict[str, Any]) -> None:
        self.world.send_reply("T-9104", "credited")

    async def compensate(self, ctx: dict[str, Any]) -> None:
        return None


async def run_saga(steps: list[Any], ctx: dict[str, Any]) -> str:
    """Your runner: do each step, undo the done ones in reverse on failure."""
    done: list[Any] = []
    for step in steps:
        try:
            await step.do(ctx)
            done.append(step)
        except Exception:
            for d in reversed(done):
                await d.compensate(ctx)
            return "compensated"
    return "completed"


# --- the instrumentation: under ten lines ------------------------------------------
async def instrumented(world: World) -> str:
    from saga_otel import observed, observed_run

    steps = [
        observed(CreditStep(world), saga="refund"),
        observed(ReplyStep(world), saga="refund", step_class="irreversible"),
    ]
    with observed_run("refund") as run:
        status = await run_saga(steps, {"order_id": 4921, "amount": 2500})
        run.status = status
    return status


if __name__ == "__main__":
    from saga_otel import configure

    export = configure()  # SAGA_OTEL_SIDECAR_ENDPOINT, when set, names the sidecar
    w = World(mail_down=True)
    try:
        print(asyncio.run(instrumented(w)), w.ledger)  # the mail outage made it unwind
    finally:
        export.shutdown()
