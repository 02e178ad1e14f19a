"""Each sink against a real local HTTP server: what it sends, and how it reports the answer."""

from __future__ import annotations

import asyncio
import io
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from sidecar_testkit import CREDIT, RunScript

from saga_otel import semconv as sc
from sidecar import RunState
from sidecar._alerting import Action, AlertEvent, evaluate
from sidecar._otlp import extract
from sidecar._redact import Redactor
from sidecar._sinks import (
    PAGERDUTY_BODY_MAX,
    TEXT_MAX,
    WEBHOOK_BODY_MAX,
    AlertmanagerSink,
    DeliveryRejected,
    DeliveryRetry,
    LogSink,
    PagerDutySink,
    WebhookSink,
    event_document,
    fit_body,
    pagerduty_dedup_key,
    parse_retry_after,
    shown_sink,
    shown_url,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Receiver:
    """A local HTTP endpoint that records bodies and answers from a script (then 200/202)."""

    def __init__(self, ok_status: int = 202) -> None:
        self.bodies: list[Any] = []
        self.script: list[tuple[int, str, dict[str, str]]] = []
        self.ok_status = ok_status
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        if self.script:
            status, text, headers = self.script.pop(0)
            return web.Response(status=status, text=text, headers=headers)
        return web.json_response({"status": "success"}, status=self.ok_status)

    async def start(self, port: int | None = None) -> str:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        self.port = port or free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()
    await rec.start()
    yield rec
    await rec.stop()


VIEW: dict[str, Any] = {
    "run_id": "run-42",
    "saga": "refund",
    "service": "refund-agent",
    "instance": "i1",
    "status": "unwinding",
    "updated_at": 10.0,
    "failed_step": "send_reply",
    "unwind_reason": "SMTPError: mail down",
    "unwind_started_at": 10.0,
    "steps": [],
    "stack": [],
    "escalation": None,
    "resolution": None,
}


def fire_and_resolve() -> tuple[AlertEvent, AlertEvent]:
    (fire,) = evaluate(None, VIEW, now=10.5)
    (resolve,) = evaluate(VIEW, {**VIEW, "status": "compensated", "ended_at": 12.0}, now=12.5)
    return fire, resolve.resolving_with(fire)


async def test_pagerduty_trigger_and_resolve(receiver: Receiver) -> None:
    sink = PagerDutySink("routing-abc", url=f"http://127.0.0.1:{receiver.port}/v2/enqueue")
    fire, resolve = fire_and_resolve()
    try:
        await sink.send(fire)
        await sink.send(resolve)
    finally:
        await sink.close()
    trigger, resolved = receiver.bodies
    assert trigger["event_action"] == "trigger"
    assert trigger["routing_key"] == "routing-abc"
    assert trigger["dedup_key"] == "saga-otel/SagaCompensationStarted/run-42"
    payload = trigger["payload"]
    assert payload["severity"] == "warning"
    assert payload["source"] == "refund-agent"
    assert payload["summary"].startswith("refund run run-42 unwinding after send_reply failed")
    assert payload["custom_details"]["labels"]["step"] == "send_reply"
    assert payload["custom_details"]["run_url"].endswith("/runs/run-42")
    assert resolved["event_action"] == "resolve"
    assert resolved["dedup_key"] == trigger["dedup_key"]


async def test_webhook_body(receiver: Receiver) -> None:
    sink = WebhookSink(f"http://127.0.0.1:{receiver.port}/hook")
    fire, resolve = fire_and_resolve()
    try:
        await sink.send(fire)
        await sink.send(resolve)
    finally:
        await sink.close()
    first, second = receiver.bodies
    assert (first["status"], second["status"]) == ("firing", "resolved")
    assert first["alertname"] == "SagaCompensationStarted"
    assert first["labels"] == second["labels"]
    assert first["annotations"]["escalation_card"]
    assert first["starts_at"] == "1970-01-01T00:00:10Z"


async def test_alertmanager_payload_has_ends_at_only_on_resolve(receiver: Receiver) -> None:
    sink = AlertmanagerSink(f"http://127.0.0.1:{receiver.port}")
    fire, resolve = fire_and_resolve()
    try:
        await sink.send(fire)
        await sink.send(resolve)
    finally:
        await sink.close()
    [firing], [resolved] = receiver.bodies
    assert "endsAt" not in firing
    assert firing["startsAt"] == resolved["startsAt"] == "1970-01-01T00:00:10Z"
    assert resolved["endsAt"] == "1970-01-01T00:00:12Z"
    assert firing["labels"] == resolved["labels"]
    assert firing["generatorURL"].endswith("/runs/run-42")


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_server_errors_are_retryable(receiver: Receiver, status: int) -> None:
    receiver.script.append((status, "try later", {}))
    sink = WebhookSink(f"http://127.0.0.1:{receiver.port}/")
    try:
        with pytest.raises(DeliveryRetry, match=f"{status}: try later"):
            await sink.send(fire_and_resolve()[0])
    finally:
        await sink.close()


async def test_429_is_retryable_with_the_servers_hint(receiver: Receiver) -> None:
    receiver.script.append((429, "slow down", {"Retry-After": "7"}))
    sink = PagerDutySink("k", url=f"http://127.0.0.1:{receiver.port}/")
    try:
        with pytest.raises(DeliveryRetry) as info:
            await sink.send(fire_and_resolve()[0])
    finally:
        await sink.close()
    assert info.value.retry_after == 7.0


async def test_other_4xx_is_a_configuration_error_with_the_answer(receiver: Receiver) -> None:
    receiver.script.append((400, '{"message":"Invalid routing key"}', {}))
    sink = PagerDutySink("bad", url=f"http://127.0.0.1:{receiver.port}/")
    try:
        with pytest.raises(DeliveryRejected, match=r"400.*Invalid routing key.*routing key"):
            await sink.send(fire_and_resolve()[0])
    finally:
        await sink.close()


async def test_nothing_listening_is_retryable() -> None:
    sink = WebhookSink(f"http://127.0.0.1:{free_port()}/")
    try:
        with pytest.raises(DeliveryRetry, match="unreachable"):
            await sink.send(fire_and_resolve()[0])
    finally:
        await sink.close()


async def test_log_sink_writes_one_json_line_per_alert() -> None:
    stream = io.StringIO()
    fire, resolve = fire_and_resolve()
    sink = LogSink(stream=stream)
    await sink.send(fire)
    await sink.send(resolve)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["level"], first["status"]) == ("warning", "firing")
    assert (second["level"], second["action"]) == ("info", Action.RESOLVE.value)


def test_retry_after_forms() -> None:
    assert parse_retry_after("3", now=0.0) == 3.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:00:30 GMT", now=10.0) == 20.0
    assert parse_retry_after("soon", now=0.0) is None
    assert parse_retry_after(None, now=0.0) is None


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.slack.com/services/T0/B0/XSECRETX", "https://hooks.slack.com/…"),
        ("https://example.com/hook?token=QSECRETQ", "https://example.com/…"),
        ("http://user:PSECRETP@127.0.0.1:9093", "http://127.0.0.1:9093"),
        ("http://127.0.0.1:9093/", "http://127.0.0.1:9093"),
        ("https://events.pagerduty.com/v2/enqueue", "https://events.pagerduty.com/…"),
        ("not a url with SECRET", "…"),
        ("", ""),
    ],
)
def test_urls_are_shown_without_path_query_or_password(url: str, shown: str) -> None:
    assert shown_url(url) == shown
    assert shown_sink(f"webhook:{url}") == (
        f"webhook:{shown}" if "://" in url else f"webhook:{url}"
    )
    assert shown_sink("log") == "log"


async def test_a_sinks_errors_name_its_url_without_the_secret(receiver: Receiver) -> None:
    receiver.script += [(503, "busy", {}), (400, "no such hook", {})]
    secret = f"http://127.0.0.1:{receiver.port}/services/XSECRETX"
    sink = WebhookSink(secret)
    try:
        with pytest.raises(DeliveryRetry) as retry:
            await sink.send(fire_and_resolve()[0])
        with pytest.raises(DeliveryRejected) as rejected:
            await sink.send(fire_and_resolve()[0])
    finally:
        await sink.close()
    gone = WebhookSink(f"http://127.0.0.1:{free_port()}/services/XSECRETX")
    try:
        with pytest.raises(DeliveryRetry) as unreachable:
            await gone.send(fire_and_resolve()[0])
    finally:
        await gone.close()
    for err in (retry.value, rejected.value, unreachable.value):
        assert "SECRET" not in str(err) and "http://127.0.0.1:" in str(err), str(err)


def test_a_long_run_ids_pagerduty_key_fits_and_stays_distinct() -> None:
    # A run id may have 256 characters; PagerDuty refuses a dedup_key over 255 (a 400,
    # which the outbox never retries: the page would be lost).
    short = "saga-otel/SagaRunStuck/run-42"
    assert pagerduty_dedup_key(short) == short
    long_a = "saga-otel/SagaCompensationStarted/" + "a" * 255 + "1"
    long_b = "saga-otel/SagaCompensationStarted/" + "a" * 255 + "2"
    a, b = pagerduty_dedup_key(long_a), pagerduty_dedup_key(long_b)
    assert len(a) == len(b) == 255 and a != b
    assert a == pagerduty_dedup_key(long_a) and a.startswith("saga-otel/SagaCompensationStarted/")
    (fire,) = evaluate(None, {**VIEW, "run_id": "r" * 256}, now=10.5)
    assert len(PagerDutySink("k").payload(fire)["dedup_key"]) == 255


class Redirects:
    """Answers a POST under /hook with ``status`` pointing at /moved (or, under /https, at
    the same URL over https), and anything at /moved with 200: a sink that followed the
    redirect would see it accepted."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.seen: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path))
        if request.path.startswith("/moved"):
            return web.Response(status=200, text="landing page")
        https = request.path.startswith("/https")
        location = str(request.url.with_scheme("https")) if https else "/moved"
        return web.Response(status=self.status, headers={"Location": location})

    async def __aenter__(self) -> Redirects:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def sink_of(kind: str, url: str) -> AlertmanagerSink | PagerDutySink | WebhookSink:
    if kind == "alertmanager":
        return AlertmanagerSink(url)
    if kind == "pagerduty":
        return PagerDutySink("rk", url=url)
    return WebhookSink(url)


@pytest.mark.parametrize("kind", ["webhook", "alertmanager", "pagerduty"])
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_is_refused_naming_where_it_points_never_followed(
    kind: str, status: int
) -> None:
    # Followed, a 301/302/303 turns the POST into a GET without the alert, and the
    # landing page's 200 marked the alert delivered.
    async with Redirects(status) as server:
        for path, to in [("/hook", "another path"), ("/https/hook", "the same path")]:
            sink = sink_of(kind, f"http://127.0.0.1:{server.port}{path}/XSECRETX")
            try:
                with pytest.raises(DeliveryRejected) as info:
                    await sink.send(fire_and_resolve()[0])
            finally:
                await sink.close()
            message = str(info.value)
            scheme = "https" if "https" in path else "http"
            assert f"answered {status} " in message, message
            assert f"redirecting to {scheme}://127.0.0.1:{server.port}/… ({to})" in message
            assert "final URL" in message and "SECRET" not in message, message
    assert [method for method, _ in server.seen] == ["POST", "POST"]
    assert not [p for _, p in server.seen if p.startswith("/moved")]


class Streams:
    """Answers every POST with ``status`` and a body of ``size`` bytes, written in chunks
    until done or the client closes the connection; ``written`` is what it got out."""

    def __init__(self, status: int, size: int) -> None:
        self.status, self.size = status, size
        self.written = 0
        self.ended = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        chunk = b"x" * (256 * 1024)
        resp = web.StreamResponse(status=self.status)
        resp.content_length = self.size
        try:
            await resp.prepare(request)
            while self.written < self.size:
                await resp.write(chunk)
                self.written += len(chunk)
            await resp.write_eof()
        except ConnectionError:
            pass  # the client closed it: what the sink must do with an answer this long
        finally:
            self.ended.set()
        return resp

    async def __aenter__(self) -> Streams:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.mark.parametrize("status", [200, 500, 400])
async def test_a_sinks_answer_is_read_only_so_far_however_long(status: int) -> None:
    # An answer of 512 MiB, read whole, took the sidecar to 1 GiB. A sink reads at most
    # a few KiB of it (an error's text) and closes the connection on the rest.
    size = 64 * 1024 * 1024
    async with Streams(status, size) as server:
        sink = WebhookSink(f"http://127.0.0.1:{server.port}/hook", timeout=60.0)
        try:
            if status == 200:
                await sink.send(fire_and_resolve()[0])
            else:
                kind = DeliveryRetry if status == 500 else DeliveryRejected
                with pytest.raises(kind) as info:
                    await sink.send(fire_and_resolve()[0])
                assert f"answered {status}" in str(info.value) or f"with {status}" in str(
                    info.value
                )
                assert len(str(info.value)) < 4000 and "xxxx" in str(info.value)
            await asyncio.wait_for(server.ended.wait(), 30)
        finally:
            await sink.close()
    # The connection was closed with the answer unread: the server got out what the
    # kernel's socket buffers took (a few MiB), never the whole answer.
    assert server.written < size, server.written


class PagerDutyFake(Receiver):
    """PagerDuty's Events API v2 as to size: an event over 512 KB is refused with 400."""

    LIMIT = 512_000

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bodies.append(json.loads(body))
        if len(body) > self.LIMIT:
            errors = {"status": "invalid event", "errors": ["Payload too large"]}
            return web.json_response(errors, status=400)
        return web.json_response({"status": "success"}, status=202)


@pytest.fixture
async def pagerduty() -> AsyncIterator[PagerDutyFake]:
    rec = PagerDutyFake()
    await rec.start()
    yield rec
    await rec.stop()


def fired(script: RunScript) -> list[AlertEvent]:
    """The alerts a run's spans fire, through the sidecar's own fold and rules."""
    decoded = extract(encode_spans(list(script.spans())))
    state = RunState()
    state.apply(list(decoded.spans), 1_700_000_100.0)
    view = state.view(script.run_id)
    assert view is not None
    return [e for e in evaluate(None, view, now=1_700_000_100.0) if e.firing]


def texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in texts(v)]
    return []


async def test_a_long_failure_message_still_pages_through_pagerduty(
    pagerduty: PagerDutyFake,
) -> None:
    # A tool's error quoting an HTML page, 120 KB: it was in the event about 8 times
    # (description, the card as JSON and as text, the stack twice, the unwind reason),
    # an event of 1.3 MB that PagerDuty refuses with 400, never retried: no page.
    big = "HTTPError: 500: <html>" + "x" * 120_000 + "</html>"
    r = RunScript()
    r.do(0, "issue_credit", "compensable", comp=CREDIT)
    r.do(1, "notify_billing", "compensable", ok=False, error=big)
    stack = [{"step": "issue_credit", "index": 0, "tool": CREDIT[0], "args": CREDIT[1]}]
    r.unwind(big, "notify_billing", stack)
    r.compensate(0, "issue_credit", CREDIT[0], CREDIT[1], ok=False, error=big)
    r.end(sc.STATUS_COMPENSATION_FAILED, "notify_billing")
    events = fired(r)
    assert {e.alertname for e in events} >= {sc.ALERT_COMPENSATION_FAILED}
    sink = PagerDutySink("R" * 32, url=f"http://127.0.0.1:{pagerduty.port}/v2/enqueue")
    try:
        for event in events:
            await sink.send(event)  # raised DeliveryRejected: 400, Payload too large
    finally:
        await sink.close()
    for event, body in zip(events, pagerduty.bodies, strict=True):
        assert len(json.dumps(body)) <= PAGERDUTY_BODY_MAX
        run_url = event.annotations["run_url"]
        # What PagerDuty routes, dedups and shows first is as it was.
        assert body["routing_key"] == "R" * 32 and body["event_action"] == "trigger"
        assert body["dedup_key"] == pagerduty_dedup_key(event.dedup_key)
        assert body["payload"]["summary"] == event.annotations["description"][:1024]
        assert body["payload"]["severity"] == event.severity
        assert [link["href"] for link in body["links"]] == [
            run_url,
            event.annotations["runbook_url"],
        ]
        details = body["payload"]["custom_details"]
        assert details["run_url"] == run_url and details["stack"] == event.details["stack"]
        # The card and the stack once, structured: not again as JSON text.
        assert set(details["annotations"]) == set(event.annotations) - {
            "escalation_card",
            "stack",
            "run_url",
            "runbook_url",
        }
        cut = [t for t in texts(details) if len(t) > TEXT_MAX]
        assert cut and all(t.endswith(f"more characters; see {run_url}]") for t in cut)
        assert all(len(t) < TEXT_MAX + 200 + len(run_url) for t in cut)
        assert details["unwind_reason"].startswith(big[:TEXT_MAX])


def long_run_view(steps: int) -> dict[str, Any]:
    """Unwinding after ``steps`` compensable steps, each owing an undo of ~480 bytes."""
    stack = [
        {
            "step": f"step_{i}",
            "index": i,
            "tool": "undo_step",
            "args": {"order_id": f"ord_{i:06d}", "note": "n" * 350},
            "description": f"undo step {i}",
        }
        for i in reversed(range(steps))
    ]
    return {**VIEW, "stack": stack}


async def test_a_long_runs_stack_still_pages_through_pagerduty(
    pagerduty: PagerDutyFake,
) -> None:
    # 1,500 steps owing an undo: the stack alone is 700 KB. The page goes out with the
    # stack left out (a note says where it is); the rest of the details stay.
    (event,) = evaluate(None, long_run_view(1500), now=10.5)
    sink = PagerDutySink("rk", url=f"http://127.0.0.1:{pagerduty.port}/v2/enqueue")
    try:
        await sink.send(event)
    finally:
        await sink.close()
    (body,) = pagerduty.bodies
    assert len(json.dumps(body)) <= PAGERDUTY_BODY_MAX
    details = body["payload"]["custom_details"]
    run_url = event.annotations["run_url"]
    assert details["stack"].startswith("[left out: ") and run_url in details["stack"]
    assert details["run_url"] == run_url and details["unwind_reason"] == VIEW["unwind_reason"]
    assert details["annotations"]["description"] == event.annotations["description"]
    assert body["payload"]["summary"] == event.annotations["description"]


def test_a_card_of_many_short_fields_still_fits_both_bounds() -> None:
    # No single field is larger than the note that would replace it: the card goes
    # whole (a note naming the run page), the URLs and the summary stay.
    card = {f"note_{i:06d}": "see ticket" for i in range(60_000)}
    view = {
        **VIEW,
        "status": "compensation_failed",
        "escalation": {"reason": "compensation_failed", "card": card},
    }
    events = evaluate(VIEW, view, now=10.5)
    assert events
    pagerduty, webhook = PagerDutySink("rk"), WebhookSink("http://127.0.0.1:9/hook")
    for event in events:
        run_url = event.annotations["run_url"]
        assert len(json.dumps(event_document(event, Redactor()))) > WEBHOOK_BODY_MAX
        body = pagerduty.payload(event)
        assert len(json.dumps(body)) <= PAGERDUTY_BODY_MAX
        details = body["payload"]["custom_details"]
        assert details["run_url"] == run_url and run_url in json.dumps(details)
        assert body["payload"]["summary"] == event.annotations["description"][:1024]
        doc = webhook.payload(event)
        assert len(json.dumps(doc)) <= WEBHOOK_BODY_MAX
        assert doc["annotations"]["run_url"] == run_url


def test_a_body_fits_when_only_whole_parts_can_go() -> None:
    # Many short top-level fields of a part: neither a field nor a nested dict is worth a
    # note, so the part goes whole, keeping its URLs.
    part = {f"k{i:06d}": "v" for i in range(60_000)} | {"run_url": "http://x/runs/r"}
    body = fit_body({"summary": "s", "details": part}, [part], 10_000, "http://x/runs/r", "big")
    assert len(json.dumps(body)) <= 10_000
    assert body["summary"] == "s" and part["run_url"] == "http://x/runs/r"
    assert part["left_out"].startswith("[left out: ") and "http://x/runs/r" in part["left_out"]


def test_a_webhook_body_is_as_it_was_unless_past_its_bound() -> None:
    small = evaluate(None, long_run_view(3), now=10.5)[0]
    sink = WebhookSink("http://127.0.0.1:9/hook")
    assert sink.payload(small) == event_document(small, Redactor())
    # Past 1 MB, which receivers commonly refuse with 413 (a refusal: never retried).
    (big,) = evaluate(None, long_run_view(3000), now=10.5)
    assert len(json.dumps(event_document(big, Redactor()))) > 2 * WEBHOOK_BODY_MAX
    doc = sink.payload(big)
    assert len(json.dumps(doc)) <= WEBHOOK_BODY_MAX
    run_url = big.annotations["run_url"]
    assert doc["details"]["stack"].startswith("[left out: ") and run_url in doc["details"]["stack"]
    assert doc["annotations"]["run_url"] == doc["details"]["run_url"] == run_url
    assert {k: doc[k] for k in ("dedup_key", "labels", "status", "run_id")} == {
        "dedup_key": big.dedup_key,
        "labels": dict(big.labels),
        "status": "firing",
        "run_id": big.run_id,
    }
