"""An agent for the three-replica test (test_replicas_kill.py), one process per role.

  load RUNS ENDPOINTS SEED   run RUNS sagas (some fail and unwind); a JSON line per run
                             once it ended, then ``failures N`` (unacknowledged waits)
  slow ENDPOINTS SECONDS     one run open for SECONDS (its heartbeats keep it alive)
  victim ENDPOINTS           one run with two undos pushed, then sleeps (the test kills it)
  recover RUN API OTLP       recover RUN through that replica; prints its report's status

ENDPOINTS: sidecar OTLP/HTTP URLs separated by commas (saga_otel takes them in turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from typing import Any

from prometheus_client import CollectorRegistry

import saga_otel
from saga_otel import Saga, ToolRegistry, tool
from saga_otel import semconv as sc


def registry() -> ToolRegistry:
    def credit(ref: int) -> dict[str, Any]:
        return {"ref": ref}

    def undo(ref: int) -> None:
        return None

    def fail(ref: int) -> None:
        raise RuntimeError(f"step {ref} failed: unwind")

    recipe: Any = {"compensate": "undo", "compensate_args": lambda i: {"ref": i.result["ref"]}}
    return ToolRegistry(
        [
            tool("compensable", name="credit", **recipe)(credit),
            tool("read", name="read")(credit),
            tool("convergent", name="undo")(undo),
            tool("convergent", name="fail")(fail),
        ]
    )


class _Quiet:
    def __getattr__(self, _name: str) -> Any:
        return lambda *a, **k: None


def say(doc: dict[str, Any] | str) -> None:
    print(doc if isinstance(doc, str) else json.dumps(doc), flush=True)


def load(runs: int, endpoints: str, seed: int) -> None:
    rng = random.Random(seed)
    metrics = CollectorRegistry()
    export = saga_otel.configure(
        endpoints, heartbeat_interval=0.3, registry=metrics, retry_max=1.0, logger=_Quiet()
    )
    saga = Saga("replicas", tools=registry(), logger=_Quiet())

    async def one() -> None:
        failing = rng.random() < 0.4
        async with saga.run() as run:
            status = sc.STATUS_COMPENSATED if failing else sc.STATUS_COMPLETED
            try:
                for i in range(rng.randint(2, 4)):
                    await run.call(rng.choice(["credit", "read"]), ref=i)
                    await asyncio.sleep(rng.uniform(0, 0.02))
                await run.call("credit", ref=9)  # at least one undo pushed
                if failing:
                    await run.call("fail", ref=10)
            finally:
                say({"run_id": run.run_id, "status": status})

    for _ in range(runs):
        with contextlib.suppress(RuntimeError):  # the planned failure; the unwind ran
            asyncio.run(one())
    export.shutdown()
    lost = sum(
        metrics.get_sample_value(sc.M_EXPORT_FAILURES, {"reason": r}) or 0.0
        for r in ("sidecar_down", "error", "rejected", "queue_full", "too_large")
    )
    say(f"failures {lost:g}")


def slow(endpoints: str, seconds: float) -> None:
    export = saga_otel.configure(endpoints, heartbeat_interval=0.3, logger=_Quiet())
    saga = Saga("replicas", tools=registry(), logger=_Quiet())

    async def go() -> None:
        async with saga.run() as run:
            await run.call("credit", ref=1)
            await asyncio.sleep(seconds)
            await run.call("credit", ref=2)
            say({"run_id": run.run_id, "status": sc.STATUS_COMPLETED})

    asyncio.run(go())
    export.shutdown()


def victim(endpoints: str) -> None:
    saga_otel.configure(endpoints, heartbeat_interval=0.3, logger=_Quiet())
    saga = Saga("replicas", tools=registry(), logger=_Quiet())

    async def go() -> None:
        async with saga.run() as run:
            await run.call("credit", ref=1)
            await run.call("credit", ref=2)
            say({"run_id": run.run_id, "open": True})
            await asyncio.Event().wait()  # until SIGKILL

    asyncio.run(go())


def recover(run_id: str, api: str, otlp: str) -> None:
    export = saga_otel.configure(otlp, logger=_Quiet())
    try:
        report = saga_otel.recover(run_id, tools=registry(), sidecar=api, logger=_Quiet())
    finally:
        export.shutdown()
    say({"run_id": run_id, "recovered": report.status.value})


def main() -> None:
    role, args = sys.argv[1], sys.argv[2:]
    if role == "load":
        load(int(args[0]), args[1], int(args[2]))
    elif role == "slow":
        slow(args[0], float(args[1]))
    elif role == "victim":
        victim(args[0])
    elif role == "recover":
        recover(args[0], args[1], args[2])
    else:
        raise SystemExit(f"unknown role {role!r}: load, slow, victim or recover")


if __name__ == "__main__":
    main()
