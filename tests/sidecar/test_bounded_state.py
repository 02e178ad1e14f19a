"""Dead agent instances are forgotten after the retention, in memory and in the table."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from sidecar_testkit import BOTH_BACKENDS, FakeClock, settings_for

from saga_otel import semconv as sc
from sidecar import Sidecar

pytestmark = BOTH_BACKENDS

NS = 1_000_000_000


def heartbeats(instances: list[str], at: float) -> bytes:
    """One OTLP request: a heartbeat of each instance (its own resource)."""
    request = ExportTraceServiceRequest()
    for n, instance in enumerate(instances):
        rs = request.resource_spans.add()
        attr = rs.resource.attributes.add(key=sc.SERVICE_INSTANCE_ID)
        attr.value.string_value = instance
        span = rs.scope_spans.add().spans.add(
            trace_id=n.to_bytes(16, "big"),
            span_id=(n + 1).to_bytes(8, "big"),
            name=sc.HEARTBEAT_SPAN_NAME,
            start_time_unix_nano=int(at * NS),
            end_time_unix_nano=int(at * NS),
        )
        for key, value in ((sc.SAGA_PHASE, sc.PHASE_HEARTBEAT),):
            span.attributes.add(key=key).value.string_value = value
        span.attributes.add(key=sc.SAGA_CONTRACT_VERSION).value.int_value = sc.CONTRACT_VERSION
        span.attributes.add(key=sc.SAGA_HEARTBEAT_INTERVAL_S).value.double_value = 1.0
    return request.SerializeToString()


async def test_ten_thousand_dead_instances_are_forgotten_after_the_retention(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    t0 = clock.now
    settings = settings_for(tmp_path, retention=3600.0)
    async with Sidecar(settings, clock=clock) as sidecar:
        url = f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces"
        async with aiohttp.ClientSession() as session:
            for batch in range(10):
                names = [f"pid-{batch}-{i}" for i in range(1000)]
                async with session.post(
                    url,
                    data=heartbeats(names, clock.now),
                    headers={"Content-Type": "application/x-protobuf"},
                ) as resp:
                    assert resp.status == 200, await resp.text()
                clock.now += 60.0
        assert sidecar.store is not None
        assert sidecar.state.instance_count() == 10_000
        assert sidecar.store.instance_count() == 10_000
        # Batches came a minute apart: only the first one is past the retention yet.
        clock.now = t0 + 3600.0 + 30.0
        sidecar.prune()
        await sidecar.flush()  # PostgreSQL: the delete is committed on the database thread
        assert sidecar.state.instance_count() == 9000
        assert sidecar.store.instance_count() == 9000
        clock.now += 3600.0
        sidecar.prune()
        await sidecar.flush()
        assert sidecar.state.instance_count() == 0
        assert sidecar.store.instance_count() == 0
    # ...and a restart does not bring them back.
    async with Sidecar(settings, clock=clock) as again:
        assert again.state.instance_count() == 0
