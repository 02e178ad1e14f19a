"""A refund agent that keeps running the refund scenarios and serves its metrics.

Each round runs four refunds: one that completes (after a retried read), one that
unwinds and is compensated (mail down), one whose compensation fails (mail down and
the ledger refuses the reversal) and one that gets stuck past its pivot (closing the
ticket fails after the reply went out). So every saga metric, and every panel of
dashboards/saga-overview.json, has data. After the last round the process keeps
serving /metrics until it is stopped.

    python -m examples.metrics_agent --metrics-port 9464 \\
        --sidecar http://127.0.0.1:4318 --scenarios 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import threading
from collections.abc import Callable

from examples.refund_agent import run_refund
from examples.refund_tools import refund_tools
from examples.world import World
from saga_otel import RetryPolicy, Saga, SagaReport, ToolRegistry, configure, start_metrics_server
from saga_otel.testing import FailureInjector

FAST = RetryPolicy(attempts=2, initial=0.01, maximum=0.05, jitter=0.0)


def _completed_after_retry(world: World) -> ToolRegistry:
    return FailureInjector().fail("get_order", times=1).wrap(refund_tools(world))


def _compensated(world: World) -> ToolRegistry:
    world.mail_down = True
    return refund_tools(world)


def _compensation_failed(world: World) -> ToolRegistry:
    world.mail_down = True
    return FailureInjector().fail("reverse_credit", phase="compensate").wrap(refund_tools(world))


def _stuck(world: World) -> ToolRegistry:
    return refund_tools(world, close_fails=True)


SCENARIOS: dict[str, Callable[[World], ToolRegistry]] = {
    "completed": _completed_after_retry,
    "compensated": _compensated,
    "compensation_failed": _compensation_failed,
    "stuck": _stuck,
}


async def run_round() -> dict[str, SagaReport]:
    """One run of each scenario, each against a fresh world."""
    reports = {}
    for name, make_tools in SCENARIOS.items():
        saga = Saga("refund", tools=make_tools(World()), retry=FAST, forward_retry=FAST)
        reports[name] = await run_refund(saga)
    return reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics-port", type=int, default=0, help="0 picks a free port")
    parser.add_argument(
        "--sidecar", help="the sidecar's OTLP/HTTP base URL (default: $SAGA_OTEL_SIDECAR_ENDPOINT)"
    )
    parser.add_argument("--scenarios", type=int, default=1, help="rounds to run; 0 = forever")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between rounds")
    ns = parser.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    os.environ.setdefault("OTEL_SERVICE_NAME", "refund-agent")
    export = configure(ns.sidecar)  # None: SAGA_OTEL_SIDECAR_ENDPOINT, if set
    port = start_metrics_server(ns.metrics_port)
    print(f"metrics on http://127.0.0.1:{port}/metrics", flush=True)
    rounds = itertools.count(1) if ns.scenarios == 0 else range(1, ns.scenarios + 1)
    try:
        for n in rounds:
            if stop.is_set():
                break
            reports = asyncio.run(run_round())
            summary = ", ".join(f"{k}={r.status.value}" for k, r in reports.items())
            print(f"round {n}: {summary}", flush=True)
            stop.wait(ns.interval)
        stop.wait()
    finally:
        export.shutdown()


if __name__ == "__main__":
    main()
