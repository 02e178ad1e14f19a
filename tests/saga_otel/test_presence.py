"""The presence stream: a killed agent's open runs are orphaned once its connection closes,
confirmed by the heartbeats, long before three heartbeat intervals would pass."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from saga_otel import semconv as sc
from saga_otel._presence import presence_url
from sidecar import Settings, Sidecar

AGENT = r"""
import asyncio, json, sys
import saga_otel
from saga_otel import Saga, ToolRegistry, tool
from saga_otel._config import instance_id

@tool("compensable", compensate="reverse_credit", compensate_args=lambda i: {"id": 1})
def issue_credit(idempotency_key: str) -> dict:
    return {"id": 1}

@tool("convergent")
def reverse_credit(id: int, idempotency_key: str) -> None:
    pass

saga_otel.configure(sys.argv[1], presence=sys.argv[2] == "on")
saga = Saga("refund", tools=ToolRegistry([issue_credit, reverse_credit]))

async def main() -> None:
    async with saga.run() as run:
        await run.call("issue_credit")
        print(json.dumps({"run_id": run.run_id, "instance": instance_id()}), flush=True)
        await asyncio.sleep(3600)  # killed here

asyncio.run(main())
"""


class Clock:
    now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_presence_url_sits_beside_the_traces_url() -> None:
    assert (
        presence_url("http://127.0.0.1:4318/v1/traces") == "http://127.0.0.1:4318/v1/saga/presence"
    )
    assert (
        presence_url("https://proxy/sidecar/v1/traces") == "https://proxy/sidecar/v1/saga/presence"
    )


@pytest.mark.parametrize("presence", ["on", "off"])
async def test_a_killed_agent_is_orphaned_half_a_second_after_its_connection_closes(
    tmp_path: Path, presence: str
) -> None:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    clock = Clock()  # the sidecar's: the test moves it, never waits for it
    settings = Settings(otlp_http_port=0, otlp_grpc_port=0, api_port=0, db_path=tmp_path / "db")
    async with Sidecar(settings, clock=clock) as sidecar:
        agent = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            f"http://127.0.0.1:{sidecar.otlp_http_port}",
            presence,
            stdout=asyncio.subprocess.PIPE,
        )
        assert agent.stdout is not None
        hello = json.loads(await agent.stdout.readline())
        run_id, instance = hello["run_id"], hello["instance"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        base, started = clock.now, loop.time()
        # Two heartbeats (it sends at once: the three-interval rule) and, when on, its
        # live connection open.
        while (
            sidecar.state.instance_count() == 0
            or not sidecar.state._instances[instance].gaps
            or (presence == "on" and instance not in sidecar._presence)
        ):
            assert loop.time() < deadline, "the agent never beat twice / never connected"
            await asyncio.sleep(0.02)
            clock.now = base + loop.time() - started  # in step until the kill, then frozen
        agent.kill()  # SIGKILL: no goodbye, no last span
        await agent.wait()
        if presence == "on":
            while instance in sidecar._presence:  # the kernel closed its connection
                assert loop.time() < deadline
                await asyncio.sleep(0.01)
        else:
            await asyncio.sleep(0.3)  # nothing to wait for: no connection to close
        clock.now += 0.6  # past the 0.5 s grace, well inside three 1 s intervals
        sidecar.tick()
        expected = sc.STATE_ORPHANED if presence == "on" else sc.STATE_RUNNING
        assert sidecar.state.status(run_id) == expected
        clock.now += 3.0  # heartbeats alone: three intervals
        sidecar.tick()
        assert sidecar.state.status(run_id) == sc.STATE_ORPHANED


async def test_with_several_endpoints_the_live_connection_moves_to_the_next(
    tmp_path: Path,
) -> None:
    """A replica that is gone (refused) costs the presence stream one backoff, then it
    opens at the next endpoint."""
    import socket

    from saga_otel._logging import default_logger
    from saga_otel._presence import Presence
    from saga_otel._transport import TransportSettings

    with socket.socket() as s:  # a port nobody listens on: a replica that is gone
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}/v1/traces"
    clock = Clock()
    settings = Settings(otlp_http_port=0, otlp_grpc_port=0, api_port=0, db_path=tmp_path / "db")
    async with Sidecar(settings) as sidecar:
        live = f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces"
        presence = Presence(
            [gone, live], TransportSettings(headers={}), lambda: "agent-9", default_logger(),
            clock=clock,
        )  # fmt: skip
        await asyncio.to_thread(presence.beat)  # refused
        assert "agent-9" not in sidecar._presence
        clock.now += 60.0  # past any backoff
        await asyncio.to_thread(presence.beat)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while "agent-9" not in sidecar._presence:
            assert loop.time() < deadline, "never connected to the next endpoint"
            await asyncio.sleep(0.01)
        presence.close()


def test_an_error_that_is_not_the_networks_is_raised_once_a_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connect that fails for a reason of the process's own (a child forked while the
    idna codec was half-imported: LookupError) backs off as a network failure does, and is
    raised for the heartbeat to count and log: once a backoff, not once a beat."""
    import socket

    from saga_otel._logging import default_logger
    from saga_otel._presence import Presence
    from saga_otel._transport import TransportSettings

    tries: list[object] = []

    def codecless(*args: object, **kwargs: object) -> socket.socket:
        tries.append(args)
        raise LookupError("unknown encoding: idna")

    monkeypatch.setattr(socket, "create_connection", codecless)
    clock = Clock()
    presence = Presence(
        "http://127.0.0.1:9/v1/traces", TransportSettings(headers={}), lambda: "agent-9",
        default_logger(), clock=clock,
    )  # fmt: skip
    with pytest.raises(LookupError):
        presence.beat()
    presence.beat()  # within the backoff: no connect, nothing raised
    assert len(tries) == 1
    clock.now += 60.0  # past any backoff
    with pytest.raises(LookupError):
        presence.beat()
    assert len(tries) == 2
