"""A SIGKILLed MCP agent, recovered by `saga-otel recover` through the same MCP server's tools.

Below them, blocking_registry's timeout (the registry recover runs undos in) on a session in
process: a timed-out undo is stopped before its retry starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import mcp.types as mt
import pytest
from mcp import Client
from support import SidecarProcess, wait_until

from saga_otel.adapters.mcp import blocking_registry, decode_result

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "SAGA_OTEL_LOG_LEVEL": "ERROR"}


@pytest.fixture
def mcp_server(port: int) -> Iterator[str]:
    """The refund world's MCP server over HTTP on loopback: agent and recoverer share it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.mcp_refund_server", "--http", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip

    def listening() -> bool:
        assert proc.poll() is None, "the MCP server exited"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, what="the MCP server listening")
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(timeout=30)


def world_state(url: str) -> tuple[int, str]:
    async def read() -> tuple[int, str]:
        async with Client(url) as c:
            balance = decode_result(await c.call_tool("get_balance", {"order_id": 4921}))
            ticket = decode_result(await c.call_tool("get_ticket", {"ticket_id": "T-9104"}))
            return balance["balance"], ticket["status"]

    return asyncio.run(read())


def recover(sc: SidecarProcess, run_id: str, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "saga-otel"), "recover", run_id,
         "--tools", "examples.mcp_refund_agent:recovery_registry",
         "--sidecar", sc.api, "--otlp", sc.otlp, "--attempts", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**ENV, "SAGA_MCP_SERVER": url},
    )  # fmt: skip


def test_a_killed_mcp_agent_is_recovered_through_the_same_server(
    sidecar_process: Any, mcp_server: str
) -> None:
    sc: SidecarProcess = sidecar_process()
    agent = subprocess.Popen(
        [sys.executable, "-m", "examples.mcp_refund_agent", "--server", mcp_server,
         "--pause-after", "set_ticket_status"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**ENV, "SAGA_OTEL_SIDECAR_ENDPOINT": sc.otlp},
    )  # fmt: skip
    assert agent.stdout is not None
    line = ""
    while not line.startswith('{"run_id"'):
        line = agent.stdout.readline()
        assert line, "the agent exited before pausing"
    run_id = json.loads(line)["run_id"]
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait()
    assert world_state(mcp_server) == (2500, "refunded")
    stack = httpx.get(f"{sc.api}/runs/{run_id}/stack", timeout=5).json()["stack"]
    assert [c["tool"] for c in stack] == ["set_ticket_status", "reverse_credit"]

    def orphaned() -> bool:
        view = httpx.get(f"{sc.api}/runs/{run_id}", timeout=5).json()
        return bool(view["status"] == "orphaned")

    # Recovery is refused behind a live agent: wait until the sidecar sees it dead.
    wait_until(orphaned, what="the run orphaned at the sidecar")
    first = recover(sc, run_id, mcp_server)
    assert first.returncode == 0, first.stderr
    assert "✓ set_ticket_status" in first.stdout and "✓ reverse_credit" in first.stdout
    assert world_state(mcp_server) == (0, "open")

    def recovered() -> bool:
        view = httpx.get(f"{sc.api}/runs/{run_id}", timeout=5).json()
        return bool(view["status"] == "recovered")

    wait_until(recovered, what="the run recovered at the sidecar")
    again = recover(sc, run_id, mcp_server)
    assert again.returncode == 4, again.stdout + again.stderr  # nothing to do
    assert world_state(mcp_server) == (0, "open")  # nothing undone twice


def test_recover_with_the_mcp_server_down_says_so_in_one_line(
    sidecar_process: Any, port: int
) -> None:
    sc: SidecarProcess = sidecar_process()
    out = recover(sc, "0" * 32, f"http://127.0.0.1:{port}/mcp")  # nothing listens there
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cannot open the MCP session" in out.stderr.splitlines()[-1]


# -- blocking_registry's timeout, on a session in process ------------------------------


class SlowSession:
    """A server whose undo answers when ``release`` is set; it may also refuse to stop."""

    def __init__(self, *, stubborn: bool = False) -> None:
        self.stubborn = stubborn
        self.release = threading.Event()
        self.started = self.running = self.cancelled = 0

    async def list_tools(self) -> mt.ListToolsResult:
        schema = {"type": "object", "properties": {"credit_id": {"type": "string"}}}
        ann = mt.ToolAnnotations(destructive_hint=False, idempotent_hint=True)
        return mt.ListToolsResult(
            tools=[mt.Tool(name="reverse_credit", input_schema=schema, annotations=ann)]
        )

    async def call_tool(self, name: str, arguments: Any = None) -> mt.CallToolResult:
        self.started += 1
        self.running += 1
        try:
            while not self.release.is_set():
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    if not self.stubborn:
                        raise
            return mt.CallToolResult(content=[mt.TextContent(type="text", text="reversed")])
        finally:
            self.running -= 1


def slow_registry(session: SlowSession) -> Any:
    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[SlowSession]:
        yield session

    # Long enough for a starved loop thread on CI to open the session and confirm a cancel.
    return blocking_registry(connect, timeout=1.0).get("reverse_credit").fn


def test_a_blocking_call_past_its_timeout_is_cancelled_before_the_retry() -> None:
    session = SlowSession()
    undo = slow_registry(session)
    for attempt in range(1, 4):  # what the engine's retry policy does after each timeout
        with pytest.raises(TimeoutError, match=r"'reverse_credit' did not answer .* cancelled"):
            undo(credit_id="cr_1")
        # Stopped before the caller hears of the timeout: never two undos at once.
        assert (session.started, session.running, session.cancelled) == (attempt, 0, attempt)
    session.release.set()
    assert decode_result(undo(credit_id="cr_1")) == "reversed"


def test_a_call_that_will_not_stop_holds_back_the_next() -> None:
    session = SlowSession(stubborn=True)
    undo = slow_registry(session)
    with pytest.raises(TimeoutError, match="did not answer"):
        undo(credit_id="cr_1")
    with pytest.raises(TimeoutError, match=r"not started: 'reverse_credit' .* still running"):
        undo(credit_id="cr_1")
    assert (session.started, session.running) == (1, 1)  # the retry sent nothing
    session.release.set()
    assert decode_result(undo(credit_id="cr_1")) == "reversed"
    assert (session.started, session.running) == (2, 0)
