"""docs/scaling.md's example: three replicas on one PostgreSQL, started by its own script.

The test starts PostgreSQL (pg_server.py), runs ``examples/replicas/run.sh`` (which
runs the Procfile's commands), sends each run's spans spread over the three replicas
(as a round-robin load balancer would), and reads the runs back from every replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from pg_server import PgServer
from sidecar_testkit import compensated_run, completed_run, open_run
from support import wait_until

from saga_otel import semconv as sc

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "replicas"


@pytest.fixture
def replicas(postgres: PgServer, tmp_path: Path) -> Any:
    name = postgres.create()
    env = {
        **os.environ,
        "SAGA_SIDECAR_DB": postgres.url(name),
        # The venv's saga-sidecar, as an installed one would be on PATH.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    for letter in "ABC":
        for kind in ("HTTP", "GRPC", "API"):
            env[f"{letter}_{kind}"] = "0"  # any free port: each replica says which it bound
    errors = tmp_path / "stderr"
    proc = subprocess.Popen(
        ["sh", str(EXAMPLE / "run.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=errors.open("w"),
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        listening = []
        for _ in range(3):
            line = proc.stdout.readline()
            assert line, f"a replica exited before listening: {errors.read_text()[-2000:]}"
            info = json.loads(line)
            assert info["event"] == "sidecar.listening" and "***" in info["db"]
            listening.append(info)
        yield sorted(listening, key=lambda i: int(i["api"]))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # run.sh stops its replicas
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        postgres.drop(name)


def test_the_three_replica_example_serves_every_run_from_every_replica(
    replicas: list[dict[str, Any]],
) -> None:
    ports = [(int(r["otlp_http"]), int(r["api"])) for r in replicas]
    assert len({p for pair in ports for p in pair}) == 6
    now = time.time()
    runs = [completed_run(t0=now - 30), compensated_run(t0=now - 20), open_run(t0=now - 10)]
    exporters = [
        OTLPSpanExporter(endpoint=f"http://127.0.0.1:{http}/v1/traces", timeout=10)
        for http, _ in ports
    ]
    try:
        # Round robin, span by span: every run's spans land on all three replicas.
        for n, span in enumerate(s for r in runs for s in r.spans()):
            assert exporters[n % 3].export([span]) is SpanExportResult.SUCCESS
    finally:
        for exporter in exporters:
            exporter.shutdown()
    want = {
        runs[0].run_id: sc.STATUS_COMPLETED,
        runs[1].run_id: sc.STATUS_COMPENSATED,
        runs[2].run_id: sc.STATE_RUNNING,
    }

    def read(api: int) -> tuple[dict[str, str], dict[str, Any]]:
        listed = requests.get(f"http://127.0.0.1:{api}/runs", timeout=10).json()["runs"]
        views = {
            r.run_id: requests.get(f"http://127.0.0.1:{api}/runs/{r.run_id}", timeout=10).json()
            for r in runs
        }
        return {r["run_id"]: r["status"] for r in listed}, views

    # Each replica folds in the others' spans every tick (200 ms). A status alone can
    # agree early (the open run is "running" from its first span), so wait until the
    # three replicas agree on every run's whole view, then check what they agree on.
    seen: list[tuple[dict[str, str], dict[str, Any]]] = []

    def agreed() -> bool:
        seen[:] = [read(api) for _, api in ports]
        return all(s == seen[0] for s in seen) and seen[0][0] == want

    with contextlib.suppress(AssertionError):  # on timeout the asserts below say what differs
        wait_until(agreed, timeout=30, what="the three replicas to show every run alike")
    for (_, api), (got, _) in zip(ports, seen, strict=True):
        assert got == want, f"replica on API port {api} lists {got}"
    views = [v for _, v in seen]
    assert views[0] == views[1] == views[2]
    for r in runs:  # the agreed view holds every step that was sent, not an early subset
        sent = {
            s.attributes[sc.SAGA_STEP_INDEX]
            for s in r.spans()
            if s.attributes and sc.SAGA_STEP_INDEX in s.attributes
        }
        assert {step["index"] for step in views[0][r.run_id]["steps"]} == sent
