"""The reference for the sidecar ingest bench: an OTLP/HTTP server that only parses.

It decodes each protobuf request and walks every span's attributes, nothing
else: the least any OTLP receiver written in Python with aiohttp can do.
Run as ``python -m bench._otlp_reference``; prints {"port": N} once listening.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

EMPTY = ExportTraceServiceResponse().SerializeToString()


async def traces(request: web.Request) -> web.Response:
    req = ExportTraceServiceRequest.FromString(await request.read())
    seen = 0
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                for kv in span.attributes:
                    if kv.key and kv.value.WhichOneof("value"):
                        seen += 1
    return web.Response(body=EMPTY, content_type="application/x-protobuf")


async def main() -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    sys.stdout.write(json.dumps({"port": port}) + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
