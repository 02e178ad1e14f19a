"""SIGKILL real agent processes at random moments; the sidecar's stack and a
recovery from another process must lose, repeat and reorder nothing.

Ground truth (see chaos_agent.py): tools note ``do`` before returning, the
agent notes ``ret`` after each run.call returned, compensations note
``undo``. Trials: SAGA_CHAOS_AGENT_TRIALS (default 200).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import AlertReceiver, wait_until

from saga_otel import semconv

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
TRIALS = int(os.environ.get("SAGA_CHAOS_AGENT_TRIALS", "200"))
PUSHING = {"credit", "ticket"}


class Zygote:
    def __init__(self, otlp: str, api: str, truth: Path, tmp: Path) -> None:
        self.err = (tmp / "zygote.err").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "chaos_agent.py"), otlp, api, str(truth)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            cwd=ROOT,
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def spawn(self, line: str) -> int:
        answer = self.ask(line)
        assert answer.startswith("pid "), answer
        return int(answer.split()[1])

    def reap(self, pid: int) -> int:
        return int(self.ask(f"reap {pid}").split()[1])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)
        self.err.close()


def _tail(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""


def read_truth(path: Path, offset: int) -> tuple[list[list[str]], int]:
    if not path.exists():
        return [], offset
    data = path.read_bytes()
    lines = data[offset:].decode().splitlines()
    return [line.split() for line in lines if line], len(data)


def test_killed_agents_are_recovered_with_nothing_lost_or_repeated(
    tmp_path: Path, sidecar_process: Any, chaos_results: dict[str, Any], db_backend: str | None
) -> None:
    sc = sidecar_process("--idle-timeout", "600s", db=db_backend)
    truth = tmp_path / "truth.log"
    zygote = Zygote(sc.otlp, sc.api, truth, tmp_path)
    rng = random.Random(20261202)
    stats: Counter[str] = Counter()
    offset = 0
    try:
        for trial in range(TRIALS):
            pid = zygote.spawn(f"saga {rng.randrange(1 << 30)}")
            # Aim the kill inside the run: wait for it to open, then a random moment.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and b"start " not in _tail(truth, offset):
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.04))
            os.kill(pid, signal.SIGKILL)  # a zombie until reaped: the kill always lands
            zygote.reap(pid)
            events, offset = read_truth(truth, offset)
            starts = [e[1] for e in events if e[0] == "start"]
            if not starts:
                stats["killed before the run opened"] += 1
                continue
            run = starts[0]
            rets = [e for e in events if e[0] == "ret" and e[1] == run]
            returned_push = {int(e[2]) for e in rets if e[3] in PUSHING}
            in_flight = len(rets)  # steps run one at a time: the next index was in flight
            agent_undos = [int(e[2]) for e in events if e[0] == "undo" and e[1] == run]

            resp = httpx.get(f"{sc.api}/runs/{run}", timeout=5)
            if resp.status_code == 404:
                # Nothing durable had happened yet: the sidecar never heard of the run.
                assert returned_push == set(), (trial, "pushed but unknown to the sidecar")
                stats["killed before anything was pushed"] += 1
                continue
            view = resp.json()
            stack = {c["index"] for c in view["stack"]}
            # Every undo whose write had returned to the agent is known to the sidecar,
            # unless the agent itself already undid it; nothing else is, but the step in flight.
            assert returned_push - set(agent_undos) <= stack, (trial, view)
            assert stack <= returned_push | {in_flight}, (trial, view)
            if view["status"] in ("completed", "compensated"):
                stats[f"ended {view['status']} before the kill"] += 1
                assert set(agent_undos) == (
                    returned_push if view["status"] == "compensated" else set()
                )
                continue
            stats["recovered"] += 1
            pid = zygote.spawn(f"recover {run}")
            assert zygote.reap(pid) == 0, (tmp_path / "zygote.err").read_text()[-2000:]
            if trial % 10 == 0:  # recovering twice must change nothing
                pid = zygote.spawn(f"recover {run}")
                assert zygote.reap(pid) == 0
            events2, offset = read_truth(truth, offset)
            undos = agent_undos + [int(e[2]) for e in events2 if e[0] == "undo" and e[1] == run]
            stats["compensations checked"] += len(undos)
            assert len(undos) == len(set(undos)), ("duplicated", trial, undos)
            assert undos == sorted(undos, reverse=True), ("out of order", trial, undos)
            assert returned_push <= set(undos), ("lost", trial, returned_push, undos)
            assert set(undos) <= returned_push | {in_flight}
            url = f"{sc.api}/runs/{run}"

            def recovered(url: str = url) -> bool:
                return bool(httpx.get(url, timeout=5).json()["status"] == "recovered")

            try:
                wait_until(recovered, timeout=10, what=f"run {run} recovered")
            except AssertionError:
                raise AssertionError(httpx.get(url, timeout=5).json()) from None
    finally:
        zygote.close()
    print(f"\nagent-kill trials: {TRIALS}; {dict(stats)}")
    chaos_results["agent_kill" if db_backend is None else "agent_kill_postgresql"] = {
        "trials": TRIALS,
        "lost": 0,
        "duplicated": 0,
        "out_of_order": 0,
        **dict(stats),
    }
    # The trials must actually exercise recovery, not only early or late kills.
    assert stats["recovered"] >= TRIALS // 4, stats


# An agent under a standard OpenTelemetry attribute value length limit, killed right after
# a write whose undo it pushed. saga_otel's own provider applies no limit (the undo is at
# the sidecar); a provider of the user's that cuts the undo's arguments gets the do span
# rejected, and the marker in its place makes the sidecar know the run and page it.
LIMITED_AGENT = r"""
import asyncio, sys
from opentelemetry.sdk.trace import TracerProvider
import saga_otel
from saga_otel import Saga, tool

@tool("compensable", compensate="reverse_credit",
      compensate_args=lambda i: {"credit_id": i.result, "note": "refund for order 4921"})
def issue_credit(order_id: int) -> str:
    return "cr_4921_a1b2c3"

@tool("convergent")
def reverse_credit(credit_id: str, note: str) -> None:
    pass

provider = TracerProvider() if sys.argv[2] == "users" else None  # reads the variable
saga_otel.configure(sys.argv[1], tracer_provider=provider, heartbeat_interval=0.2)
saga = Saga("refund", tools=[issue_credit, reverse_credit], tracer_provider=provider)

async def main() -> None:
    async with saga.run() as run:
        await run.call("issue_credit", order_id=4921)  # the write happened; its undo pushed
        print(run.run_id, flush=True)
        await asyncio.sleep(3600)  # killed here

asyncio.run(main())
"""


@pytest.mark.parametrize("provider", ["saga_otels", "users"])
def test_an_agent_killed_after_a_write_under_a_length_limit_is_paged(
    tmp_path: Path, sidecar_process: Any, provider: str
) -> None:
    script = tmp_path / "agent.py"
    script.write_text(LIMITED_AGENT)
    pager = AlertReceiver()
    side = sidecar_process("--webhook", pager.url)
    env = {**os.environ, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "40"}
    agent = subprocess.Popen(
        [sys.executable, str(script), side.otlp, provider],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "agent.err").open("w"),
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert agent.stdout is not None
        run_id = agent.stdout.readline().strip()
        assert run_id, (tmp_path / "agent.err").read_text()[-2000:]
        agent.kill()  # SIGKILL right after the write: no goodbye, no last span
        agent.wait(10)
        paged = wait_until(
            lambda: pager.find(semconv.ALERT_RUN_ORPHANED, run_id),
            timeout=30,
            what=f"run {run_id} paged orphaned",
        )
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        pager.stop()
    assert paged
    view = httpx.get(f"{side.api}/runs/{run_id}", timeout=5).json()
    assert view["status"] == "orphaned"
    if provider == "saga_otels":
        # The variable is not applied to saga_otel's provider: the whole undo is there.
        assert [(c["tool"], c["args"]) for c in view["stack"]] == [
            ("reverse_credit", {"credit_id": "cr_4921_a1b2c3", "note": "refund for order 4921"})
        ]
    else:
        # The cut undo was rejected; its marker says what is missing, for a person.
        assert view["stack"] == []
        assert [(d["reason"], d["span"]) for d in view["dropped_spans"]] == [
            ("rejected", semconv.do_span_name("issue_credit"))
        ]
