"""Sidecar memory across a million short-lived agent instances over a simulated week.

Drives the sidecar's state and SQLite store directly (no sockets), with an
injected clock: every agent process heart-beats twice and dies; the sidecar's
own orphan tick marks them dead and its prune path forgets instances silent for
longer than the retention (1 day here), so memory must level off after the first
simulated day and stay flat.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from pathlib import Path

import psutil  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench._figures import Figure
from saga_otel import semconv as sc
from sidecar import Settings, Sidecar
from sidecar._backends import open_store
from sidecar._otlp import extract, parse_protobuf

NS = 1_000_000_000
INSTANCES = 1_000_000
WEEK = 7 * 86400.0
RETENTION = 86400.0
BATCH = 500  # instances per request
PRUNE_EVERY = 3600.0  # simulated seconds between prunes (the CLI's default is 60 s)


def _heartbeats(first: int, count: int, at: float) -> bytes:
    request = ExportTraceServiceRequest()
    for n in range(first, first + count):
        rs = request.resource_spans.add()
        rs.resource.attributes.add(key=sc.SERVICE_INSTANCE_ID).value.string_value = f"agent-{n}"
        span = rs.scope_spans.add().spans.add(
            trace_id=(n + 1).to_bytes(16, "big"),
            span_id=(n + 1).to_bytes(8, "big"),
            name=sc.HEARTBEAT_SPAN_NAME,
            start_time_unix_nano=int(at * NS),
            end_time_unix_nano=int(at * NS),
        )
        span.attributes.add(key=sc.SAGA_PHASE).value.string_value = sc.PHASE_HEARTBEAT
        span.attributes.add(key=sc.SAGA_CONTRACT_VERSION).value.int_value = sc.CONTRACT_VERSION
        span.attributes.add(key=sc.SAGA_HEARTBEAT_INTERVAL_S).value.double_value = 1.0
    return request.SerializeToString()


def run(progress: Callable[[str], None]) -> list[Figure]:
    return asyncio.run(_run(progress))


async def _run(progress: Callable[[str], None]) -> list[Figure]:
    process = psutil.Process()
    now = [1_700_000_000.0]
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(db_path=Path(tmp) / "sidecar.db", retention=RETENTION)
        sidecar = Sidecar(settings, clock=lambda: now[0])
        sidecar.store = open_store(settings.database)  # no servers: state + store only
        step = WEEK / (INSTANCES / BATCH)
        next_prune = now[0] + PRUNE_EVERY
        day_rss: list[float] = []
        day_end = now[0] + 86400.0
        for first in range(0, INSTANCES, BATCH):
            for beat in (0.0, 1.0):  # two heartbeats a second apart, then the process is gone
                body = _heartbeats(first, BATCH, now[0] + beat)
                await sidecar.ingest(extract(parse_protobuf(body), body), "bench")
            now[0] += step
            sidecar.tick()  # serve's orphan tick (5 a second there): these processes died
            if now[0] >= next_prune:
                sidecar.prune()
                next_prune += PRUNE_EVERY
            if now[0] >= day_end:
                day_rss.append(process.memory_info().rss / 2**20)
                progress(
                    f"day {len(day_rss)}: {sidecar.state.instance_count():,} instances kept, "
                    f"RSS {day_rss[-1]:.1f} MiB"
                )
                day_end += 86400.0
        kept = sidecar.state.instance_count()
        sidecar.store.close()
    ratio = day_rss[-1] / day_rss[1]
    return [
        Figure(
            area="sidecar",
            name="RSS after a week of 1,000,000 short-lived instances",
            value=day_rss[-1],
            unit="MiB",
            reference_name="RSS at the end of day 2",
            reference_value=day_rss[1],
            ratio=ratio,
            goal="<= 1.10",
            met=ratio <= 1.10,
            notes=(
                f"{INSTANCES:,} distinct service.instance.id values over a simulated week "
                f"(injected clock), each heart-beating twice then silent; the orphan tick "
                f"after each batch of {BATCH} (serve ticks 5 a second); retention "
                f"{RETENTION / 3600:.0f} h, pruned every simulated hour; RSS at each day's "
                f"end: {', '.join(f'{r:.1f}' for r in day_rss)} MiB; instances kept at the "
                f"end: {kept:,} (those of the last day). State and SQLite store driven "
                "directly, no sockets."
            ),
        )
    ]
