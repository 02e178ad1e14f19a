"""recover() and `saga-otel recover`: a dead agent's unwind finished elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import SidecarProcess, wait_until

from examples.world import World
from examples.world_server import serve_world
from saga_otel import RecoveryError, ToolRegistry, find_run_id, recover, tool
from sidecar import Sidecar
from tests.sidecar.sidecar_testkit import FakeClock, RunScript, export_http, settings_for

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture
def world() -> Iterator[tuple[World, str]]:
    w = World()
    server, url = serve_world(w)
    yield w, url
    server.shutdown()


def kill_after_credit(sc: SidecarProcess, world_url: str) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.demo_agent", "--world", world_url, "--otlp", sc.otlp,
         "--pause-after", "issue_credit"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "SAGA_OTEL_LOG_LEVEL": "ERROR"},
    )  # fmt: skip
    assert proc.stdout is not None
    paused = json.loads(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run_id: str = paused["run_id"]
    # Recovery is refused while the agent may be alive: wait for its heartbeats to stop.
    wait_until(lambda: status(sc, run_id) == "orphaned", what="orphaned")
    return run_id


def status(sc: SidecarProcess, run_id: str) -> Any:
    return httpx.get(f"{sc.api}/runs/{run_id}", timeout=5).json().get("status")


def cli_recover(sc: SidecarProcess, run_id: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "saga-otel"), "recover", run_id, "--tools", "examples.demo_tools:registry",
         "--sidecar", sc.api, "--otlp", sc.otlp, "--attempts", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "SAGA_DEMO_WORLD": url, "SAGA_OTEL_LOG_LEVEL": "ERROR"},
    )  # fmt: skip


def test_recover_from_another_process_marks_the_run_recovered_and_never_repeats(
    sidecar_process: Any, world: tuple[World, str]
) -> None:
    w, url = world
    sc = sidecar_process()
    run_id = kill_after_credit(sc, url)
    assert w.balance(4921) == 2500
    stack = httpx.get(f"{sc.api}/runs/{run_id}/stack", timeout=5).json()["stack"]
    assert [c["tool"] for c in stack] == ["reverse_credit"]

    first = cli_recover(sc, run_id, url)
    assert first.returncode == 0, first.stderr
    assert f"run {run_id}: recovered (1 compensation run)" in first.stdout
    assert "✓ reverse_credit" in first.stdout
    wait_until(lambda: status(sc, run_id) == "recovered", what="recovered")
    assert w.balance(4921) == 0
    view = httpx.get(f"{sc.api}/runs/{run_id}", timeout=5).json()
    assert view["trace_id"] == run_id  # the recovery joined the run's own trace

    second = cli_recover(sc, run_id, url)
    assert second.returncode == 4, second.stderr  # nothing to do
    assert f"run {run_id!r} is recovered" in second.stdout
    assert [e["amount"] for e in w.ledger] == [2500, -2500]  # nothing undone twice


def test_recovery_that_cannot_undo_ends_compensation_failed_and_escalates(
    sidecar_process: Any, world: tuple[World, str]
) -> None:
    w, url = world
    sc = sidecar_process()
    run_id = kill_after_credit(sc, url)
    w.ledger_down = True
    out = cli_recover(sc, run_id, url)
    assert out.returncode == 1
    assert "✗ reverse_credit" in out.stdout and "Could NOT be undone" in out.stdout
    wait_until(lambda: status(sc, run_id) == "compensation_failed", what="compensation_failed")
    view = httpx.get(f"{sc.api}/runs/{run_id}", timeout=5).json()
    assert view["escalation"]["reason"] == "compensation_failed"
    # The ledger comes back: a later recovery finishes the job.
    w.ledger_down = False
    assert cli_recover(sc, run_id, url).returncode == 0
    wait_until(lambda: status(sc, run_id) == "recovered", what="recovered after retry")
    assert w.balance(4921) == 0


def test_recover_errors_name_the_problem_and_the_fix(sidecar_process: Any) -> None:
    sc = sidecar_process()
    with pytest.raises(RecoveryError, match=r"knows no run 'nope'.*saga-sidecar runs list"):
        recover("nope", tools=ToolRegistry(), sidecar=sc.api)
    with pytest.raises(RecoveryError, match="cannot reach the sidecar"):
        recover("x", tools=ToolRegistry(), sidecar="http://127.0.0.1:9")
    view = {"status": "orphaned", "saga": "refund", "stack": [{"tool": "reverse_credit",
            "args": {"credit_id": "c"}, "index": 1, "step": "issue_credit"}]}  # fmt: skip
    with pytest.raises(RecoveryError, match=r"lacks; pass the agent's own ToolRegistry"):
        recover("r", tools=ToolRegistry(), view=view)
    pivoted = {**view, "pivot": {"step": "send_reply", "index": 3}}
    with pytest.raises(RecoveryError, match="crossed its pivot"):
        recover("r", tools=ToolRegistry(), view=pivoted)
    cli = subprocess.run(
        [str(BIN / "saga-otel"), "recover", "nope", "--tools", "examples.demo_tools:registry",
         "--sidecar", sc.api, "--otlp", sc.otlp],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "SAGA_DEMO_WORLD": "http://127.0.0.1:9"},
    )  # fmt: skip
    assert cli.returncode == 2 and "no run 'nope'" in cli.stderr


def test_recover_refuses_async_undos_before_taking_the_lease() -> None:
    """Recovery unwinds in sync code, where an async undo would fail after the lease was
    taken (the run then escalated): refused first, naming each tool and the fix. The
    sidecar is unreachable here, so getting as far as the lease would say so instead."""

    async def reverse_credit(credit_id: str) -> None: ...

    tools = ToolRegistry([tool("convergent")(reverse_credit), tool("convergent")(print)])
    view = {"status": "orphaned", "saga": "refund", "stack": [{"tool": "reverse_credit",
            "args": {"credit_id": "c"}, "index": 1, "step": "issue_credit"}]}  # fmt: skip
    with pytest.raises(RecoveryError) as info:
        recover("r", tools=tools, view=view, sidecar="http://127.0.0.1:9")
    text = str(info.value)
    assert "needs the tools 'reverse_credit', which are async" in text
    assert "SagaTools(...).blocking_registry()" in text and "tools=" in text
    sync_view = {**view, "stack": [{**view["stack"][0], "tool": "print"}]}
    with pytest.raises(RecoveryError, match="cannot reach the sidecar"):  # past the check
        recover("r", tools=tools, view=sync_view, sidecar="http://127.0.0.1:9")


class _Dripping(BaseHTTPRequestHandler):
    """Something on the sidecar's port that answers a byte a second: each whole answer
    takes over a minute, and no read ever waits long enough for a socket timeout."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def _drip(self) -> None:
        with contextlib.suppress(OSError):  # the client hung up: its deadline passed
            for i in range(len(self.ANSWER)):
                self.wfile.write(self.ANSWER[i : i + 1])
                self.wfile.flush()
                time.sleep(1.0)

    def do_GET(self) -> None:
        self._drip()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._drip()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_sidecar_that_drips_its_answers_fails_each_call_at_the_request_deadline() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Dripping)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    empty = {"status": "orphaned", "stack": []}
    calls: dict[str, Callable[[], object]] = {
        "run id lookup": lambda: find_run_id("r1", url),
        "run view": lambda: recover("r1", tools=ToolRegistry(), sidecar=url),
        "lease": lambda: recover("r1", tools=ToolRegistry(), sidecar=url, view=empty),
    }
    raised: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            calls[name]()
        except BaseException as exc:
            raised[name] = exc

    threads = [threading.Thread(target=run, args=(name,), daemon=True) for name in calls]
    try:
        for t in threads:
            t.start()
        waited_until = time.monotonic() + 60  # an answer takes over a minute to drip in
        for t in threads:
            t.join(max(0.0, waited_until - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a call waited for the whole answer"
    finally:
        server.shutdown()
        server.server_close()
    for name in calls:
        assert isinstance(raised.get(name), RecoveryError), (name, raised.get(name))
        assert "did not answer" in str(raised[name]) and "within 10 s" in str(raised[name])


async def test_a_whole_run_id_names_its_run_however_many_ids_it_begins(tmp_path: Path) -> None:
    """More runs start with "job-1" than one page of the prefix search holds (1,000),
    and "job-1" itself is the oldest: not on that page."""
    async with Sidecar(settings_for(tmp_path), clock=FakeClock()) as sidecar:
        api = f"http://127.0.0.1:{sidecar.api_port}"
        runs = [RunScript(run_id="job-1", t0=1_700_000_000.0)]
        runs += [RunScript(run_id=f"job-1{i:04d}", t0=1_700_000_001.0 + i) for i in range(1000)]
        spans = [span for run in runs for span in run.do(0, "lookup", "read").spans()]
        for start in range(0, len(spans), 250):
            await export_http(sidecar, spans[start : start + 250])
        assert await asyncio.to_thread(find_run_id, "job-1", api) == "job-1"
        assert await asyncio.to_thread(find_run_id, "job-10999", api) == "job-10999"
        with pytest.raises(RecoveryError, match=r"prefix 'job-' matches more than 1000 runs \("):
            await asyncio.to_thread(find_run_id, "job-", api)
        with pytest.raises(RecoveryError, match=r"prefix 'job-10' matches 1000 runs \("):
            await asyncio.to_thread(find_run_id, "job-10", api)
