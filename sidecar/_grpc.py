"""OTLP/gRPC intake (grpcio aio), in the same loop as the HTTP servers.

The handler takes raw bytes (no deserializer) so an undecodable message gets
INVALID_ARGUMENT from us rather than grpc's generic INTERNAL. It is registered as
stream-unary (the same bytes on the wire as unary) so that it, not grpc, reads the
one request message: under a deadline (--body-timeout), and never for a caller
the token interceptor refused on its metadata.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from grpc import aio

from ._errors import DecodeError, SidecarError, StoreError
from ._otlp import extract, other_signal, parse_protobuf, response, rpc_status
from ._service import Service
from ._settings import Settings

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
# The other signals' services, refused naming the fix (grpc's own answer is "Method not
# found!"): an SDK given the sidecar as its one OTLP endpoint sends them too.
OTHER_SERVICES = {
    "opentelemetry.proto.collector.logs.v1.LogsService": "logs",
    "opentelemetry.proto.collector.metrics.v1.MetricsService": "metrics",
}
PROTOBUF = "application/x-protobuf"
# The seconds a refused call is told to wait (RetryInfo), as the HTTP ports' Retry-After.
RETRY_AFTER_S = 1
# grpc's own cap on calls in progress, a multiple of what the handler admits: past it
# grpc answers RESOURCE_EXHAUSTED without RetryInfo, which OTLP exporters do not retry
# (the spec), so the handler's own bounds must answer first.
GRPC_CAP_FACTOR = 4


def _identity(data: bytes) -> bytes:
    return data


def _other_signal(service_signal: tuple[str, str]) -> grpc.GenericRpcHandler:
    service, signal = service_signal
    why = other_signal(signal, f"{service}/Export")

    async def refuse(
        _requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, why)  # its message is never read
        return b""  # pragma: no cover - abort raises

    return grpc.method_handlers_generic_handler(
        service,
        {
            "Export": grpc.stream_unary_rpc_method_handler(
                refuse, request_deserializer=_identity, response_serializer=_identity
            )
        },
    )


_UNAUTHENTICATED = (
    "missing or wrong bearer token: send metadata 'authorization: Bearer <token>' with "
    "the sidecar's --token"
)


class _TokenInterceptor(aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Refuse a call on its metadata, before grpc reads (or inflates) its message."""

    def __init__(self, expected: bytes) -> None:
        self._expected = expected

        async def refuse(
            _requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, bytes]
        ) -> bytes:
            # The request stream is never read: the peer's bytes stay in flow control.
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _UNAUTHENTICATED)
            return b""  # pragma: no cover - abort raises

        self._refuse = grpc.stream_unary_rpc_method_handler(
            refuse, request_deserializer=_identity, response_serializer=_identity
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
        if not hmac.compare_digest(given, self._expected):
            return self._refuse
        return await continuation(details)


async def _overloaded(context: aio.ServicerContext[bytes, bytes], message: str) -> None:
    """Refuse a call the sidecar has no room for: UNAVAILABLE, the code the OTLP spec
    has a server signal back-pressure with, and a RetryInfo (the HTTP ports' 429 +
    Retry-After). Exporters retry it after the delay."""
    code = grpc.StatusCode.UNAVAILABLE
    details = rpc_status(code.value[0], message, RETRY_AFTER_S)
    await context.abort(code, message, trailing_metadata=(("grpc-status-details-bin", details),))


def server_options(settings: Settings, max_connections: int) -> list[tuple[str, int]]:
    """grpc's own limits; each bounds what a slow or hostile peer can hold (docs/sidecar.md)."""
    body_ms = int(settings.body_timeout * 1000)
    keepalive_ms = int(settings.keepalive_timeout * 1000)
    return [
        # grpc enforces this on the decompressed message too: no gzip bomb here either.
        ("grpc.max_receive_message_length", settings.max_body),
        ("grpc.so_reuseport", 0),
        # The port's connection cap (_connections.connection_cap): past it grpc closes a
        # new connection as it accepts it.
        ("grpc.max_allowed_incoming_connections", max_connections),
        # The HTTP ports' --keepalive-timeout: a peer that has not sent its HTTP/2 preface
        # by then is told so and closed (grpc's default: 120 s), and a connection with no
        # call for that long gets a GOAWAY and is closed (clients reconnect on their next).
        ("grpc.server_handshake_timeout_ms", keepalive_ms),
        ("grpc.max_connection_idle_ms", keepalive_ms),
        # One connection cannot open more streams than this at once.
        ("grpc.max_concurrent_streams", 16),
        # Any connection is asked to go away after 30 minutes and closed --body-timeout
        # later whatever it does, so a stalled call cannot outlive age + grace even if it
        # slipped past the handler.
        ("grpc.max_connection_age_ms", 1_800_000),
        ("grpc.max_connection_age_grace_ms", body_ms),
        # Keepalive: ping a quiet peer every 60 s, drop it if no answer in 20 s (half-open
        # connections go); refuse clients that ping more than every 10 s without data.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # our keepalive pings: no cap
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        # No BDP probing: flow-control windows stay at their defaults, so a peer that is
        # not being read cannot make the server buffer megabytes.
        ("grpc.http2.bdp_probe", 0),
    ]


async def start_grpc(
    sidecar: Service, host: str, port: int, max_connections: int
) -> tuple[aio.Server, int]:
    token = sidecar.settings.token
    expected = f"Bearer {token}".encode() if token else b""

    settings = sidecar.settings
    body_timeout = settings.body_timeout
    receiving = 0  # calls whose message has not arrived yet (--max-receiving)

    async def export(
        requests: AsyncIterator[bytes], context: aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        nonlocal receiving
        started = time.perf_counter()
        try:
            if receiving >= settings.max_receiving:
                await _overloaded(
                    context,
                    f"sidecar is receiving {settings.max_receiving} request messages at once "
                    "(its --max-receiving): retry after the RetryInfo delay",
                )
            # Reading the message holds no in-flight slot: a stalled body blocks no one.
            receiving += 1
            try:
                async with asyncio.timeout(body_timeout):
                    body = await anext(requests, b"")
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the request message did not arrive within --body-timeout "
                    f"{body_timeout:g} s: send it at once",
                )
            finally:
                receiving -= 1
            if not sidecar.enter():
                await _overloaded(
                    context,
                    f"sidecar is at its bound of {settings.max_in_flight} requests in flight "
                    "(its --max-in-flight): retry after the RetryInfo delay",
                )
            try:
                try:
                    decoded = extract(parse_protobuf(body), body)
                except DecodeError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                try:
                    decoded = await sidecar.ingest(decoded, "grpc", body, PROTOBUF)
                except StoreError as exc:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                out, _ = response(decoded.rejected, decoded.error_message, as_json=False)
                return out
            finally:
                sidecar.leave()
        finally:
            sidecar.metrics.request_duration.labels(transport="grpc", route="Export").observe(
                time.perf_counter() - started
            )

    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Export": grpc.stream_unary_rpc_method_handler(
                export, request_deserializer=_identity, response_serializer=_identity
            )
        },
    )
    server = aio.server(
        options=server_options(sidecar.settings, max_connections),
        interceptors=[_TokenInterceptor(expected)] if token else [],
        # A backstop only: the handler refuses calls past --max-receiving and
        # --max-in-flight itself, with UNAVAILABLE and RetryInfo (_overloaded).
        maximum_concurrent_rpcs=GRPC_CAP_FACTOR * (settings.max_receiving + settings.max_in_flight),
    )
    server.add_generic_rpc_handlers((handler, *map(_other_signal, OTHER_SERVICES.items())))
    try:
        # grpcio returns 0 on some versions and raises RuntimeError on others.
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise SidecarError(
            f"cannot listen for OTLP/gRPC on {host}:{port} (address in use or not "
            "bindable): pick a free --otlp-grpc-port (or 0 for any)"
        )
    await server.start()
    return server, bound
