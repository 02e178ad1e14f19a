"""DNS rebinding and hostile ``Host`` headers, against a real sidecar on loopback.

A page anywhere can make its own name resolve to 127.0.0.1 once it is loaded: its
scripts are then same-origin with the sidecar's ports (the Origin check passes, no CORS
preflight applies), and only the Host header still says which name the page used. A
sidecar on loopback answers only Hosts that name it (sidecar/_hosts.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from sidecar_testkit import (
    FakeClock,
    compensation_failed_run,
    export_http,
    open_run,
    settings_for,
)

from sidecar import Settings, Sidecar
from sidecar._alert_service import install_alerting
from sidecar._alert_settings import AlertSettings

BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
REBOUND = "rebind.attacker.example"


@pytest.fixture
async def sidecar(tmp_path: Path, clock: FakeClock) -> AsyncIterator[Sidecar]:
    """No token (the loopback default), tool arguments under credit_id masked."""
    sidecar = Sidecar(settings_for(tmp_path, idle_timeout=30.0), clock=clock)
    install_alerting(sidecar, AlertSettings(log_sink=False, redact_keys=("credit_id",)))
    async with sidecar:
        yield sidecar


async def raw(
    port: int | None, method: str, path: str, host: bytes | None, *,
    body: bytes = b"", headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One HTTP/1.1 request with exactly this Host (None: no Host line); its answer."""
    assert port is not None
    head = f"{method} {path} HTTP/1.1\r\n".encode()
    if host is not None:
        head += b"Host: " + host + b"\r\n"
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n".encode()
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    top, _, content = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, content


def rebound(port: int | None) -> bytes:
    return f"{REBOUND}:{port}".encode()


def from_the_rebound_page(port: int | None) -> dict[str, str]:
    """What a browser adds to a script's request after the rebind: it is same-origin."""
    return {
        "Origin": f"http://{REBOUND}:{port}", "Sec-Fetch-Site": "same-origin",
        "Sec-Fetch-Mode": "cors", "Content-Type": "text/plain",
    }  # fmt: skip


async def test_a_page_under_a_rebound_name_reads_and_changes_nothing(sidecar: Sidecar) -> None:
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    port, page = sidecar.api_port, from_the_rebound_page(sidecar.api_port)
    host = rebound(port)
    status, _, body = await raw(port, "GET", f"/runs/{run.run_id}?reveal=args", host, headers=page)
    assert status == 421 and b"cr_1" not in body
    why = json.loads(body)["error"]
    assert REBOUND in why and "--public-url" in why and "DNS rebinding" in why
    for method, path, sent in (
        ("POST", f"/runs/{run.run_id}/resolve", {"note": "attacker resolved it"}),
        ("POST", f"/runs/{run.run_id}/lease", {"holder": "evil", "force": True, "reason": "x"}),
        ("POST", f"/ui/runs/{run.run_id}/resolve", None),
        ("GET", f"/runs/{run.run_id}/stack?reveal=args", None),
        ("GET", "/runs?reveal=args", None),
        ("GET", "/review", None),
        ("GET", "/metrics", None),
        ("GET", "/healthz", None),
        ("GET", "/readyz", None),
    ):
        data = b"note=forged" if sent is None else json.dumps(sent).encode()
        status, _, body = await raw(port, method, path, host, body=data, headers=page)
        assert status == 421, (method, path, body[:200])
        assert b"cr_1" not in body and run.run_id.encode() not in body, path
    view = sidecar.state.view(run.run_id)
    assert view is not None and view["resolution"] is None and view["recovery"] is None


async def test_a_person_under_a_foreign_name_is_told_what_to_do(sidecar: Sidecar) -> None:
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    status, headers, body = await raw(
        sidecar.api_port, "GET", f"/runs/{run.run_id}", b"sidecar.internal:4320",
        headers={"Accept": BROWSER},
    )  # fmt: skip
    page = body.decode()
    assert status == 421 and headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in headers["content-security-policy"]
    assert "sidecar.internal" in page and "--public-url" in page
    assert run.run_id not in page


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:{port}", "127.0.0.1", "localhost:{port}", "LOCALHOST:{port}", "localhost",
        "localhost.:{port}", "127.0.0.2:8080", "[::1]:{port}", "[::1]",
        "localhost:9999",  # a local port forward (ssh -L 9999:127.0.0.1:PORT) keeps its port
        "localhost:", "",  # an empty port, no name at all: nothing was renamed
    ],
)  # fmt: skip
async def test_the_names_of_this_sidecar_are_answered(sidecar: Sidecar, host: str) -> None:
    name = host.format(port=sidecar.api_port).encode()
    for path in ("/healthz", "/readyz"):  # what probes and load balancers ask
        status, _, body = await raw(sidecar.api_port, "GET", path, name)
        assert status == 200, (path, body)
    run = open_run()
    traces = encode_spans(run.spans()).SerializeToString()
    status, _, body = await raw(
        sidecar.otlp_http_port, "POST", "/v1/traces", host.format(port=sidecar.otlp_http_port)
        .encode(), body=traces, headers={"Content-Type": "application/x-protobuf"},
    )  # fmt: skip
    assert status == 200, body
    assert sidecar.state.status(run.run_id) is not None


HOSTILE_HOSTS = [
    b"a b", b"[::1", b"x:99999", b"x:abc", b"u@evil.example:1", b"evil.example:1/x?",
    b"\xff\xfe", b"%00", b"127.0.0.1:" + b"9" * 30, b"[::1]:80x", b"xn--", b"a" * 300,
    b"evil.example:80';touch /tmp/x;'", b"127.0.0.1.evil.example", b"localhost.evil.example",
    b"[::ffff:8.8.8.8]", b"0x7f.1", b"127.0.0.1:4320:1", b"[127.0.0.1]:1", b"localhost:99999",
]  # fmt: skip


@pytest.mark.parametrize("host", HOSTILE_HOSTS)
async def test_a_hostile_host_header_never_breaks_a_route(sidecar: Sidecar, host: bytes) -> None:
    """Refused (421), never a 5xx, on every kind of route of both HTTP ports; the sidecar
    still answers afterwards. The run page built its links from Host and answered 500."""
    run = open_run()
    await export_http(sidecar, run.spans())
    api, otlp = sidecar.api_port, sidecar.otlp_http_port
    for port, method, path, accept in (
        (api, "GET", f"/ui/runs/{run.run_id}", BROWSER),
        (api, "GET", f"/runs/{run.run_id}", BROWSER),
        (api, "GET", f"/runs/{run.run_id}", "*/*"),
        (api, "GET", "/review", BROWSER),
        (api, "POST", f"/ui/runs/{run.run_id}/resolve", BROWSER),
        (otlp, "POST", "/v1/traces", "*/*"),
    ):
        status, _, body = await raw(port, method, path, host, headers={"Accept": accept})
        assert status == 421, (path, status, body[:300])
    status, _, _ = await raw(api, "GET", "/healthz", b"127.0.0.1")
    assert status == 200


async def test_spans_posted_under_a_rebound_name_are_not_stored(sidecar: Sidecar) -> None:
    """The OTLP/HTTP port carries no cookie and no page, but a rebound page could post
    spans (forged runs and alerts, heartbeats that keep a dead agent looking alive)."""
    run = open_run()
    body = encode_spans(run.spans()).SerializeToString()
    headers = {**from_the_rebound_page(sidecar.otlp_http_port),
               "Content-Type": "application/x-protobuf"}  # fmt: skip
    status, _, answer = await raw(
        sidecar.otlp_http_port, "POST", "/v1/traces", rebound(sidecar.otlp_http_port),
        body=body, headers=headers,
    )  # fmt: skip
    assert status == 421 and "--public-url" in json.loads(answer)["error"]
    assert sidecar.state.status(run.run_id) is None


async def test_the_public_urls_name_is_answered_too(tmp_path: Path, clock: FakeClock) -> None:
    """Behind a proxy that passes the Host people use, --public-url names it."""
    sidecar = Sidecar(settings_for(tmp_path), clock=clock)
    install_alerting(
        sidecar, AlertSettings(log_sink=False, public_url="https://Saga.Example.org/sidecar")
    )
    async with sidecar:
        for host, expected in (
            (b"saga.example.org", 200), (b"saga.example.org:443", 200),
            (b"SAGA.example.org.", 200), (b"example.org", 421), (b"evil.example", 421),
        ):  # fmt: skip
            status, _, _ = await raw(sidecar.api_port, "GET", "/healthz", host)
            assert status == expected, host


def test_a_non_loopback_bind_leaves_the_boundary_to_the_token() -> None:
    """Bound beyond loopback (allowed only with --token), people reach the sidecar by
    names it cannot know (a load balancer's, a container's service name); a rebound page
    has no token (a browser keeps Basic credentials per origin), so any Host is heard."""
    from sidecar._hosts import HostRule

    wide = HostRule.of(Settings(host="0.0.0.0", token="t0ken"), None)
    assert wide.refusal(f"{REBOUND}:4320") is None and wide.refusal("sidecar:4320") is None
    # On loopback the token does not widen it: the names are known, and checked.
    local = HostRule.of(Settings(host="127.0.0.1", token="t0ken"), None)
    assert local.refusal(f"{REBOUND}:4320") is not None
    assert local.refusal("localhost:4320") is None
    # The bound address itself, when it is a name.
    named = HostRule.of(Settings(host="::1"), "http://sidecar.lan:8080")
    assert named.refusal("[::1]:1") is None and named.refusal("sidecar.lan") is None
    assert named.refusal("lan:8080") is not None


async def test_a_refusal_names_the_host_safely(sidecar: Sidecar) -> None:
    host = b"\xff\xfe<script>" + b"x" * 500
    status, _, body = await raw(sidecar.api_port, "GET", "/runs/x", host)
    assert status == 421
    why = json.loads(body)["error"]
    assert "'\\udcff\\udcfe<script>xxx" in why and len(why) < 1000, why
    status, _, body = await raw(
        sidecar.api_port, "GET", "/runs/x", host, headers={"Accept": BROWSER}
    )
    page = body.decode()
    assert status == 421 and "<script" not in page and "\\udcff\\udcfe&lt;script&gt;" in page


@pytest.mark.parametrize(
    "url", ["http://", "https://:443/sidecar", "http://x:99999", "http://[::1"]
)
def test_a_public_url_that_names_no_host_is_refused_at_start(url: str) -> None:
    """Its host is a name the sidecar answers: a URL without one is a mistake to say."""
    from sidecar._errors import ConfigError

    with pytest.raises(ConfigError, match="names no host"):
        AlertSettings(public_url=url)
