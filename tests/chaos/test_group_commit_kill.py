"""kill -9 of a sidecar whose SQLite group commit is gathering concurrent requests.

A group that grew waits loop turns for more members (``sidecar/_groups.py``,
``Groups.due``): while it waits, its requests are unanswered. Eight exporters send
single-span-run requests at once; the sidecar is killed at a random moment; every
request that was answered 200 must be in the database the next sidecar opens.
"""

from __future__ import annotations

import http.client
import random
import signal
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from saga_otel.testing import start_sidecar

sys.path.insert(0, str(Path(__file__).parents[1] / "sidecar"))
from sidecar_testkit import open_run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

SENDERS = 8
MOMENTS = (0.3, 0.8, 1.3)  # seconds into the load, each with a random jitter


def _send_until_gone(port: int, acked: list[tuple[str, str]], stop: threading.Event) -> None:
    """POST one new run's spans after another on a kept-alive connection; record the
    (run id, span id) of every request answered 200, until the connection fails."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        while not stop.is_set():
            run = open_run()
            spans = run.spans()
            body = encode_spans(spans).SerializeToString()
            try:
                conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
                resp = conn.getresponse()
                resp.read()
            except (OSError, http.client.HTTPException):
                return  # the sidecar is gone: this request was never acknowledged
            if resp.status == 200:
                acked += [(run.run_id, f"{s.context.span_id:016x}") for s in spans]
    finally:
        conn.close()


@pytest.mark.parametrize("moment", MOMENTS)
def test_concurrent_requests_acknowledged_before_a_kill_are_all_stored(
    tmp_path: Path, moment: float
) -> None:
    side = start_sidecar(tmp_path)
    port = int(side.otlp.rsplit(":", 1)[1])
    acked: list[list[tuple[str, str]]] = [[] for _ in range(SENDERS)]
    stop = threading.Event()
    senders = [
        threading.Thread(target=_send_until_gone, args=(port, acked[i], stop), daemon=True)
        for i in range(SENDERS)
    ]
    try:
        for t in senders:
            t.start()
        time.sleep(moment + random.uniform(0.0, 0.4))  # a random moment under load
        side.proc.send_signal(signal.SIGKILL)
        side.proc.wait()
    finally:
        stop.set()
        for t in senders:
            t.join(30)
        side.stop()
    answered = {key for keys in acked for key in keys}
    assert answered, "no request was acknowledged before the kill: the load never started"
    # The next sidecar opens the same file (recovering its WAL) and serves them all.
    again = start_sidecar(tmp_path, db=side.db)
    try:
        with sqlite3.connect(side.db) as db:
            stored = set(db.execute("SELECT run_id, span_id FROM spans").fetchall())
    finally:
        again.stop()
    lost = answered - stored
    assert not lost, f"{len(lost)} of {len(answered)} acknowledged spans lost: {sorted(lost)[:5]}"
