"""Schema versions: a sidecar upgrades an older database in place and refuses a newer one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from sidecar_testkit import (
    BOTH_BACKENDS,
    FakeClock,
    compensation_failed_run,
    completed_run,
    db_for,
    settings_for,
    stuck_run,
)
from support import sql_on

from saga_otel import semconv as sc
from sidecar import Sidecar, StoreError
from sidecar._backends import open_store
from sidecar._otlp import extract, parse_protobuf
from sidecar._outbox import DELIVERED, PENDING, Outbox, _load
from sidecar._pgstore import _STEPS as pg_steps
from sidecar._storage import SCHEMA_VERSION, heartbeat_row
from sidecar._store import _STEPS as sqlite_steps
from sidecar._store import _statements as statements

pytestmark = BOTH_BACKENDS

# Version 1 as main shipped it (sidecar/_store.py and sidecar/_outbox.py), copied here
# verbatim: the file every sidecar so far has written.
V1_SQLITE = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS spans (
    run_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    received_at REAL NOT NULL,
    service TEXT NOT NULL,
    instance TEXT NOT NULL,
    data BLOB NOT NULL,  -- the protobuf Span, exactly as received
    PRIMARY KEY (run_id, span_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS run_marks (
    run_id TEXT PRIMARY KEY,
    orphaned_at REAL,
    resolution_note TEXT,
    resolution_at REAL
);
CREATE TABLE IF NOT EXISTS instances (
    instance TEXT PRIMARY KEY,
    last_heartbeat REAL NOT NULL,
    interval_s REAL NOT NULL
);
-- Who opened each run (its first accepted span): the only one, beside the lease
-- holder, allowed to change it. Written with that span, in its transaction.
CREATE TABLE IF NOT EXISTS run_owners (
    run_id TEXT PRIMARY KEY,
    trace_id TEXT NOT NULL,
    instance TEXT NOT NULL,
    service TEXT NOT NULL
);
-- One row per run ever leased; the token only grows (fencing), the override is
-- the last forced grant and outlives the lease.
CREATE TABLE IF NOT EXISTS run_leases (
    run_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    token INTEGER NOT NULL,
    granted_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    released INTEGER NOT NULL,
    forced_reason TEXT,
    forced_by TEXT,
    forced_at REAL
);

CREATE TABLE IF NOT EXISTS alert_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    dedup_key TEXT NOT NULL,
    action TEXT NOT NULL,
    sink TEXT NOT NULL,
    alertname TEXT NOT NULL,
    run_id TEXT NOT NULL,
    event TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    delivered_at REAL,
    last_sent_at REAL,
    UNIQUE (dedup_key, action, sink)
);
CREATE INDEX IF NOT EXISTS alert_outbox_pending ON alert_outbox (sink, state, id);
CREATE INDEX IF NOT EXISTS alert_outbox_run ON alert_outbox (run_id);
"""
# Version 1 on PostgreSQL: the same tables in its types, as _pgstore.py first wrote them.
V1_POSTGRESQL = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE spans (run_id TEXT NOT NULL, span_id TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL, service TEXT NOT NULL, instance TEXT NOT NULL,
    data BYTEA NOT NULL, PRIMARY KEY (run_id, span_id));
CREATE TABLE run_marks (run_id TEXT PRIMARY KEY, orphaned_at DOUBLE PRECISION,
    resolution_note TEXT, resolution_at DOUBLE PRECISION);
CREATE TABLE instances (instance TEXT PRIMARY KEY, last_heartbeat DOUBLE PRECISION NOT NULL,
    interval_s DOUBLE PRECISION NOT NULL);
CREATE TABLE run_owners (run_id TEXT PRIMARY KEY, trace_id TEXT NOT NULL,
    instance TEXT NOT NULL, service TEXT NOT NULL);
CREATE TABLE run_leases (run_id TEXT PRIMARY KEY, holder TEXT NOT NULL, token BIGINT NOT NULL,
    granted_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL,
    released BOOLEAN NOT NULL, forced_reason TEXT, forced_by TEXT,
    forced_at DOUBLE PRECISION);
CREATE TABLE alert_outbox (id BIGSERIAL PRIMARY KEY, dedup_key TEXT NOT NULL,
    action TEXT NOT NULL, sink TEXT NOT NULL, alertname TEXT NOT NULL, run_id TEXT NOT NULL,
    event TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'pending',
    created_at DOUBLE PRECISION NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT, delivered_at DOUBLE PRECISION, last_sent_at DOUBLE PRECISION,
    UNIQUE (dedup_key, action, sink))
"""
KEY = "saga-otel/SagaCompensationFailed/r-v1"
EVENT = {
    "action": "fire",
    "alertname": "SagaCompensationFailed",
    "annotations": {"summary": "left from version 1"},
    "at": 1.0,
    "starts_at": 1.0,
    "details": {},
    "labels": {"alertname": "SagaCompensationFailed", "severity": "critical"},
    "run_id": "r-v1",
    "severity": "critical",
}


def _execute(where: str, script: str, rows: list[tuple[str, tuple[object, ...]]]) -> None:
    """Run ``script`` (DDL) then ``rows`` (SQL with ? marks, arguments) on the database."""
    with sql_on(where) as run:
        for statement in statements(script):
            run(statement)
        for text, args in rows:
            run(text, [args])


def _rows(where: str, query: str) -> list[tuple[object, ...]]:
    with sql_on(where) as run:
        return [tuple(r) for r in run(query)]


def _make_v1(where: str, backend: str) -> str:
    """A version-1 database holding one failed run's spans and owner and a pending alert."""
    run = compensation_failed_run(run_id="r-v1")
    body = encode_spans(run.spans()).SerializeToString()
    decoded = extract(parse_protobuf(body), body)
    rows: list[tuple[str, tuple[object, ...]]] = [
        ("INSERT INTO meta(key, value) VALUES ('schema', '1')", ()),
        (
            "INSERT INTO run_owners(run_id, trace_id, instance, service) VALUES (?, ?, ?, ?)",
            ("r-v1", decoded.spans[0].trace_id, decoded.spans[0].instance, "refund-agent"),
        ),
    ]
    for span, raw in zip(decoded.spans, decoded.raw, strict=True):
        rows.append(
            (
                "INSERT INTO spans(run_id, span_id, received_at, service, instance, data) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                ("r-v1", span.span_id, 1.0, span.service, span.instance, raw),
            )
        )
    rows.append(
        (
            "INSERT INTO alert_outbox (dedup_key, action, sink, alertname, run_id, event, "
            "state, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                KEY,
                "fire",
                "webhook:x",
                EVENT["alertname"],
                "r-v1",
                json.dumps(EVENT, sort_keys=True),
                PENDING,
                1.0,
            ),
        )
    )
    _execute(where, V1_SQLITE if backend == "sqlite" else V1_POSTGRESQL, rows)
    return run.run_id


async def test_a_version_1_database_is_upgraded_in_place(tmp_path: Path, backend: str) -> None:
    settings = settings_for(tmp_path)
    where = db_for(tmp_path / "sidecar.db")
    run_id = _make_v1(where, backend)
    async with Sidecar(settings, clock=FakeClock()) as sc_:
        view = sc_.state.view(run_id)
        assert view is not None and view["status"] == sc.STATUS_COMPENSATION_FAILED
        assert sc_.store is not None and sc_.store.schema_version() == SCHEMA_VERSION == 8
    # The outbox row written by version 1 is still there, pending, in the new shape.
    box = Outbox(where, [])
    try:
        assert [(r.dedup_key, r.state) for r in box.rows()] == [(KEY, PENDING)]
    finally:
        box.close()
    _execute(where, "", [("UPDATE alert_outbox SET claimed_by = ?, claimed_until = ?", ("x", 1.0))])
    # Version 4's index on the outbox's state (its depth count) is there too.
    pg = backend == "postgresql"
    catalog = "pg_indexes WHERE indexname" if pg else "sqlite_master WHERE name"
    assert _rows(where, f"SELECT 1 FROM {catalog} = 'alert_outbox_state'") == [(1,)]
    # Opening it again changes nothing (the steps ran once).
    store = open_store(settings.database)
    try:
        assert store.schema_version() == SCHEMA_VERSION and store.span_count() > 0
    finally:
        store.close()


def test_a_newer_database_is_refused_with_what_to_do(tmp_path: Path, backend: str) -> None:
    settings = settings_for(tmp_path)
    where = db_for(tmp_path / "sidecar.db")
    store = open_store(settings.database)
    store.close()
    _execute(where, "", [("UPDATE meta SET value = '99' WHERE key = 'schema'", ())])
    with pytest.raises(StoreError) as info:
        open_store(settings.database)
    (line,) = str(info.value).splitlines()
    newer = f"schema version 99, newer than this sidecar's {SCHEMA_VERSION}"
    assert newer in line and "--db" in line
    # And through the command: one line, exit 1, no traceback, nothing changed.
    out = subprocess.run(
        [sys.executable, "-c", "from sidecar._cli import main; main()", "serve", "--db", where],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "newer than this sidecar's" in line
    with pytest.raises(StoreError):
        open_store(settings.database)


async def test_a_version_3_outbox_keeps_resending_only_what_still_fires(
    tmp_path: Path, backend: str
) -> None:
    """Version 4 marks fire rows resolved when their resolve is written; rows written by
    version 3 are marked by the upgrade, so Alertmanager is re-sent what still fires
    and not what was resolved before it."""
    where = db_for(tmp_path / "sidecar.db")
    steps = pg_steps if backend == "postgresql" else sqlite_steps
    script = ";".join(
        ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"]
        + [s for version in (1, 2, 3) for s in statements(steps[version])]
    )
    insert = (
        "INSERT INTO alert_outbox (dedup_key, action, sink, alertname, run_id, event, state, "
        "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    )

    def row(key: str, action: str) -> tuple[str, tuple[object, ...]]:
        event = json.dumps({**EVENT, "action": action, "run_id": key}, sort_keys=True)
        return insert, (key, action, "am", EVENT["alertname"], key, event, DELIVERED, 1.0)

    _execute(
        where,
        script,
        [
            ("INSERT INTO meta(key, value) VALUES ('schema', '3')", ()),
            row("resolved", "fire"),
            row("resolved", "resolve"),
            row("firing", "fire"),
        ],
    )
    box = Outbox(where, [])
    try:
        firing = box._store.firing("am", DELIVERED)  # type: ignore[attr-defined]
        assert [_load(text).run_id for _, _, text in firing] == ["firing"]
    finally:
        box.close()


async def test_a_version_4_database_keeps_what_a_start_folds(tmp_path: Path, backend: str) -> None:
    """Version 5 reads the runs a start folds through the owners' put-away flag, set by
    the upgrade from the index: a run put away stays out of memory, an open run and a
    reopened one (index status NULL) come back, as before the upgrade."""
    where = db_for(tmp_path / "sidecar.db")
    steps = pg_steps if backend == "postgresql" else sqlite_steps
    script = ";".join(
        ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"]
        + [s for version in (1, 2, 3, 4) for s in statements(steps[version])]
    )
    rows: list[tuple[str, tuple[object, ...]]] = [
        ("INSERT INTO meta(key, value) VALUES ('schema', '4')", ())
    ]
    runs = {name: completed_run(run_id=f"r-{name}") for name in ("open", "away", "reopened")}
    for name, run in runs.items():
        body = encode_spans(run.spans()).SerializeToString()
        decoded = extract(parse_protobuf(body), body)
        first = decoded.spans[0]
        rows.append(
            (
                "INSERT INTO run_owners(run_id, trace_id, instance, service) VALUES (?, ?, ?, ?)",
                (run.run_id, first.trace_id, first.instance, first.service),
            )
        )
        rows += [
            (
                "INSERT INTO spans(run_id, span_id, received_at, service, instance, data) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (run.run_id, span.span_id, 1.0, span.service, span.instance, raw),
            )
            for span, raw in zip(decoded.spans, decoded.raw, strict=True)
        ]
        if name != "open":
            rows.append(
                (
                    "INSERT INTO run_index(run_id, started_at, status, saga, last_seen) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (run.run_id, 1.0, None if name == "reopened" else "completed", "refund", 2.0),
                )
            )
    _execute(where, script, rows)
    async with Sidecar(settings_for(tmp_path, retention=1e12), clock=FakeClock()) as sc_:
        assert {r for r in (run.run_id for run in runs.values()) if r in sc_.state} == {
            "r-open",
            "r-reopened",
        }
        assert sc_.store is not None and sc_.store.put_away_of(["r-away"]) == {"r-away"}
    assert _rows(where, "SELECT run_id, put_away FROM run_owners ORDER BY run_id") == [
        ("r-away", 1),
        ("r-open", 0),
        ("r-reopened", 0),
    ]


async def test_a_version_6_database_keeps_its_resolutions_with_no_one_named(
    tmp_path: Path, backend: str
) -> None:
    """Version 7 stores who resolved a run (run_marks.resolution_by). A resolution stored
    before has its note and time intact and names no one (by null): nothing is made up
    for it; the next one stores its name."""
    where = db_for(tmp_path / "sidecar.db")
    steps = pg_steps if backend == "postgresql" else sqlite_steps
    script = ";".join(
        ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"]
        + [s for version in range(1, 7) for s in statements(steps[version])]
    )
    rows: list[tuple[str, tuple[object, ...]]] = [
        ("INSERT INTO meta(key, value) VALUES ('schema', '6')", ())
    ]
    runs = [stuck_run(run_id="r-resolved"), stuck_run(run_id="r-later")]
    for run in runs:
        body = encode_spans(run.spans()).SerializeToString()
        decoded = extract(parse_protobuf(body), body)
        first = decoded.spans[0]
        rows.append(
            (
                "INSERT INTO run_owners(run_id, trace_id, instance, service) VALUES (?, ?, ?, ?)",
                (run.run_id, first.trace_id, first.instance, first.service),
            )
        )
        rows += [
            (
                "INSERT INTO spans(run_id, span_id, received_at, service, instance, data) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (run.run_id, span.span_id, 1.0, span.service, span.instance, raw),
            )
            for span, raw in zip(decoded.spans, decoded.raw, strict=True)
        ]
    rows.append(
        (
            "INSERT INTO run_marks(run_id, resolution_note, resolution_at) VALUES (?, ?, ?)",
            ("r-resolved", "reversed cr_1 by hand", 5.0),
        )
    )
    _execute(where, script, rows)
    clock = FakeClock()
    async with Sidecar(settings_for(tmp_path, retention=1e12), clock=clock) as sc_:
        assert sc_.store is not None and sc_.store.schema_version() == SCHEMA_VERSION
        view = sc_.state.view("r-resolved")
        assert view is not None
        assert view["resolution"] == {"note": "reversed cr_1 by hand", "at": 5.0, "by": None}
        assert await sc_.resolve("r-later", "settled", by="alice") is not None
    async with Sidecar(settings_for(tmp_path, retention=1e12), clock=clock) as sc_:
        for run_id, by in (("r-resolved", None), ("r-later", "alice")):
            view = sc_.state.view(run_id)
            assert view is not None and view["resolution"] is not None
            assert view["resolution"]["by"] == by, run_id
    assert sorted(_rows(where, "SELECT run_id, resolution_note, resolution_by FROM run_marks")) == [
        ("r-later", "settled", "alice"),
        ("r-resolved", "reversed cr_1 by hand", None),
    ]


def test_a_version_7_database_takes_the_parts_of_a_beat(tmp_path: Path, backend: str) -> None:
    """Version 8 keeps the beat an instance's row holds the runs of. A row stored before
    holds none: the next heartbeat takes its place, and the parts of its beat join."""
    where = db_for(tmp_path / "sidecar.db")
    steps = pg_steps if backend == "postgresql" else sqlite_steps
    script = ";".join(
        ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"]
        + [s for version in range(1, 8) for s in statements(steps[version])]
    )
    _execute(
        where,
        script,
        [
            ("INSERT INTO meta(key, value) VALUES ('schema', '7')", ()),
            (
                "INSERT INTO instances(instance, last_heartbeat, interval_s, open_runs) "
                "VALUES (?, ?, ?, ?)",
                ("agent-1", 1.0, 1.0, '["r0"]'),
            ),
        ],
    )
    store = open_store(settings_for(tmp_path).database)
    try:
        assert store.schema_version() == SCHEMA_VERSION == 8
        store.write([], [heartbeat_row("agent-1", 2.0, 1.0, ["r1"], beat=1, parts=2)])
        store.write([], [heartbeat_row("agent-1", 2.0, 1.0, ["r2"], beat=1, parts=2)])
    finally:
        store.close()
    ((runs, beat),) = _rows(where, "SELECT open_runs, beat FROM instances")
    assert (sorted(json.loads(runs)), beat) == (["r1", "r2"], 1)
