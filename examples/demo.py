"""`make demo`: the whole story in three acts, in under a minute.

1. A refund that succeeds.
2. The mail service is down: the run unwinds, and the alert arrives at a
   webhook the moment compensation starts.
3. The agent is killed with SIGKILL right after issuing the credit: the
   sidecar notices (heartbeats stop), raises SagaRunOrphaned with the stack
   it rebuilt, and `saga-otel recover` finishes the unwind from a new process.

Everything runs on loopback: a sidecar (SQLite in a temporary folder), a fake
world server (ledger, tickets, mail), a webhook receiver standing in for a
pager, and the agent processes. Everything it starts, it stops.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.text import Text

from examples.world import World
from examples.world_server import serve_world
from saga_otel import semconv
from saga_otel.testing import AlertReceiver, start_sidecar

console = Console(highlight=False)
PY = sys.executable
BIN = Path(PY).parent


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"demo: gave up waiting for {what} after {timeout:.0f} s")


@contextmanager
def sidecar(tmp: Path, webhook: str) -> Iterator[dict[str, Any]]:
    with start_sidecar(tmp, "--webhook", webhook, "--idle-timeout", "30s") as sc:
        yield {"otlp": sc.otlp, "api": sc.api}


def agent(world_url: str, otlp: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PY, "-m", "examples.demo_agent", "--world", world_url, "--otlp", otlp, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "SAGA_OTEL_LOG_LEVEL": "ERROR", "OTEL_SERVICE_NAME": "refund-agent"},
    )


def run_agent(world_url: str, otlp: str) -> dict[str, Any]:
    proc = agent(world_url, otlp)
    out, _ = proc.communicate(timeout=60)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def view(api: str, run_id: str) -> dict[str, Any]:
    resp = httpx.get(f"{api}/runs/{semconv.run_id_segment(run_id)}", timeout=5)
    out: dict[str, Any] = resp.json() if resp.status_code == 200 else {}
    return out


def show(api: str, run_id: str) -> None:
    subprocess.run([str(BIN / "saga-sidecar"), "runs", "show", run_id, "--api", api], check=True)


def say(markup: str, indent: int = 2) -> None:
    """A line indented as a block: when it wraps, it wraps under itself, not at column 0."""
    console.print(Padding(Text.from_markup(markup), (0, 0, 0, indent), expand=False))


def show_alert(alert: dict[str, Any], since: float, what: str) -> None:
    ann = alert.get("annotations", {})
    delay = (alert["_received"] - since) * 1000
    say(
        f"[bold]{alert['alertname']}[/] ({alert['severity']}) at the webhook "
        f"{delay:.0f} ms after {what}"
    )
    say(escape(str(ann.get("description") or ann.get("summary"))), 4)


def call_text(tool: str, args: dict[str, Any]) -> str:
    inner = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(args.items()))
    return f"{tool}({inner})"


def show_stack(stack: list[dict[str, Any]]) -> None:
    """The stack as a person reads it: top first, each undo with the step it reverses."""
    undos = f"{len(stack)} undo" + ("" if len(stack) == 1 else "s")
    console.print(f"  the sidecar rebuilt the stack from the spans ({undos}, top first):")
    for n, comp in enumerate(reversed(stack), 1):
        console.print(
            f"    {n}. {call_text(comp['tool'], comp['args'])}  "
            f"undoes #{comp['index']} {comp['step']}"
        )


def show_ledger(world: World, since: int, act: str) -> None:
    """Only this act's ledger entries, so one act's credit is never read as another's."""
    entries = world.ledger[since:]
    console.print(
        f"  ledger, {act} only ({len(entries)} entr{'y' if len(entries) == 1 else 'ies'}):"
    )
    for e in entries:
        what = f"reverses {e['reverses']}" if "reverses" in e else "credit issued"
        console.print(f"    {e['amount']:+6d}  {e['credit_id']}  {what}")
    net = sum(e["amount"] for e in entries)
    console.print(f"    net {net:+d} for order 4921 in {act}")


def main() -> None:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="saga-demo-"))
    world = World()
    world_server, world_url = serve_world(world)
    hook = AlertReceiver()
    try:
        with sidecar(tmp, hook.url) as sc:
            console.rule("[bold]Act 1: a refund that succeeds")
            mark = len(world.ledger)
            first = run_agent(world_url, sc["otlp"])
            wait_for(
                "the run to complete",
                lambda: view(sc["api"], first["run_id"]).get("status") == "completed",
            )
            show(sc["api"], first["run_id"])
            show_ledger(world, mark, "Act 1")

            console.rule("[bold]Act 2: the mail service is down")
            world.tickets["T-9104"] = "open"
            world.mail_down = True
            mark = len(world.ledger)
            t0 = time.time()
            second = run_agent(world_url, sc["otlp"])
            alert = wait_for(
                "SagaCompensationStarted",
                lambda: hook.find("SagaCompensationStarted", second["run_id"]),
            )
            unwind_at = view(sc["api"], second["run_id"]).get("unwind_started_at") or t0
            console.print(f"  run {second['run_id']}")
            show_alert(alert, unwind_at, "the unwind began in the agent")
            wait_for(
                "the alert to resolve",
                lambda: hook.find("SagaCompensationStarted", second["run_id"], "resolved"),
            )
            console.print("  resolved when the run ended compensated")
            show(sc["api"], second["run_id"])
            show_ledger(world, mark, "Act 2")

            console.rule("[bold]Act 3: the agent is killed right after issue_credit")
            world.mail_down = False
            world.tickets["T-9104"] = "open"
            mark = len(world.ledger)
            proc = agent(world_url, sc["otlp"], "--pause-after", "issue_credit")
            assert proc.stdout is not None
            paused = json.loads(proc.stdout.readline())
            run_id = paused["run_id"]
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = time.time()
            proc.wait()
            console.print(f"  SIGKILL sent to agent pid {proc.pid}")
            console.print(f"  run {run_id}")
            orphan = wait_for(
                "SagaRunOrphaned", lambda: hook.find("SagaRunOrphaned", run_id), timeout=30
            )
            show_alert(orphan, killed_at, "the SIGKILL")
            show_stack(view(sc["api"], run_id).get("stack", []))
            # The exact command the demo runs; pasted into another shell while the
            # demo waits, it finishes the unwind itself (the demo's own call then
            # finds nothing left to do).
            env = {"SAGA_DEMO_WORLD": world_url}
            argv = [
                os.path.relpath(BIN / "saga-otel"),
                "recover",
                run_id,
                "--tools",
                "examples.demo_tools:registry",
                "--sidecar",
                sc["api"],
                "--otlp",
                sc["otlp"],
            ]
            console.print(
                "  $ "
                + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
                + " "
                + shlex.join(argv),
                soft_wrap=True,
            )
            recovered_at = time.time()
            subprocess.run(
                argv,
                check=False,
                env={
                    **os.environ,
                    **env,
                    "SAGA_OTEL_LOG_LEVEL": "ERROR",
                    "OTEL_SERVICE_NAME": "refund-recovery",
                },
            )
            wait_for(
                "the run to be recovered",
                lambda: view(sc["api"], run_id).get("status") == "recovered",
            )
            resolved = wait_for(
                "SagaRunOrphaned to resolve",
                lambda: hook.find("SagaRunOrphaned", run_id, "resolved"),
                timeout=30,
            )
            delay = (resolved["_received"] - recovered_at) * 1000
            say(
                f"[bold]SagaRunOrphaned[/] resolved at the webhook {delay:.0f} ms after "
                "recover started: the run is recovered, nobody needs to act"
            )
            show(sc["api"], run_id)
            show_ledger(world, mark, "Act 3")
            console.print(f"  ticket T-9104 is {world.tickets['T-9104']}")
    finally:
        world_server.shutdown()
        hook.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    console.rule(f"[bold green]done in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
