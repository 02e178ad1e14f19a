"""One harness, three saga libraries: the same 3-step run timed in a fresh process.

Run by ``bench/bench_engine.py``, never imported by it: saga-otel's side runs
with the project's Python, the peers' (agent-saga 2.3.11, sagaz 1.5.0) with the
bench-only environment ``bench/.peers-venv``, which holds them and nothing of
ours. Standard library only at module level, so it runs in either.

The run: three async compensable steps, each returning an id its undo needs;
``ok`` completes all three, ``fail`` raises in step 3, so steps 2 and 1 are
undone (newest first) and the run ends with the error. Each library runs it the
way its README shows. Prints one JSON object: per-run milliseconds, the median
of ``--batches`` batches of ``--runs`` runs, after ``--warmup`` runs.

    python bench/peer_harness.py saga_otel --runs 300
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

Run = Callable[[bool], Awaitable[None]]


class StepFailed(Exception):
    """Step 3's planned failure."""


UNDONE: list[str] = []  # undo calls, checked once: every library must really compensate


class _Discard(io.StringIO):
    def write(self, s: str) -> int:
        return len(s)


def saga_otel_saga(tracer_provider: Any = None) -> Any:
    """saga-otel's 3-step saga: SDK spans (a fresh provider unless given), the default
    JSON log lines into a discarding stream, a private metrics registry."""
    from opentelemetry.sdk.trace import TracerProvider
    from prometheus_client import CollectorRegistry

    from saga_otel import Saga, ToolRegistry, tool
    from saga_otel._logging import default_logger

    def make(n: int) -> list[Any]:
        @tool(
            "compensable",
            name=f"step{n}",
            compensate=f"undo{n}",
            compensate_args=lambda i: {"id": i.result["id"]},
        )
        async def do(fail: bool = False) -> dict[str, Any]:
            if fail:
                raise StepFailed(f"step {n} failed")
            return {"id": f"id-{n}"}

        @tool("convergent", name=f"undo{n}")
        async def undo(id: str) -> None:
            UNDONE.append(id)

        return [do, undo]

    return Saga(
        "bench3",
        tools=ToolRegistry([t for n in (1, 2, 3) for t in make(n)]),
        tracer_provider=tracer_provider or TracerProvider(),
        registry=CollectorRegistry(),
        logger=default_logger(_Discard()),
    )


def saga_otel_run() -> Run:
    """saga-otel with full telemetry: SDK spans, JSON log lines (default logger), metrics."""
    saga = saga_otel_saga()

    async def run(fail: bool) -> None:
        try:
            async with saga.run() as r:
                await r.call("step1")
                await r.call("step2")
                await r.call("step3", fail=fail)
        except StepFailed:
            pass

    return run


def agent_saga_run() -> Run:
    """agent-saga 2.3.11, without telemetry: @tool with COMPENSABLE semantics, saga_scope."""
    import logging

    from agent_saga import SagaAborted, saga_scope, tool  # type: ignore[import-not-found]
    from agent_saga.semantics import (  # type: ignore[import-not-found]
        ActionSemantics,
        Compensation,
    )

    logging.disable(logging.CRITICAL)  # its rollback warnings: no telemetry on this side

    async def undo(id: str) -> None:
        UNDONE.append(id)

    def make(n: int) -> Any:
        @tool(
            f"step{n}",
            semantics=ActionSemantics.COMPENSABLE,
            compensate=lambda result: Compensation(fn=undo, kwargs={"id": result["id"]}),
        )
        async def do(fail: bool = False) -> dict[str, Any]:
            if fail:
                raise StepFailed(f"step {n} failed")
            return {"id": f"id-{n}"}

        return do

    s1, s2, s3 = make(1), make(2), make(3)

    async def run(fail: bool) -> None:
        try:
            async with saga_scope(name="bench3"):
                await s1()
                await s2()
                await s3(fail=fail)
        except SagaAborted:
            pass

    return run


def sagaz_run() -> Run:
    """sagaz 1.5.0, without telemetry: imperative Saga.add_step, each step after the last."""
    import logging

    from sagaz import Saga  # type: ignore[import-not-found]

    logging.disable(logging.CRITICAL)

    def make(n: int) -> tuple[Any, Any]:
        async def do(ctx: dict[str, Any]) -> dict[str, Any]:
            if n == 3 and ctx.get("fail"):
                raise StepFailed(f"step {n} failed")
            return {f"id{n}": f"id-{n}"}

        async def undo(ctx: dict[str, Any]) -> None:
            UNDONE.append(ctx[f"id{n}"])

        return do, undo

    def build() -> Any:
        saga = Saga(name="bench3")
        for n in (1, 2, 3):
            do, undo = make(n)
            deps = [f"step{n - 1}"] if n > 1 else None
            saga.add_step(f"step{n}", do, undo, depends_on=deps, max_retries=0)
        return saga

    async def run(fail: bool) -> None:
        # sagaz raises its own error type once it compensated
        with contextlib.suppress(Exception):
            await build().run({"fail": fail})

    return run


LIBRARIES: dict[str, Callable[[], Run]] = {
    "saga_otel": saga_otel_run,
    "agent_saga": agent_saga_run,
    "sagaz": sagaz_run,
}


async def _time(run: Run, fail: bool, runs: int) -> float:
    t0 = time.perf_counter()
    for _ in range(runs):
        await run(fail)
    return (time.perf_counter() - t0) / runs * 1000.0


async def main(lib: str, runs: int, batches: int, warmup: int) -> dict[str, Any]:
    run = LIBRARIES[lib]()
    await run(False)
    await run(True)
    if UNDONE != ["id-2", "id-1"]:
        raise SystemExit(f"{lib}: a failing run undid {UNDONE}, expected ['id-2', 'id-1']")
    for fail in (False, True):
        for _ in range(warmup):
            await run(fail)
    ok, bad = [], []
    for _ in range(batches):  # ok and failing alternate, batch by batch
        ok.append(await _time(run, False, runs))
        bad.append(await _time(run, True, runs))
    return {"lib": lib, "ok_ms": statistics.median(ok), "fail_ms": statistics.median(bad)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("lib", choices=sorted(LIBRARIES))
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=50)
    a = ap.parse_args()
    print(json.dumps(asyncio.run(main(a.lib, a.runs, a.batches, a.warmup))))
    sys.stdout.flush()
