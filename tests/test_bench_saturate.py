"""The saturating load of the orphan-under-load bench (bench/_saturate.py): every
request is new complete runs the real sidecar accepts, and nothing it sends is left
open (an open run would idle into an orphan and page during the bench)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench._saturate import RUNS_PER_REQUEST, SPANS_PER_REQUEST, Bodies
from saga_otel import semconv as sc
from saga_otel.testing import SidecarProcess
from tests.support import wait_until

ROOT = Path(__file__).resolve().parent.parent


def _spans(body: bytes) -> list[tuple[str, bytes, bytes, dict[str, object]]]:
    """(name, trace id, span id, attributes) of every span in one request."""
    req = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = {
                    kv.key: getattr(kv.value, kv.value.WhichOneof("value") or "string_value")
                    for kv in span.attributes
                }
                out.append((span.name, span.trace_id, span.span_id, attrs))
    return out


def test_every_request_is_fresh_complete_runs_with_matching_ids() -> None:
    bodies = Bodies(seed=5)
    runs: dict[str, set[str]] = {}
    span_ids: set[tuple[str, bytes]] = set()
    for _ in range(300):
        spans = _spans(bodies.next())
        assert len(spans) == SPANS_PER_REQUEST
        for name, trace_id, span_id, attrs in spans:
            run_id = attrs[sc.SAGA_RUN_ID]
            assert isinstance(run_id, str) and run_id == trace_id.hex()  # one run, one trace
            assert span_id != bytes(8)
            assert (run_id, span_id) not in span_ids
            span_ids.add((run_id, span_id))
            phase = attrs[sc.SAGA_PHASE]
            runs.setdefault(run_id, set()).add(str(phase))
            if phase == sc.PHASE_RUN:
                assert name == sc.run_span_name("refund")
                assert attrs[sc.SAGA_RUN_STATUS] == sc.STATUS_COMPLETED
            else:
                assert attrs[sc.SAGA_COMPENSATION_TOOL] == "reverse_credit"
    assert len(runs) == 300 * RUNS_PER_REQUEST
    assert all(phases == {sc.PHASE_DO, sc.PHASE_RUN} for phases in runs.values())


def test_the_load_is_accepted_by_the_sidecar_and_leaves_no_run_open(
    sidecar_process: Callable[..., SidecarProcess],
) -> None:
    sidecar = sidecar_process()
    port = sidecar.otlp.rsplit(":", 1)[1]
    load = subprocess.Popen(
        [sys.executable, "-m", "bench._saturate", port, "3"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert load.stdout is not None
        assert load.stdout.readline().strip() == "ready"

        def completed() -> int:
            got = httpx.get(f"{sidecar.api}/runs?status=completed&limit=1000", timeout=5)
            return len(got.json()["runs"])

        wait_until(lambda: completed() >= 100, what="the load's runs stored")
        load.send_signal(signal.SIGTERM)
        out, err = load.communicate(timeout=30)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    assert load.returncode == 0, err  # the driver raises on any answer but 200
    sent = json.loads(out.strip().splitlines()[-1])
    assert sent["spans"] > 0 and sent["spans"] % SPANS_PER_REQUEST == 0
    for state in (sc.STATE_RUNNING, sc.STATE_UNWINDING, sc.STATE_ORPHANED):
        got = httpx.get(f"{sidecar.api}/runs?status={state}", timeout=5).json()["runs"]
        assert got == [], (state, got[:3])


def test_bad_arguments_get_the_usage_and_send_nothing() -> None:
    for argv in ([], ["4318"], ["http://127.0.0.1:4318", "1"], ["4318", "0"], ["99999", "1"]):
        done = subprocess.run(
            [sys.executable, "-m", "bench._saturate", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, (argv, done.stderr)
        assert "usage: python -m bench._saturate PORT SEED" in done.stderr
        assert repr(argv) in done.stderr or "got port" in done.stderr
        assert "ready" not in done.stdout
