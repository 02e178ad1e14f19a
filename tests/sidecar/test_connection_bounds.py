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
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SpanExportResult
from sidecar_testkit import FakeClock, completed_run, export_grpc, export_http, settings_for

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar._connections import FD_RESERVE, connection_cap, fd_limit
from sidecar._http import LoopLag, body_time_left
from sidecar._settings import DEFAULT_MAX_CONNECTIONS

WAIT = 30.0  # generous: the bounds under test are 1 s
PORTS = ["otlp", "api"]


def _port(sc_: Sidecar, which: str) -> int:
    port = sc_.otlp_http_port if which == "otlp" else sc_.api_port
    assert port is not None
    return port


def _refused_total(sc_: Sidecar) -> dict[str, float]:
    """saga_sidecar_connections_refused_total by port, from the sidecar's registry."""
    return {
        s.labels["port"]: s.value
        for metric in sc_.metrics.registry.collect()
        if metric.name + "_total" == sc.M_SIDECAR_CONNECTIONS_REFUSED
        for s in metric.samples
        if s.name == sc.M_SIDECAR_CONNECTIONS_REFUSED
    }


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
        # grpc.max_connection_idle_ms has the same bound, and its timer may fire first.
        assert b"handshake timeout" in goaway or b"connection idle" in goaway, goaway


async def test_a_grpc_connection_that_starts_no_call_is_closed_after_the_keepalive_timeout(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Past its handshake, a connection that never starts a call was held 5 minutes
    (grpc.max_connection_idle_ms); it goes after --keepalive-timeout too, with a GOAWAY
    (grpc clients reconnect when they next call)."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    async with Sidecar(settings_for(tmp_path, keepalive_timeout=1.0), clock=clock) as sc_:
        assert sc_.otlp_grpc_port is not None
        async with _connections(sc_.otlp_grpc_port, 1) as [(reader, writer)]:
            writer.write(preface)  # the HTTP/2 preface and an empty SETTINGS frame
            goaway = await _until_closed(reader)
        assert b"connection idle" in goaway, goaway


# --- number: connections past the cap -------------------------------------------------


@pytest.mark.parametrize("which", PORTS)
async def test_connections_past_the_cap_are_closed_on_arrival_and_the_rest_still_served(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    """With --max-connections 8, eight idle connections fill the port: a ninth is closed
    as it arrives (never left waiting in the accept queue, never blocking the eight),
    the eight are still answered, the other port is not affected, and once one of the
    eight goes a new connection is served."""
    settings = settings_for(tmp_path, max_connections=8, keepalive_timeout=600.0)
    port_name = {"otlp": "otlp_http", "api": "api"}
    other_of = {"otlp": "api", "api": "otlp"}
    async with Sidecar(settings, clock=clock) as sc_:
        port = _port(sc_, which)
        async with _connections(port, 8) as held:
            caplog.set_level(logging.WARNING, logger="sidecar")
            async with _connections(port, 1) as [(ninth, _)]:
                assert await _until_closed(ninth) == b""
            [refused] = [r.__dict__ for r in caplog.records if "refused" in r.getMessage()]
            assert (refused["port"], refused["max_connections"]) == (port_name[which], 8)
            assert "--max-connections" in refused["fix"]
            # Each refusal is counted, not only the first warned of (one warning a minute).
            async with _connections(port, 2) as late:
                for reader, _ in late:
                    assert await _until_closed(reader) == b""
            assert _refused_total(sc_) == {port_name[which]: 3.0, port_name[other_of[which]]: 0}
            for reader, writer in held:
                assert await _answer(reader, writer, which) == b"HTTP/1.1 200 OK"
            other = other_of[which]
            async with _connections(_port(sc_, other), 1) as [(reader, writer)]:
                assert await _answer(reader, writer, other) == b"HTTP/1.1 200 OK"
            held[0][1].close()
            for _ in range(100):  # the server sees the close a moment later
                async with _connections(port, 1) as [(reader, writer)]:
                    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                        if await _answer(reader, writer, which) == b"HTTP/1.1 200 OK":
                            break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a place freed by a closed connection was never taken")


async def test_grpc_connections_past_the_cap_are_closed_on_arrival(
    tmp_path: Path, clock: FakeClock
) -> None:
    settings = settings_for(tmp_path, max_connections=4, keepalive_timeout=600.0)
    async with Sidecar(settings, clock=clock) as sc_:
        port = sc_.otlp_grpc_port
        assert port is not None
        async with _connections(port, 4) as held:
            for reader, _ in held:  # grpc greets each connection it holds (SETTINGS)
                async with asyncio.timeout(WAIT):
                    assert await reader.read(9)
            async with _connections(port, 1) as [(fifth, _)]:
                assert await _until_closed(fifth) == b""
            # The HTTP port has its own places: an agent's spans still get in there.
            assert await export_http(sc_, completed_run().spans()) is SpanExportResult.SUCCESS
            held[0][1].close()
            for _ in range(5):  # the exporter itself retries for up to 10 s
                result = await export_grpc(sc_, completed_run().spans())
                if result is SpanExportResult.SUCCESS:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("a place freed on the gRPC port was never taken")


async def test_the_cap_in_use_is_logged_and_one_given_past_the_limit_is_warned(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The default fits the descriptor limit in silence (``sidecar.started`` says the
    cap); a --max-connections the limit cannot hold is lowered with a warning saying
    what limit to set."""
    caplog.set_level(logging.INFO, logger="sidecar")

    def events(name: str) -> list[dict[str, Any]]:
        return [r.__dict__ for r in caplog.records if r.getMessage() == name]

    limit = fd_limit()
    async with Sidecar(settings_for(tmp_path), clock=clock):
        pass
    [started] = events("sidecar.started")
    assert started["max_connections"] == connection_cap(DEFAULT_MAX_CONNECTIONS, limit)
    assert events("sidecar.connections.capped") == []
    caplog.clear()
    async with Sidecar(settings_for(tmp_path, max_connections=limit), clock=clock):
        pass
    [capped] = events("sidecar.connections.capped")
    assert capped["asked"] == limit and capped["max_connections"] < limit
    assert "ulimit -n" in capped["fix"] and str(limit * 3 + FD_RESERVE) in capped["fix"]


@pytest.mark.parametrize(
    ("limit", "wanted", "per_port"),
    [
        (1_048_576, 16384, 16384),  # a container's usual limit: the setting holds
        (65536, 16384, 16384),
        (20000, 16384, (20000 - FD_RESERVE) // 3),
        (1024, 16384, (1024 - FD_RESERVE) // 3),  # a login shell's usual soft limit
        (1024, 50, 50),
        (FD_RESERVE, 16384, 1),  # never zero: a port that holds nothing serves nothing
    ],
)
def test_the_connection_cap_fits_the_descriptor_limit(
    limit: int, wanted: int, per_port: int
) -> None:
    """Three ports full, plus what the sidecar itself keeps open (database, loop, grpc's
    own), stay within the process's descriptor limit: past it, accept() fails on every
    port and the database cannot open a file."""
    assert connection_cap(wanted, limit) == per_port


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


# --- time: a body sent in time while the sidecar's own loop was stalled -------------


def test_loop_lag_sums_how_late_each_tick_ran() -> None:
    lag = LoopLag()
    lag.armed(10.0)
    lag.ran(10.0)  # on time
    assert lag.stalled(10.05) == 0.0
    lag.armed(10.1)
    assert lag.stalled(10.05) == 0.0  # not due yet
    assert lag.stalled(12.1) == 2.0  # due, and not run: the loop is behind still
    lag.ran(13.1)
    assert lag.stalled(20.0) == 3.0  # nothing armed: nothing more counted


def test_a_body_is_not_charged_for_the_loops_stall_up_to_another_body_timeout() -> None:
    # 30 s whole, 16 KiB/s after a 2 s grace: 1 KiB in at 1 s has 1.0625 s left.
    assert body_time_left(1.0, 0.0, 1024, 30.0, 16384) == 1.0625
    # The loop stalled 5 s of those 6: as if 1 s had passed.
    assert body_time_left(6.0, 5.0, 1024, 30.0, 16384) == 1.0625
    # Never past twice --body-timeout, however late the loop runs.
    assert body_time_left(60.0, 100.0, 1 << 30, 30.0, 16384) == 0.0


def _rest_and_answer(sock: socket.socket, rest: bytes) -> bytes:
    """Send the rest of a request on a blocking socket; everything the sidecar answers."""
    sock.sendall(rest)
    sock.settimeout(WAIT)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


async def _sent_while_the_loop_stalls(port: int, body: bytes, wait: float, stall: float) -> bytes:
    """Send a request's head and 10 body bytes, let the sidecar wait for the rest ``wait``
    seconds, then stall its loop (the test shares it: as an inline commit waiting on a
    lock does) for ``stall`` seconds while another thread sends the rest at once; the
    sidecar's answer."""
    sock = socket.create_connection(("127.0.0.1", port))
    with sock:
        sock.sendall(
            b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/x-protobuf\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        await asyncio.sleep(wait)
        answers: list[bytes] = []
        sender = threading.Thread(target=lambda: answers.append(_rest_and_answer(sock, body[10:])))
        sender.start()
        time.sleep(stall)  # noqa: ASYNC251 - the point: the sidecar's loop does not run
        await asyncio.to_thread(sender.join)
    return answers[0]


async def test_a_body_whole_in_the_buffer_is_not_cut_by_a_deadline_the_loop_missed(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The rest of a body arrives at once, but the loop stalls past --body-timeout (1 s),
    longer than the stall it forgives (another --body-timeout): what the buffer holds
    was sent in time and is taken; 200, the run stored. It was answered 408 (which
    OTLP exporters do not retry) and its spans dropped."""
    run = completed_run()
    body = encode_spans(run.spans()).SerializeToString()
    async with Sidecar(settings_for(tmp_path, body_timeout=1.0), clock=clock) as sc_:
        assert sc_.otlp_http_port is not None
        answer = await _sent_while_the_loop_stalls(sc_.otlp_http_port, body, 0.2, 2.5)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert sc_.state.status(run.run_id) == sc.STATUS_COMPLETED


async def test_the_loops_stall_is_not_counted_against_a_body_still_arriving(
    tmp_path: Path, clock: FakeClock
) -> None:
    """4 MB sent at once while the loop is stalled across the body's deadline (2 s): the
    sender is held by flow control, and after the stall a read takes only part of it.
    The stall is not the client's: the rest is read, 200."""
    run = completed_run()
    request = encode_spans(run.spans())
    filler = (
        request.resource_spans[0]
        .scope_spans[0]
        .spans.add(name="upload", trace_id=b"\x01" * 16, span_id=b"\x02" * 8)
    )
    filler.attributes.add(key="payload").value.string_value = "x" * (4 << 20)
    body = request.SerializeToString()
    async with Sidecar(settings_for(tmp_path, body_timeout=2.0), clock=clock) as sc_:
        assert sc_.otlp_http_port is not None
        answer = await _sent_while_the_loop_stalls(sc_.otlp_http_port, body, 0.8, 1.5)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert sc_.state.status(run.run_id) == sc.STATUS_COMPLETED
