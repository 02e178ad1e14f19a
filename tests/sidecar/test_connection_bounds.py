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
