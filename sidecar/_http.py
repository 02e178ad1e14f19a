"""OTLP/HTTP intake and the JSON API (aiohttp)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import math
import re
import time
import zlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, Histogram

from saga_otel import semconv as sc

from . import _jsontext as jsontext
from ._errors import DecodeError, StoreError
from ._hosts import HostRule
from ._leases import Lease, LeaseAction, lease_view, when
from ._log import get_logger
from ._otlp import (
    OTHER_SIGNALS,
    extract,
    other_signal,
    parse_json,
    parse_protobuf,
    response,
    rpc_status,
)
from ._pages import BY_MAX, browser_auth, misdirected, page_routes, run_page, wants_html
from ._ready import ReadyView, is_ready, readiness
from ._service import BODY, SERVICE, Service
from ._settings import BODY_RATE_GRACE, Settings
from ._state import ALL_STATES
from ._storage import RunQuery
from ._views import ResolutionView, RunView

log = get_logger("sidecar")

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
API_MAX_BODY = 64 * 1024
MAX_LIMIT = 1000
RETRY_AFTER = "1"
_RPC_INVALID_ARGUMENT = 3
_RPC_UNAVAILABLE = 14
_RPC_RESOURCE_EXHAUSTED = 8
_RPC_UNAUTHENTICATED = 16

_Doc = TypeVar("_Doc")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


class LoopLag:
    """How long the event loop was kept from running a callback on time, summed (pure:
    the driver passes the loop's times).

    A tick armed for ``due`` (``armed``) that ran at ``woke`` (``ran``) found the loop
    busy elsewhere for the difference: a commit waiting on a lock, a large batch decoded
    in one callback. ``stalled(now)`` adds a tick due and not run yet: the loop is
    behind still.
    """

    __slots__ = ("_due", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self._due: float | None = None

    def armed(self, due: float) -> None:
        self._due = due

    def ran(self, woke: float) -> None:
        if self._due is not None:
            self.total += max(0.0, woke - self._due)
        self._due = None

    def stalled(self, now: float) -> float:
        behind = 0.0 if self._due is None else max(0.0, now - self._due)
        return self.total + behind


# A stall shorter than this may go unmeasured (it began just after a tick).
LAG_TICK = 0.1


class _LagWatch:
    """Drives a ``LoopLag`` with a tick every ``LAG_TICK`` seconds, only while a body
    waits for bytes (``hold``/``release``): an idle sidecar keeps no timer for it."""

    __slots__ = ("_handle", "_holders", "lag")

    def __init__(self) -> None:
        self.lag = LoopLag()
        self._holders = 0
        self._handle: asyncio.TimerHandle | None = None

    def hold(self) -> float:
        """Start measuring (if no one is); the stall so far, to subtract later."""
        self._holders += 1
        if self._handle is None:
            self._arm()
        return self.stalled()

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0 and self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self.lag.ran(asyncio.get_running_loop().time())

    def stalled(self) -> float:
        return self.lag.stalled(asyncio.get_running_loop().time())

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + LAG_TICK
        self.lag.armed(due)
        self._handle = loop.call_at(due, self._tick)

    def _tick(self) -> None:
        self.lag.ran(asyncio.get_running_loop().time())
        self._handle = None
        if self._holders:
            self._arm()


def body_time_left(
    elapsed: float, stalled: float, size: int, body_timeout: float, min_rate: int
) -> float:
    """Seconds a body ``elapsed`` seconds into its arrival, ``size`` bytes of it in, may
    still take (<= 0: too slow): whole within ``body_timeout``, and after the grace at
    ``min_rate`` on average. ``stalled``: seconds the sidecar's own loop was kept from
    reading it meanwhile, not counted against the client (its bytes wait in the
    kernel, its sends blocked), up to another ``body_timeout``: a body never holds its
    place past twice that, however late the loop runs."""
    allowed = min(body_timeout, BODY_RATE_GRACE + size / min_rate)
    return allowed - elapsed + min(stalled, body_timeout)


class _Receiving:
    """Bodies being received at once, and their bytes: bounds what slow clients can hold.

    Receiving holds no in-flight slot (a stalled body must not block intake); it is
    bounded by count (``--max-receiving``) and by bytes (``max_in_flight`` full bodies,
    the memory bound intake had before), whichever comes first.
    """

    def __init__(self, count: int, budget: int) -> None:
        self.count = count
        self.budget = budget
        self.active = 0
        self.bytes = 0
        self.lag = _LagWatch()

    def take(self, size: int) -> bool:
        if self.bytes + size > self.budget:
            return False
        self.bytes += size
        return True


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _token_guard(sidecar: Service) -> Callable[[web.BaseRequest], web.Response | None]:
    """The bearer-token check of every HTTP route: None to go on, else the 401 to answer."""
    token = sidecar.settings.token
    expected = f"Bearer {token}".encode() if token else b""

    def refuse(request: web.BaseRequest) -> web.Response | None:
        if not token:
            return None
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return None
        return error(
            401,
            "missing or wrong bearer token: send 'Authorization: Bearer <token>' with "
            "the sidecar's --token (SAGA_SIDECAR_TOKEN)",
            {"WWW-Authenticate": "Bearer"},
        )

    return refuse


def _route_error(status: int, reason: str, request: web.BaseRequest) -> web.Response:
    """No route for the request (404), or not for its method (405): our JSON error body."""
    return error(status, f"{reason}: {request.method} {request.path}")


def _as_json_error(exc: web.HTTPException, request: web.BaseRequest) -> web.StreamResponse:
    """An aiohttp error (no route, wrong method) as our JSON error body; others re-raised."""
    if exc.status >= 400 and exc.content_type != JSON:
        return _route_error(exc.status, exc.reason, request)
    raise exc


class _Durations:
    """``saga_sidecar_request_duration_seconds`` by route, its children looked up once
    (labels() per request is measurable on the durable path)."""

    __slots__ = ("_children", "_metric", "_transport")

    def __init__(self, sidecar: Service, transport: str) -> None:
        self._metric = sidecar.metrics.request_duration
        self._transport = transport
        self._children: dict[str, Histogram] = {}

    def observe(self, route: str, seconds: float) -> None:
        child = self._children.get(route)
        if child is None:
            child = self._children[route] = self._metric.labels(
                transport=self._transport, route=route
            )
        child.observe(seconds)


def _auth_middleware(sidecar: Service, transport: str) -> Middleware:
    refuse = _token_guard(sidecar)
    durations = _Durations(sidecar, transport)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        refused = refuse(request)
        if refused is not None:
            return refused
        try:
            resp = await handler(request)
        except web.HTTPException as exc:
            resp = _as_json_error(exc, request)
        route = request.match_info.route.resource
        durations.observe(
            route.canonical if route is not None else "other", time.perf_counter() - started
        )
        return resp

    return middleware


# --- OTLP/HTTP ------------------------------------------------------------------------


def _status_body(as_json: bool, code: int, message: str) -> tuple[bytes, str]:
    """An OTLP error body: google.rpc.Status in the request's encoding."""
    if as_json:
        return json.dumps({"code": code, "message": message}).encode(), JSON
    return rpc_status(code, message), PROTOBUF


def _otlp_error(
    status: int, as_json: bool, code: int, message: str, retry: bool = False
) -> web.Response:
    body, ctype = _status_body(as_json, code, message)
    headers = {"Retry-After": RETRY_AFTER} if retry else None
    return web.Response(status=status, body=body, content_type=ctype, headers=headers)


async def _read_bounded(
    request: web.BaseRequest, limit: int, body_timeout: float, min_rate: int, receiving: _Receiving
) -> tuple[bytes, int]:
    """The body within ``body_timeout`` and, after the grace, at ``min_rate``; (body, bytes taken).

    The caller gives the taken bytes back to ``receiving`` once it is done with the body.
    aiohttp has no body deadline of its own: this is the one timer intake keeps. The
    client is judged on what it sent, not on when the loop came to it: bytes already
    in the buffer are taken before the deadline is looked at, and time the loop was
    stalled meanwhile is not counted (``body_time_left``): a body sent whole while an
    inline commit waited on a lock is no slow client.
    """
    if request.content_length is not None and request.content_length > limit:
        raise _TooLarge
    loop = asyncio.get_running_loop()
    start = loop.time()
    lag = receiving.lag
    stalled_before: float | None = None  # the loop's stall when this body began to wait
    chunks: list[bytes] = []
    size = 0
    content = request.content
    chunk = b""
    try:
        while True:
            # What has arrived already needs no timer (a small body comes with its
            # headers): the deadline is looked at only to wait for more.
            chunk = chunk or content.read_nowait()
            if chunk:
                if size + len(chunk) > limit:
                    raise _TooLarge
                if not receiving.take(len(chunk)):
                    raise _Busy
                size += len(chunk)
                chunks.append(chunk)
                chunk = b""
                continue
            if content.at_eof():
                return b"".join(chunks), size
            if stalled_before is None:
                stalled_before = lag.hold()
            left = body_time_left(
                loop.time() - start, lag.stalled() - stalled_before, size, body_timeout, min_rate
            )
            if left <= 0:
                raise _TooSlow
            try:
                async with asyncio.timeout(left):
                    chunk = await content.readany()
            except TimeoutError:
                pass  # judged again once what the buffer holds is taken
    except BaseException:
        receiving.bytes -= size
        raise
    finally:
        if stalled_before is not None:
            lag.release()


class _Busy(Exception):
    pass


def _too_slow(settings: Settings) -> str:
    """Why a body was cut (OTLP port: 503; API port: 408), on either HTTP port."""
    return (
        f"the request body did not arrive within --body-timeout {settings.body_timeout:g} s "
        f"or at --body-min-rate {settings.body_min_rate} bytes/s: send it at once"
    )


# Compressed input is fed in slices: when a gzip member ends, zlib copies what is left of
# its input (unused_data), so a whole body fed at once made a body of many small members
# cost its size squared in copying.
_INFLATE_SLICE = 16 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_NUL_PADDING = re.compile(b"\x00*")


def inflate(body: bytes, limit: int) -> bytes:
    """Gunzip (or inflate) at most ``limit`` bytes: the decompressed size is bounded too.

    A gzip body may be several members one after another (RFC 1952: ``cat a.gz b.gz``,
    writers that flush a member at a time); each is inflated, under the one bound, as
    gzip(1) and Python's gzip.decompress do (NUL padding after a member is skipped, as
    they skip it). Any other bytes after the compressed data are a DecodeError: taking
    the first member only answered 200 for spans never stored.
    """
    view = memoryview(body)
    parts: list[bytes] = []
    size = pos = 0
    inflater = zlib.decompressobj(wbits=47)  # 32 + 15: gzip or zlib header, detected
    pending: bytes | memoryview = b""
    while True:
        if not pending:
            pending = view[pos : pos + _INFLATE_SLICE]
            pos += len(pending)
            if not pending:
                raise DecodeError("gzip body is truncated: send the whole compressed request")
        try:
            part = inflater.decompress(pending, limit + 1 - size)
        except zlib.error as exc:
            raise DecodeError(f"body is not valid gzip/deflate data ({exc})") from exc
        size += len(part)
        if size > limit:
            raise _TooLarge
        parts.append(part)
        if not inflater.eof:
            pending = inflater.unconsumed_tail  # empty: the slice was all taken
            continue
        end = pos - len(inflater.unused_data)  # where this member's data ended
        padding = _NUL_PADDING.match(body, end)
        after = padding.end() if padding else end
        if after == len(body):
            return b"".join(parts)
        if not (body.startswith(_GZIP_MAGIC) and body.startswith(_GZIP_MAGIC, after)):
            raise DecodeError(
                f"{len(body) - end} bytes follow the end of the compressed data and are not "
                f"another gzip member (they start {bytes(view[after : after + 8]).hex()}): "
                "send the compressed request alone"
            )
        inflater, pending, pos = zlib.decompressobj(wbits=47), b"", after


def _too_large(as_json: bool, limit: int) -> web.Response:
    resp = _otlp_error(
        413,
        as_json,
        _RPC_RESOURCE_EXHAUSTED,
        f"request is over the {limit}-byte bound (compressed or not): send smaller "
        "batches (exporter max batch size) or raise --max-body",
    )
    resp.force_close()
    return resp


async def _expect(request: web.BaseRequest) -> web.Response | None:
    """``Expect: 100-continue`` as aiohttp's router answers it (curl sends it for larger
    bodies): the interim response, or 417 for an expectation it cannot meet."""
    expect = request.headers.get("Expect", "")
    if request.version != aiohttp.HttpVersion11:
        return None
    if expect.lower() != "100-continue":
        return error(417, f"Expect: {expect!r} is not supported: send 100-continue or none")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim answer is not the response's body
    return None


OtlpHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def build_otlp_handler(service: Service) -> OtlpHandler:
    """The OTLP/HTTP port's request handler, for aiohttp's low-level ``web.Server``.

    Two fixed POST routes need no router, no application and no middleware chain
    (those were ~8% of a single-span request's CPU); the rules are the API app's:
    the token check first, aiohttp's answer to ``Expect``, our JSON body for an
    unknown path (404) or method (405), the request duration by route.
    """
    refuse = _token_guard(service)
    misnamed = HostRule.of(service.settings, service.public_url).refusal
    durations = _Durations(service, "http")
    receiving = _Receiving(
        service.settings.max_receiving, service.settings.max_in_flight * service.settings.max_body
    )

    async def traces(request: web.BaseRequest) -> web.Response:
        sidecar = service
        settings = sidecar.settings
        limit = settings.max_body
        ctype = request.content_type
        as_json = ctype == JSON
        if ctype not in (PROTOBUF, JSON):
            return error(
                415,
                f"Content-Type {ctype!r} is not OTLP: send application/x-protobuf or "
                "application/json",
            )
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", "", "gzip", "deflate"):
            return error(415, f"Content-Encoding {encoding!r} is not supported: use gzip or none")
        if receiving.active >= receiving.count:
            return _otlp_error(
                429,
                as_json,
                _RPC_UNAVAILABLE,
                f"sidecar is receiving {receiving.count} request bodies at once (its "
                "--max-receiving): retry after the Retry-After delay",
                retry=True,
            )
        receiving.active += 1
        taken = 0
        try:
            try:
                body, taken = await _read_bounded(
                    request, limit, settings.body_timeout, settings.body_min_rate, receiving
                )
            except _TooSlow:
                # 503, not 408: OTLP exporters retry 429, 502, 503 and 504 only (the
                # spec: no other 4xx or 5xx is retried), and a slow body's spans are not
                # bad ones; an exporter dropped them on 408.
                resp = _otlp_error(503, as_json, _RPC_UNAVAILABLE, _too_slow(settings), retry=True)
                resp.force_close()  # the rest of a stalled body is not worth waiting for
                return resp
            except _Busy:
                return _otlp_error(
                    429,
                    as_json,
                    _RPC_UNAVAILABLE,
                    "the sidecar holds as many request bytes as it accepts at once: retry "
                    "after the Retry-After delay",
                    retry=True,
                )
            except _TooLarge:
                return _too_large(as_json, limit)
            except ConnectionError:
                # The sender went away mid-body (a killed agent's socket is reset): a
                # peer's fault, not ours. Nothing was stored; its exporter resends.
                log.debug("sidecar.intake.client_gone", transport="http")
                resp = error(400, "the connection closed before the request body ended")
                resp.force_close()
                return resp  # aiohttp drops it: there is no one left to answer
            return await _decode_and_ingest(sidecar, body, encoding, ctype, as_json)
        finally:
            receiving.active -= 1
            receiving.bytes -= taken

    async def presence_of(request: web.BaseRequest) -> web.StreamResponse:
        return await presence(service, request)

    routes: dict[str, OtlpHandler] = {"/v1/traces": traces, PRESENCE_PATH: presence_of}

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        started = time.perf_counter()
        if "Expect" in request.headers:  # before anything else, as aiohttp's router does
            refused = await _expect(request)
            if refused is not None:
                return refused
        why = misnamed(request.headers.get("Host"))  # DNS rebinding: sidecar/_hosts.py
        if why is not None:
            return error(421, why)
        refused = refuse(request)
        if refused is not None:
            return refused
        route = request.path
        handler = routes.get(route)
        resp: web.StreamResponse
        if handler is None:
            signal = OTHER_SIGNALS.get(route)
            why = None if signal is None else other_signal(signal, route)
            route = "other"
            resp = _route_error(404, "Not Found", request) if why is None else error(404, why)
        elif request.method != "POST":
            route, resp = "other", _route_error(405, "Method Not Allowed", request)
            resp.headers["Allow"] = "POST"  # RFC 9110: a 405 names the methods the route takes
        else:
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                resp = _as_json_error(exc, request)
        durations.observe(route, time.perf_counter() - started)
        return resp

    return handle


PRESENCE_PATH = "/v1/saga/presence"
_PRESENCE_HELLO_MAX = 4096


async def presence(sidecar: Service, request: web.BaseRequest) -> web.StreamResponse:
    """One agent process's live connection (saga_otel holds it open while it runs).

    The body is a never-ending stream of lines: first ``{"instance": id}``, then one
    line per heartbeat, and ``bye`` before a clean close. When the connection ends
    without ``bye`` the kernel has closed it for a process that died: the sidecar
    marks the instance's connection lost, and the orphan rule confirms (no reconnect,
    no heartbeat) before paging. See docs/semantic-conventions.md ("Presence").
    """
    try:
        async with asyncio.timeout(sidecar.settings.body_timeout):
            hello = await request.content.readuntil(b"\n")
    except (TimeoutError, ValueError, aiohttp.ClientError, ConnectionError):
        return error(400, 'send {"instance": "<service.instance.id>"} and a newline first')
    try:
        data = jsontext.loads(hello[:_PRESENCE_HELLO_MAX])
        instance = data["instance"] if isinstance(data, dict) else None
    except (ValueError, KeyError, jsontext.TooDeep):
        instance = None
    if not isinstance(instance, str) or not instance or len(instance) > 1024:
        return error(400, 'the first line must be {"instance": "<service.instance.id>"}')
    if not sidecar.presence_opened(instance):
        return error(429, "the sidecar holds as many presence connections as it accepts")
    clean = False
    try:
        while True:
            chunk = await request.content.readany()
            if not chunk:
                break
            if b"bye" in chunk:
                clean = True
    except (aiohttp.ClientError, ConnectionError):
        pass  # the connection broke: not a goodbye
    finally:
        sidecar.presence_closed(instance, clean)
    return web.Response(status=204)


async def _decode_and_ingest(
    sidecar: Service, body: bytes, encoding: str, ctype: str, as_json: bool
) -> web.Response:
    """Decode and store a received body, holding an in-flight slot meanwhile."""
    limit = sidecar.settings.max_body
    if not sidecar.enter():
        return _otlp_error(
            429,
            as_json,
            _RPC_UNAVAILABLE,
            f"sidecar is at its bound of {sidecar.settings.max_in_flight} requests in "
            "flight: retry after the Retry-After delay",
            retry=True,
        )
    try:
        try:
            if encoding in ("gzip", "deflate"):
                body = inflate(body, limit)
            decoded = extract(parse_json(body)) if as_json else extract(parse_protobuf(body), body)
        except _TooLarge:
            return _too_large(as_json, limit)
        except DecodeError as exc:
            return _otlp_error(400, as_json, _RPC_INVALID_ARGUMENT, str(exc))
        try:
            decoded = await sidecar.ingest(decoded, "http", body, ctype)
        except StoreError as exc:
            return _otlp_error(503, as_json, _RPC_UNAVAILABLE, str(exc), retry=True)
        out, out_type = response(decoded.rejected, decoded.error_message, as_json)
        return web.Response(body=out, content_type=out_type)
    finally:
        sidecar.leave()


# --- API ---------------------------------------------------------------------------


# The query parameters of each JSON route (docs/sidecar.md, API). Any other, or one
# given twice, is a 400 naming it: an ignored typo (``stauts=stuck``) answered every
# run. ``_``, the cache-buster jQuery and others add, is taken and ignored everywhere.
# Not here, so not checked: the pages (a link a person follows may carry a chat tool's
# ``utm_...``; no parameter changes a page) and routes added by ``add_api_routes``.
RUNS_QUERY = ("status", "saga", "since", "until", "needs", "id_prefix", "limit", "cursor")
_QUERY: dict[tuple[str, str], tuple[str, ...]] = {
    ("GET", "/runs"): (*RUNS_QUERY, "reveal"),
    ("GET", "/runs/{run_id}"): ("reveal",),
    ("GET", "/runs/{run_id}/stack"): ("reveal",),
    ("POST", "/runs/{run_id}/resolve"): (),
    ("POST", "/runs/{run_id}/lease"): (),
    ("POST", "/runs/{run_id}/lease/renew"): (),
    ("POST", "/runs/{run_id}/lease/release"): (),
    ("GET", "/healthz"): (),
    ("GET", "/readyz"): (),
    ("GET", "/metrics"): (),
}
CACHE_BUSTER = "_"


def query_problem(request: web.Request) -> str | None:
    """What is wrong with ``request``'s query string for its route, or None."""
    resource = request.match_info.route.resource
    method = "GET" if request.method == "HEAD" else request.method
    known = _QUERY.get((method, resource.canonical)) if resource is not None else None
    if known is None or (
        resource is not None
        and resource.canonical == "/runs/{run_id}"
        and wants_html(request.headers.get("Accept", ""))  # the run page
    ):
        return None
    assert resource is not None
    where = f"{method} {resource.canonical.replace('{run_id}', '{id}')}"
    query = request.query
    for key in dict.fromkeys(query.keys()):
        if key == CACHE_BUSTER:
            continue
        if key not in known and not known:
            return (
                f"{where} takes no query parameters, not {key!r:.60} (docs/sidecar.md, API): "
                "leave it out"
            )
        if key not in known:
            return (
                f"{where} has no query parameter {key!r:.60}: it takes {', '.join(known)} "
                "(docs/sidecar.md, API); check the spelling"
            )
        values = query.getall(key)
        if len(values) > 1:
            return (
                f"{key!r:.60} is given {len(values)} times ({', '.join(map(repr, values))[:120]}):"
                " give it once; no parameter of this API takes more than one value"
            )
        if key == "reveal" and values[0] != "args":
            return (
                f"reveal={values[0]!r:.60} is not supported: use reveal=args for the real "
                "arguments (what recovery runs), or leave it out for them masked"
            )
    return None


def _query_middleware() -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        problem = query_problem(request)
        return error(400, problem) if problem is not None else await handler(request)

    return middleware


def parse_time(text: str, what: str) -> float:
    """Epoch seconds from ``1712345678.5`` or ISO 8601 (naive means UTC)."""
    forms = "use epoch seconds or ISO 8601, e.g. 1712345678 or 2024-04-05T12:00:00Z"
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        # float() takes nan and inf (and 1e400 as inf): nan matched every run.
        if not math.isfinite(seconds):
            raise DecodeError(f"{what}={text!r:.60} is not a finite time: {forms}")
        return seconds
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise DecodeError(
            f"{what}={text!r:.60} is neither epoch seconds nor ISO 8601: {forms}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def encode_cursor(started_at: float | None, run_id: str) -> str:
    raw = json.dumps([started_at, run_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[float, str]:
    """The (started_at, run_id) ``encode_cursor`` put in ``text``; DecodeError for any
    other text, so a made-up cursor is a 400, not a page that reads as "no runs"."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        value = jsontext.loads(raw)
    except (ValueError, binascii.Error) as exc:
        raise _bad_cursor(text, "it is not base64url of JSON") from exc
    # Exactly what encode_cursor writes: [epoch seconds or null, the run id].
    if not isinstance(value, list) or len(value) != 2:
        raise _bad_cursor(text, f"it holds {value!r:.60}, not a [started_at, run_id] pair")
    started_at, run_id = value
    moment = float("-inf")  # a run with no start sorts last
    if started_at is not None:
        try:
            # float() first: an int past a float's range is an OverflowError, not a time.
            if isinstance(started_at, bool) or not isinstance(started_at, int | float):
                raise TypeError
            moment = float(started_at)
            if not math.isfinite(moment):
                raise OverflowError
        except (TypeError, OverflowError):
            raise _bad_cursor(
                text, f"its started_at {started_at!r:.40} is not epoch seconds"
            ) from None
    problem = sc.run_id_problem(run_id)
    if problem is not None:
        raise _bad_cursor(text, problem)
    return moment, run_id


def _bad_cursor(text: str, why: str) -> DecodeError:
    return DecodeError(
        f"cursor {text[:40]!r} is not one this API gave out ({why}): pass next_cursor "
        "from the previous page unchanged, or leave cursor out for the first page"
    )


def _resolved_by(data: dict[str, object]) -> str | None:
    """The ``by`` of a resolve body: the name the person gave, trimmed; None when left
    out, null or blank (the sidecar makes no name up). DecodeError for anything else.
    Stored as sent, like the note: control characters are escaped where it is shown."""
    by = data.get("by")
    if by is None:
        return None
    if not isinstance(by, str):
        raise DecodeError(
            f'by={by!r:.40} is not a string: send {{"note": "...", "by": "your name"}}, '
            "or leave by out"
        )
    by = by.strip()
    if len(by) > BY_MAX:
        raise DecodeError(
            f"by is {len(by)} characters, past the {BY_MAX} a name may have: send your name "
            "or handle as by, and what you did as the note"
        )
    return by or None


def _resolved_already(run_id: str, standing: ResolutionView) -> str:
    by = standing.get("by")
    return (
        f"run {run_id!r} is already resolved, at {when(standing['at'])}"
        + (f", by {by!r:.100}" if by else "")
        + f", with the note {standing['note']!r:.300}; your note was not saved. Read the run (GET "
        '/runs/{id}); if yours should stand instead, send it again with "replace": true '
        "(saga-sidecar runs resolve RUN --note '...' --replace)"
    )


def _shown(request: web.Request, doc: _Doc, *views: RunView | None) -> _Doc:
    """``doc`` masked by the service's redactor with its own secrets and those of ``views``.

    ``?reveal=args`` gives the real arguments, for recovery (behind the token like all
    else): ``saga_otel.recover`` asks for them.
    """
    redactor = request.app[SERVICE].redactor
    if not redactor.active or request.query.get("reveal") == "args":  # see query_problem
        return doc
    masked: _Doc = redactor.redact(doc, redactor.secrets_in(*(v for v in views if v)))
    return masked


_NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})


def _api_bodies(service: Service) -> Middleware:
    """Inner API middleware: every body a route takes is read here, before its handler,
    by the OTLP port's bounded reader (``_read_bounded``: --body-timeout and
    --body-min-rate, at most --max-receiving bodies arriving at once on this port, each
    at most API_MAX_BODY), and left at ``request[BODY]``. After the token check: an
    unauthenticated body is never read."""
    settings = service.settings
    receiving = _Receiving(settings.max_receiving, settings.max_receiving * API_MAX_BODY)

    def busy() -> web.Response:
        return error(
            429,
            f"the API is receiving {receiving.count} request bodies at once (its "
            "--max-receiving): retry after the Retry-After delay",
            {"Retry-After": RETRY_AFTER},
        )

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            request.method in _NO_BODY
            or not request.body_exists
            or request.match_info.http_exception is not None  # 404/405: left unread
        ):
            return await handler(request)
        if receiving.active >= receiving.count:
            return busy()
        receiving.active += 1
        try:
            body, taken = await _read_bounded(
                request, API_MAX_BODY, settings.body_timeout, settings.body_min_rate, receiving
            )
            receiving.bytes -= taken  # parsed at once by the handler: nothing held after
        except _TooSlow:
            resp = error(408, _too_slow(settings))
            resp.force_close()  # the rest of a stalled body is not worth waiting for
            return resp
        except _Busy:  # bytes past --max-receiving full bodies: not before the count
            return busy()
        except _TooLarge:
            return error(
                413,
                f"the request body is too long: over the API's {API_MAX_BODY} bytes; "
                "shorten the note or reason",
            )
        except ConnectionError:
            resp = error(400, "the connection closed before the request body ended")
            resp.force_close()
            return resp
        finally:
            receiving.active -= 1
        request[BODY] = body
        return await handler(request)

    return middleware


def build_api_app(service: Service) -> web.Application:
    app = web.Application(
        # misdirected, browser_auth (outer): the Host check, HTML for people (_pages.py);
        # _api_bodies (inner): bodies are read after the token and query checks, before
        # any handler.
        middlewares=[
            misdirected(service),
            browser_auth(service),
            _auth_middleware(service, "api"),
            _query_middleware(),
            _api_bodies(service),
        ],
        client_max_size=API_MAX_BODY,
    )
    app[SERVICE] = service

    def unknown(run_id: str) -> web.Response:
        return error(
            404,
            f"no run {run_id!r} is known here: list runs with GET /runs (or saga-sidecar "
            "runs list); finished runs are pruned after the retention period",
        )

    async def list_runs(request: web.Request) -> web.Response:
        sidecar = request.app[SERVICE]
        q = request.query
        try:
            status = q.get("status")
            if status is not None and status not in ALL_STATES:
                raise DecodeError(
                    f"status={status!r} is not a run state: use one of {', '.join(ALL_STATES)}"
                )
            needs = q.get("needs")
            if needs is not None and needs != "person":
                raise DecodeError(f"needs={needs!r} is not supported: use needs=person")
            limit_text = q.get("limit", "100")
            # isdigit() alone admits "³", which int() then refuses.
            if not (limit_text.isascii() and limit_text.isdigit()) or not (
                1 <= int(limit_text) <= MAX_LIMIT
            ):
                raise DecodeError(f"limit={limit_text!r} must be an integer 1..{MAX_LIMIT}")
            limit = int(limit_text)
            since = parse_time(q["since"], "since") if "since" in q else None
            until = parse_time(q["until"], "until") if "until" in q else None
            cursor = decode_cursor(q["cursor"]) if "cursor" in q else None
        except DecodeError as exc:
            return error(400, str(exc))
        query = RunQuery(
            status=status,
            saga=q.get("saga"),
            since=since,
            until=until,
            id_prefix=q.get("id_prefix") or None,
            before=cursor,
        )
        try:
            found, more = await sidecar.runs_page(query, limit, needs_person=needs == "person")
        except StoreError as exc:
            return error(503, str(exc), {"Retry-After": RETRY_AFTER})
        page = [r for r, _ in found]
        next_cursor = encode_cursor(page[-1]["started_at"], page[-1]["run_id"]) if more else None
        # A summary quotes texts (errors) that may hold arguments: mask them with the
        # secrets of the run's whole view.
        shown = [_shown(request, r, view) for r, view in found]
        return web.json_response({"runs": shown, "next_cursor": next_cursor})

    async def get_run(request: web.Request) -> web.Response:
        if wants_html(request.headers.get("Accept", "")):
            return await run_page(request)  # a browser following an alert's run_url
        sidecar = request.app[SERVICE]
        run_id = request.match_info["run_id"]
        try:
            view = (await sidecar.lookup(run_id)).view(run_id)
        except StoreError as exc:
            return error(503, str(exc), {"Retry-After": RETRY_AFTER})
        return unknown(run_id) if view is None else web.json_response(_shown(request, view))

    async def get_stack(request: web.Request) -> web.Response:
        sidecar = request.app[SERVICE]
        run_id = request.match_info["run_id"]
        try:
            state = await sidecar.lookup(run_id)
        except StoreError as exc:
            return error(503, str(exc), {"Retry-After": RETRY_AFTER})
        stack = state.stack(run_id)
        if stack is None:
            return unknown(run_id)
        body = {"run_id": run_id, "status": state.status(run_id), "stack": stack}
        return web.json_response(_shown(request, body, state.view(run_id)))

    async def resolve(request: web.Request) -> web.Response:
        sidecar = request.app[SERVICE]
        run_id = request.match_info["run_id"]
        try:
            data = jsontext.loads(request.get(BODY, b""))
        except ValueError as exc:  # too deep, not JSON, not UTF-8
            return error(
                400, f'the body is not JSON the sidecar reads ({exc}): send {{"note": "..."}}'
            )
        note = data.get("note") if isinstance(data, dict) else None
        if not isinstance(note, str) or not note.strip():
            return error(400, 'resolve needs {"note": "..."}: say what a person did or decided')
        replace = data.get("replace", False)
        if not isinstance(replace, bool):
            return error(
                400,
                f"replace={replace!r:.40} is not true or false: send "
                '{"note": "...", "replace": true} only to put your note in place of another',
            )
        try:
            by = _resolved_by(data)
        except DecodeError as exc:
            return error(400, str(exc))
        try:
            # The page's rule (sidecar/_pages.py): a run resolved already keeps its note.
            # A resolution is its note: the same note with another (or no) by is the same
            # resolution, kept as it stands with its by; a replacement brings its own by.
            view = await sidecar.resolve(run_id, note, first=True, by=by)
            standing = view["resolution"] if view is not None else None
            if replace and standing is not None and standing["note"] != note:
                view = await sidecar.resolve(run_id, note, by=by)
        except StoreError as exc:
            return error(503, str(exc), {"Retry-After": RETRY_AFTER})
        if view is None:
            return unknown(run_id)
        standing = view["resolution"]
        if standing is not None and standing["note"] != note:
            refusal = {"error": _resolved_already(run_id, standing), "resolution": standing}
            return web.json_response(_shown(request, refusal, view), status=409)
        return web.json_response(_shown(request, view))

    def lease_handler(action: LeaseAction) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            sidecar = request.app[SERVICE]
            run_id = request.match_info["run_id"]
            try:  # the lease rules parse the body (depth-bounded): a bad one is counted
                outcome = await sidecar.lease(run_id, action, request.get(BODY, b""))
            except StoreError as exc:
                return error(503, str(exc), {"Retry-After": RETRY_AFTER})
            if isinstance(outcome, Lease):
                return web.json_response({"run_id": run_id, **lease_view(outcome)})
            status = {"unknown_run": 404, "bad_request": 400}.get(outcome.reason, 409)
            return web.json_response(
                {
                    "error": outcome.message,
                    "reason": outcome.reason,
                    "holder": outcome.holder,
                    "expires_at": outcome.expires_at,
                    "last_heard": outcome.last_heard,
                },
                status=status,
            )

        return handle

    def intake_waiting(sidecar: Service) -> float:
        now = sidecar.clock()
        return max(0.0, now - sidecar.oldest_waiting(now))

    def ready_view(sidecar: Service) -> ReadyView:
        return readiness(intake_waiting(sidecar), sidecar.settings.ready_stall)

    async def healthz(request: web.Request) -> web.Response:
        # Liveness: 200 while the process answers, stalled or not (a restart would not
        # free the database and would drop the requests waiting for it); /readyz says
        # whether to send it more.
        sidecar = request.app[SERVICE]
        ready = ready_view(sidecar)
        failed = list(sidecar.failed_tasks)
        body: dict[str, object] = {
            "status": "failing" if failed else "ok",
            "ready": is_ready(ready),
            "runs": len(sidecar.state),
            "in_flight": sidecar.in_flight,
            "intake_waiting_s": ready["intake_waiting_s"],
            "failed_tasks": failed,
        }
        if failed:
            # A dead task (alert delivery, orphan detection) stops its work for good while
            # the rest answers: a liveness probe must see it, and a restart mends it.
            body["fix"] = (
                f"background task(s) {', '.join(failed)} ended by an error (logged as "
                "sidecar.task.failed): restart the sidecar (a restart raises every alert "
                "owed) and report the error"
            )
        return web.json_response(body, status=503 if failed else 200)

    async def readyz(request: web.Request) -> web.Response:
        view = ready_view(request.app[SERVICE])
        return web.json_response(view, status=200 if is_ready(view) else 503)

    async def metrics(request: web.Request) -> web.Response:
        sidecar = request.app[SERVICE]
        body = sidecar.metrics.render(sidecar.state, intake_waiting(sidecar))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    app.router.add_get("/runs", list_runs)
    app.router.add_get("/runs/{run_id}", get_run)
    app.router.add_get("/runs/{run_id}/stack", get_stack)
    app.router.add_post("/runs/{run_id}/resolve", resolve)
    app.router.add_post("/runs/{run_id}/lease", lease_handler("grant"))
    app.router.add_post("/runs/{run_id}/lease/renew", lease_handler("renew"))
    app.router.add_post("/runs/{run_id}/lease/release", lease_handler("release"))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_routes(page_routes())
    app.router.add_routes(service.api_routes)
    return app
