"""OTLP/gRPC intake (grpcio aio), in the same loop as the HTTP servers.

The handler takes raw bytes (no deserializer) so an undecodable message gets
INVALID_ARGUMENT from us rather than grpc's generic INTERNAL.
"""

from __future__ import annotations

import hmac
import time

import grpc
from grpc import aio

from ._errors import DecodeError, SidecarError, StoreError
from ._otlp import extract, parse_protobuf, response
from ._service import Service

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
PROTOBUF = "application/x-protobuf"


def _identity(data: bytes) -> bytes:
    return data


async def start_grpc(sidecar: Service, host: str, port: int) -> tuple[aio.Server, int]:
    limit = sidecar.settings.max_body
    token = sidecar.settings.token
    expected = f"Bearer {token}".encode() if token else b""

    async def export(body: bytes, context: aio.ServicerContext[bytes, bytes]) -> bytes:
        started = time.perf_counter()
        try:
            if token:
                metadata = dict(context.invocation_metadata() or ())
                given = str(metadata.get("authorization", "")).encode()
                if not hmac.compare_digest(given, expected):
                    await context.abort(
                        grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong bearer token: send metadata 'authorization: Bearer "
                        "<token>' with the sidecar's --token",
                    )
            if not sidecar.enter():
                # UNAVAILABLE is the code OTLP exporters retry with backoff.
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"sidecar is at its bound of {sidecar.settings.max_in_flight} requests in "
                    "flight: retry later",
                )
            try:
                try:
                    decoded = extract(parse_protobuf(body), body)
                except DecodeError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                try:
                    decoded = sidecar.ingest(decoded, "grpc", body, PROTOBUF)
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
            "Export": grpc.unary_unary_rpc_method_handler(
                export, request_deserializer=_identity, response_serializer=_identity
            )
        },
    )
    server = aio.server(
        options=[
            # grpc enforces this on the decompressed message too: no gzip bomb here either.
            ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=sidecar.settings.max_in_flight * 2,
    )
    server.add_generic_rpc_handlers((handler,))
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
