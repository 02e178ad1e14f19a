"""No alert is dropped by configuration, and the database's modes hold whatever the umask.

Real ``saga-sidecar serve`` processes, real local receivers, the real SQLite file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from receivers import RawReceiver
from sidecar_testkit import compensation_failed_run

from saga_otel import semconv as sc
from saga_otel.testing import SidecarProcess, start_sidecar

ALERTS = {sc.ALERT_COMPENSATION_STARTED, sc.ALERT_COMPENSATION_FAILED}
SINKS = ("log", "webhook", "alertmanager", "pagerduty")


def export_failed_run(side: SidecarProcess) -> str:
    run = compensation_failed_run()
    exporter = OTLPSpanExporter(endpoint=f"{side.otlp}/v1/traces", timeout=10)
    try:
        assert exporter.export(run.spans()) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    return run.run_id


def outbox(db: Path) -> list[tuple[str, str, str, str]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT alertname, run_id, sink, state FROM alert_outbox").fetchall()
    return [(str(a), str(b), str(c), str(d)) for a, b, c, d in rows]


def wait_for(check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def receiver() -> Iterator[RawReceiver]:
    r = RawReceiver()
    yield r
    r.stop()


def sink_args(sinks: tuple[str, ...], receiver: RawReceiver) -> list[str]:
    args = []
    for sink in sinks:
        if sink == "log":
            args.append("--alert-log")
        elif sink == "webhook":
            args += ["--webhook", f"{receiver.url}/hook"]
        elif sink == "alertmanager":
            args += ["--alertmanager", f"{receiver.url}/am"]
        else:
            args += [
                "--pagerduty-routing-key",
                "routing-key-0123456789abcdef0123",
                "--pagerduty-url",
                f"{receiver.url}/pd",
            ]
    return args


@pytest.mark.parametrize(
    "sinks", [(), *((s,) for s in SINKS), SINKS], ids=lambda s: "+".join(s) or "none"
)
def test_every_alert_is_stored_and_delivered_whatever_the_sinks(
    tmp_path: Path, receiver: RawReceiver, sinks: tuple[str, ...]
) -> None:
    with start_sidecar(tmp_path, *sink_args(sinks, receiver)) as side:
        run_id = export_failed_run(side)
        first = export_failed_run(side)  # a second run: the outbox keeps working after the first
        for rid in (run_id, first):
            wait_for(
                lambda rid=rid: {a for a, r, _, _ in outbox(side.db) if r == rid} >= ALERTS,
                f"both alerts of {rid} in the outbox",
            )
        http_sinks = [s for s in sinks if s != "log"]
        if http_sinks:
            wait_for(
                lambda: len(receiver.bodies) >= 2 * 2 * len(http_sinks),
                "every alert at the receiver",
            )
        if "log" in sinks:
            wait_for(
                lambda: Path(side.log).read_text().count('"saga.alert"') >= 4,
                "every alert in the log sink",
            )
        rows = outbox(side.db)
    log = Path(side.log).read_text()
    assert "closed database" not in log and "Traceback" not in log, log[-2000:]
    if not sinks:
        # Held, not dropped: kept for the sinks of a later start.
        assert {(a, s) for a, _, s, _ in rows} == {(a, "(none)") for a in ALERTS}
        assert {state for *_, state in rows} == {"held"}
    else:
        wait_for(lambda: all(state == "delivered" for *_, state in outbox(side.db)), "delivery")
        assert len(rows) == 2 * 2 * len(sinks)


def test_alerts_held_with_no_sink_go_to_the_sink_of_a_later_start(
    tmp_path: Path, receiver: RawReceiver
) -> None:
    with start_sidecar(tmp_path) as side:
        run_id = export_failed_run(side)
        wait_for(lambda: len(outbox(side.db)) == 2, "two held alerts")
    with start_sidecar(tmp_path, "--webhook", f"{receiver.url}/hook") as side:
        wait_for(lambda: len(receiver.docs()) == 2, "the held alerts at the webhook")
    assert {d["alertname"] for d in receiver.docs()} == ALERTS
    assert {d["run_id"] for d in receiver.docs()} == {run_id}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_database_folder_0700_and_files_0600_under_umask_000(tmp_path: Path) -> None:
    db = tmp_path / "state" / "saga-sidecar" / "sidecar.db"
    old = os.umask(0)
    try:
        with start_sidecar(tmp_path, db=db) as side:
            export_failed_run(side)
            files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
            wait_for(lambda: all(f.exists() for f in files), "the WAL files")
            modes = {str(f.name): oct(mode(f)) for f in files}
    finally:
        os.umask(old)
    assert oct(mode(db.parent)) == oct(0o700)
    assert oct(mode(db.parent.parent)) == oct(0o700)
    assert modes == dict.fromkeys(modes, oct(0o600))
    assert "has mode" not in Path(side.log).read_text()


def test_an_existing_wider_folder_is_warned_about_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o755)
    with start_sidecar(tmp_path, db=folder / "sidecar.db") as side:
        pass
    log = Path(side.log).read_text()
    (line,) = [json.loads(x) for x in log.splitlines() if "db_folder" in x]
    assert line["event"] == "sidecar.db_folder.open_to_others" and line["level"] == "warning"
    assert line["folder"] == str(folder) and line["mode"] == "0o755"
    assert f"chmod 700 {folder}" in line["fix"]
    assert mode(folder) == 0o755  # an operator's choice: warned about, not changed
