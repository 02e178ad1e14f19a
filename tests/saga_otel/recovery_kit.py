"""Real processes for the recovery-lease tests: an agent that opens runs and hangs,
a racer zygote that forks `saga-otel recover` processes, and tools with a ground truth.

Ground truth (the file in $SAGA_TRUTH, appended with O_APPEND):
  ``call RUN IDX PID``   every call of the undo tool, before it does anything
  ``undo RUN IDX PID``   the undo took effect (the backend honours idempotency keys,
                         so a repeated call under the same key has no second effect)

  python -m tests.saga_otel.recovery_kit agent OTLP RUN_ID...
      opens each run, pushes three credits (undos at indices 0, 1, 2), prints
      {"runs": [...]} and hangs, heartbeating, until killed. An id "done:X" runs X
      to completion instead; "fail:X" fails X after the credits, so it unwinds.
  python -m tests.saga_otel.recovery_kit racer
      stdin ``race OUT GO ARGS...``: forks a child that waits for file GO, then
      runs ``saga-otel ARGS...`` with stdout/stderr in OUT.out/OUT.err; prints
      ``pid PID``. ``reap PID`` prints ``exit CODE``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from saga_otel import RetryPolicy, Saga, ToolRegistry, tool


def note(line: str) -> None:
    fd = os.open(os.environ["SAGA_TRUTH"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _applied(run: str, ref: int) -> bool:
    try:
        text = Path(os.environ["SAGA_TRUTH"]).read_text()
    except FileNotFoundError:
        return False
    return any(line.split()[:3] == ["undo", run, str(ref)] for line in text.splitlines())


def credit(run: str, idx: int) -> dict[str, Any]:
    return {"ref": idx}


def undo_credit(run: str, ref: int, idempotency_key: str) -> None:
    note(f"call {run} {ref} {os.getpid()}")
    if os.environ.get("SAGA_UNDO_FAIL"):
        raise RuntimeError("ledger is down")
    if os.environ.get("SAGA_HANG_AT") == str(ref):
        time.sleep(3600)  # the test SIGKILLs this process here, mid-unwind
    time.sleep(float(os.environ.get("SAGA_UNDO_SLEEP", "0")))
    if not _applied(run, ref):
        note(f"undo {run} {ref} {os.getpid()}")


def registry() -> ToolRegistry:
    return ToolRegistry(
        [
            tool(
                "compensable",
                name="credit",
                compensate="undo_credit",
                compensate_args=lambda i: {"run": i.args["run"], "ref": i.result["ref"]},
            )(credit),
            tool("convergent", name="undo_credit")(undo_credit),
        ]
    )


# An in-process recoverer stalled mid-undo (a GC pause, a frozen VM): the first call
# of paused_undo sets PAUSED and waits for GO; later calls (another recoverer's) run.
PAUSED = threading.Event()
GO = threading.Event()


def paused_undo(credit_id: str, idempotency_key: str) -> None:
    if not PAUSED.is_set():
        PAUSED.set()
        GO.wait(120)


def paused_registry() -> ToolRegistry:
    return ToolRegistry([tool("convergent", name="reverse_credit")(paused_undo)])


def agent(otlp: str, run_ids: list[str]) -> None:
    import saga_otel

    saga_otel.configure(otlp, heartbeat_interval=0.2)
    saga = Saga("refund", tools=registry(), retry=RetryPolicy(attempts=1))
    opened = []
    for rid in run_ids:
        if rid.startswith("done:"):
            with saga.run_sync(run_id=rid[5:]) as run:
                run.call("credit", run=run.run_id, idx=0)
            opened.append(rid[5:])
            continue
        if rid.startswith("fail:"):
            with contextlib.suppress(RuntimeError), saga.run_sync(run_id=rid[5:]) as run:
                for idx in range(3):
                    run.call("credit", run=run.run_id, idx=idx)
                raise RuntimeError("the last step failed")
            opened.append(rid[5:])
            continue
        run = saga.run_sync(run_id=rid)
        run.__enter__()
        for idx in range(3):
            run.call("credit", run=run.run_id, idx=idx)
        opened.append(run.run_id)
    print(json.dumps({"runs": opened}), flush=True)
    time.sleep(3600)


def racer() -> None:
    from saga_otel._cli import main as cli

    for line in sys.stdin:
        cmd, *args = line.rstrip("\n").split("\t")
        if cmd == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
            continue
        out, go, *argv = args
        pid = os.fork()
        if pid == 0:
            code = 99
            try:
                for fd, suffix in ((1, ".out"), (2, ".err")):
                    f = os.open(out + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.dup2(f, fd)
                    os.close(f)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                while not os.path.exists(go):  # the barrier: both racers start together
                    time.sleep(0.001)
                code = cli(argv)
            except SystemExit as exc:  # argparse's own errors
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:
                print(f"racer child error: {exc!r}", file=sys.stderr, flush=True)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(f"pid {pid}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "agent":
        agent(sys.argv[2], sys.argv[3:])
    else:
        racer()


# --- driving these from a test ---------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOOLS = "tests.saga_otel.recovery_kit:registry"


def kit_env(truth: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SAGA_TRUTH": str(truth),
        "SAGA_OTEL_LOG_LEVEL": "ERROR",
        **extra,
    }


def start_agent(otlp: str, run_ids: list[str], truth: Path, **env: str) -> tuple[Any, list[str]]:
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.saga_otel.recovery_kit", "agent", otlp, *run_ids],
        cwd=ROOT, env=kit_env(truth, **env), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the agent exited before opening its runs"
    runs: list[str] = json.loads(line)["runs"]
    return proc, runs


def truth_lines(truth: Path, run_id: str) -> list[tuple[str, int, int]]:
    """(kind, ref, pid) of every ground-truth line of ``run_id``."""
    if not truth.exists():
        return []
    out = []
    for line in truth.read_text().splitlines():
        kind, rest = line.split(" ", 1)
        run, ref, pid = rest.rsplit(" ", 2)
        if run == run_id:
            out.append((kind, int(ref), int(pid)))
    return out


class Racer:
    """The racer zygote: forks recover processes that start at one barrier."""

    def __init__(self, truth: Path, **env: str) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.saga_otel.recovery_kit", "racer"],
            cwd=ROOT, env=kit_env(truth, **env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def ask(self, *fields: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\t".join(fields) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def spawn(self, out: Path, go: Path, *argv: str) -> int:
        answer = self.ask("race", str(out), str(go), *argv)
        assert answer.startswith("pid "), answer
        return int(answer.split()[1])

    def reap(self, pid: int) -> int:
        return int(self.ask("reap", str(pid)).split()[1])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


def race(api: str, otlp: str, tmp: Path, trials: int) -> dict[str, int]:
    """``trials`` runs of a killed agent, each recovered by two processes started at once.

    Exactly one must run the run's undos (each once, ground truth), the other must
    exit 3 naming the holder. Returns the figures for docs/reliability.md.
    """
    import signal

    import httpx

    truth = tmp / "race-truth.log"
    ids = [f"race-{i}" for i in range(trials)]
    agent, runs = start_agent(otlp, ids, truth)
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    deadline = time.monotonic() + 60
    while True:
        statuses = [httpx.get(f"{api}/runs/{r}", timeout=5).json()["status"] for r in runs]
        if all(s == "orphaned" for s in statuses):
            break
        assert time.monotonic() < deadline, statuses
        time.sleep(0.1)
    racer = Racer(truth, SAGA_UNDO_SLEEP="0.05")
    stats = {"trials": trials, "double_undos": 0, "both_ran": 0, "loser_named_holder": 0}
    try:
        for i, run_id in enumerate(runs):
            go = tmp / f"go-{i}"
            argv = ["recover", run_id, "--tools", TOOLS, "--sidecar", api, "--otlp", otlp]
            outs = [tmp / f"race-{i}-{k}" for k in (0, 1)]
            pids = [racer.spawn(out, go, *argv) for out in outs]
            go.touch()
            codes = [racer.reap(pid) for pid in pids]
            errs = [Path(f"{out}.err").read_text() for out in outs]
            assert sorted(codes) == [0, 3], (i, codes, errs)
            winner = pids[codes.index(0)]
            loser_err = errs[codes.index(3)]
            assert "being recovered by" in loser_err, loser_err
            assert f":{winner}:" in loser_err, (winner, loser_err)
            stats["loser_named_holder"] += 1
            lines = truth_lines(truth, run_id)
            calls = sorted(ref for kind, ref, _ in lines if kind == "call")
            undos = sorted(ref for kind, ref, _ in lines if kind == "undo")
            assert {pid for _, _, pid in lines} == {winner}, (i, lines)
            assert calls == undos == [0, 1, 2], (i, lines)
    finally:
        racer.close()
    return stats
