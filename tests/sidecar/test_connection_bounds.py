"""Every connection on the sidecar's ports is bounded in time and in number.

Real sockets on loopback against a real Sidecar: a peer that connects and says
nothing, one whose request head trickles, one idle after its answer, one whose API
body stalls, and more connections than a port holds. No test asserts a duration:
each waits (generously) for the connection to close or the answer to come, which
without the bound never happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_testkit import FakeClock, completed_run, export_http, settings_for

from sidecar import Sidecar

WAIT = 30.0  # generous: the bounds under test are 1 s
PORTS = ["otlp", "api"]


def _port(sc_: Sidecar, which: str) -> int:
    port = sc_.otlp_http_port if which == "otlp" else sc_.api_port
    assert port is not None
    return port


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts)."""
    data = b""
    async with asyncio.timeout(WAIT):
        try:
            while chunk := await reader.read(65536):
                data += chunk
        except ConnectionError:
            pass
    return data


@contextlib.asynccontextmanager
async def _connections(port: int, n: int) -> AsyncIterator[list[Any]]:
    pairs = [await asyncio.open_connection("127.0.0.1", port) for _ in range(n)]
    try:
        yield pairs
    finally:
        for _, writer in pairs:
            writer.close()


def _request(which: str) -> bytes:
    """A whole request the port answers 200."""
    if which == "api":
        return b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
    return (
        b"POST /v1/traces HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Length: 0\r\n\r\n"
    )


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, which: str) -> bytes:
    """Send the port's request on an open connection; the status line of its answer."""
    writer.write(_request(which))
    await writer.drain()
    async with asyncio.timeout(WAIT):
        status, *headers = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        fields = dict(h.lower().split(b": ", 1) for h in headers if h)
        await reader.readexactly(int(fields[b"content-length"]))
    return status


# --- time: idle connections and request heads --------------------------------------


@pytest.mark.parametrize("which", PORTS)
async def test_silent_and_trickling_connections_are_closed_after_the_keepalive_timeout(
    tmp_path: Path, clock: FakeClock, which: str
) -> None:
    """A connection that sends nothing, one that sends half a request head, and one whose
    head trickles in a header line at a time are all closed, unanswered, once
    --keepalive-timeout (1 s here) passes without a whole head; before, all three were
    held until the peer left (aiohttp's own keep-alive timer: an hour, and only after a
    first request)."""
    async with Sidecar(settings_for(tmp_path, keepalive_timeout=1.0), clock=clock) as sc_:
        port = _port(sc_, which)
        async with _connections(port, 3) as ((silent, _), (half, half_w), (trickle, trickle_w)):
            half_w.write(b"POST /v1/traces HTTP/1.1\r\nHost: localhost\r\n")
            trickle_w.write(b"GET /runs HTTP/1.1\r\nHost: localhost\r\n")

            async def trickling() -> None:
                with contextlib.suppress(ConnectionError):
                    for i in range(1000):
                        trickle_w.write(b"X-Pad-%d: a\r\n" % i)
                        await trickle_w.drain()
                        await asyncio.sleep(0.5)  # under aiohttp's 128 headers in WAIT

            feeder = asyncio.create_task(trickling())
            try:
                got = await asyncio.gather(*(_until_closed(r) for r in (silent, half, trickle)))
            finally:
                feeder.cancel()
            assert got == [b"", b"", b""]


@pytest.mark.parametrize("which", PORTS)
async def test_a_kept_alive_connection_is_closed_once_idle_after_its_answer(
    tmp_path: Path, clock: FakeClock, which: str
) -> None:
    """The timer starts again after each answer: a connection idle after it goes too."""
    settings = settings_for(tmp_path, keepalive_timeout=1.0)
    async with (
        Sidecar(settings, clock=clock) as sc_,
        _connections(_port(sc_, which), 1) as [(reader, writer)],
    ):
        assert await _answer(reader, writer, which) == b"HTTP/1.1 200 OK"
        assert await _until_closed(reader) == b""


async def test_a_silent_grpc_connection_is_closed_after_the_keepalive_timeout(
    tmp_path: Path, clock: FakeClock
) -> None:
    """gRPC's own handshake timeout (grpc.server_handshake_timeout_ms, 120 s unset) is
    --keepalive-timeout: a peer that never sends the HTTP/2 preface is told so and
    closed."""
    async with Sidecar(settings_for(tmp_path, keepalive_timeout=1.0), clock=clock) as sc_:
        assert sc_.otlp_grpc_port is not None
        async with _connections(sc_.otlp_grpc_port, 1) as [(reader, _)]:
            goaway = await _until_closed(reader)
        assert b"handshake timeout" in goaway, goaway


# --- API bodies: the OTLP port's bounded reader ------------------------------------


def _json_body(answer: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    return doc


@pytest.mark.parametrize("path", ["/runs/r1/resolve", "/runs/r1/lease", "/runs/r1/lease/renew"])
async def test_a_stalled_api_body_is_cut_by_the_body_timeout(
    tmp_path: Path, clock: FakeClock, path: str
) -> None:
    """Before, an API body was read by aiohttp with no deadline: a peer that sent 1 byte
    of 100 held its connection (and up to 64 KiB) for as long as it liked."""
    async with Sidecar(settings_for(tmp_path, body_timeout=1.0), clock=clock) as sc_:
        async with _connections(_port(sc_, "api"), 1) as [(reader, writer)]:
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{{".encode()
            )
            answer = await _until_closed(reader)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert "--body-timeout" in _json_body(answer)["error"]


async def test_api_bodies_arriving_at_once_are_bounded_per_port(
    tmp_path: Path, clock: FakeClock
) -> None:
    """--max-receiving bounds the API port's bodies as it does the OTLP port's, each port
    its own count: one stalled resolve body holds the API's only place (429 for the
    next), while an agent's export on the OTLP port is stored meanwhile."""
    settings = settings_for(tmp_path, max_receiving=1, body_timeout=600.0)
    async with Sidecar(settings, clock=clock) as sc_:
        url = f"http://127.0.0.1:{sc_.api_port}/runs/r1/resolve"
        async with (
            _connections(_port(sc_, "api"), 1) as [(_, stalled)],
            aiohttp.ClientSession() as s,
        ):
            stalled.write(
                b"POST /runs/r1/resolve HTTP/1.1\r\nHost: localhost\r\nContent-Length: 9\r\n\r\n"
            )
            for _ in range(1000):
                async with s.post(url, json={"note": "done"}) as resp:
                    if resp.status == 429:
                        assert resp.headers["Retry-After"] == "1"
                        assert "--max-receiving" in (await resp.json())["error"]
                        break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("a stalled API body never held the receiving place")
            assert await export_http(sc_, completed_run().spans()) is SpanExportResult.SUCCESS
            stalled.close()
            for _ in range(1000):
                async with s.post(url, json={"note": "done"}) as resp:
                    if resp.status != 429:
                        assert resp.status == 404  # read, then: no such run
                        break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the receiving place was never given back")
