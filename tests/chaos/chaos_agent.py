"""A zygote for chaos tests: imports everything once, then forks one real agent
process per trial, so hundreds of SIGKILL trials fit in CI's time.

Protocol on stdin/stdout, one line each:
  ``saga SEED``     fork an agent that runs a random saga; prints ``pid PID``
  ``recover RUN``   fork a process that recovers RUN from the sidecar; prints ``pid PID``
  ``reap PID``      wait for PID; prints ``exit CODE``
Ground truth goes to the file given as argv[3], one line per event, appended
with O_APPEND (atomic for short lines):
  ``start RUN`` when the run opened; ``do RUN IDX`` by a tool before it
  returns; ``ret RUN IDX`` by the agent after run.call returned;
  ``undo RUN IDX`` by a compensation before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from typing import Any

import saga_otel
from saga_otel import RetryPolicy, Saga, ToolRegistry, tool

OTLP, API, TRUTH = sys.argv[1], sys.argv[2], sys.argv[3]


def note(line: str) -> None:
    fd = os.open(TRUTH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def registry(rng: random.Random | None = None) -> ToolRegistry:
    def work() -> None:
        if rng is not None:
            time.sleep(rng.uniform(0, 0.004))

    def read(run: str, idx: int) -> dict[str, Any]:
        work()
        note(f"do {run} {idx}")
        return {"ref": idx}

    def write(run: str, idx: int) -> dict[str, Any]:
        work()
        note(f"do {run} {idx}")
        return {"ref": idx}

    def undo(run: str, ref: int, idempotency_key: str) -> None:
        # The backend honours idempotency keys: a repeated undo is a no-op.
        with open(TRUTH) as f:
            if f"undo {run} {ref}\n" in f.read():
                return
        work()
        note(f"undo {run} {ref}")

    def fail(run: str, idx: int) -> None:
        work()
        raise RuntimeError("the last step failed: unwind")

    recipe = {
        "compensate": "undo",
        "compensate_args": lambda i: {"run": i.args["run"], "ref": i.result["ref"]},
    }
    return ToolRegistry(
        [
            tool("read", name="read")(read),
            tool("convergent", name="set")(write),
            tool("compensable", name="credit", **recipe)(write),  # type: ignore[arg-type]
            tool("compensable", name="ticket", **recipe)(write),  # type: ignore[arg-type]
            tool("convergent", name="undo")(undo),
            tool("convergent", name="fail")(fail),
        ]
    )


def agent(seed: int) -> None:
    rng = random.Random(seed)
    export = saga_otel.configure(OTLP, heartbeat_interval=0.5)
    saga = Saga("chaos", tools=registry(rng), logger=_quiet())
    plan = [rng.choice(["read", "set", "credit", "ticket"]) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.4:
        plan.append("fail")  # so some kills land in the middle of the agent's own unwind

    async def go() -> None:
        async with saga.run() as run:
            note(f"start {run.run_id}")
            for idx, name in enumerate(plan):
                await run.call(name, run=run.run_id, idx=idx)
                note(f"ret {run.run_id} {idx} {name}")
                await asyncio.sleep(rng.uniform(0, 0.003))

    with contextlib.suppress(RuntimeError):  # the planned failure; the unwind ran
        asyncio.run(go())
    export.shutdown()


def recover(run_id: str) -> None:
    export = saga_otel.configure(OTLP)
    try:
        # The test SIGKILLed the agent a moment ago, before the sidecar can tell it died
        # (three heartbeat intervals): it says so, as a person would, with a reason.
        report = saga_otel.recover(
            run_id,
            tools=registry(),
            sidecar=API,
            retry=RetryPolicy(attempts=3),
            logger=_quiet(),
            force=True,
            reason="chaos test: the agent was SIGKILLed",
        )
    except saga_otel.NothingToRecoverError as exc:
        note(f"recovered {run_id} nothing-to-do {exc.status}")
        return
    finally:
        export.shutdown()
    note(f"recovered {run_id} {report.status.value}")


def _quiet() -> Any:
    import structlog

    return structlog.wrap_logger(
        structlog.PrintLogger(open(os.devnull, "w")),
        wrapper_class=structlog.make_filtering_bound_logger(50),
    ).bind()


def main() -> None:
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "reap":
            _, status = os.waitpid(int(arg), 0)
            print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                agent(int(arg)) if cmd == "saga" else recover(arg)
            except BaseException as exc:  # the child reports, never returns into the loop
                print(f"child error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        print(f"pid {pid}", flush=True)


if __name__ == "__main__":
    main()
