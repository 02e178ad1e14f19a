"""SQLite-only properties of sidecar/_store.py (the WAL and its checkpoints, the filter
in front of the lookup of runs put away)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from sidecar_testkit import open_run, settings_for, start_sidecar
from test_outbox import unwinding, view

from sidecar import Sidecar, _putaway_filter, _store
from sidecar._alert_service import install_alerting
from sidecar._alert_settings import AlertSettings
from sidecar._alerting import evaluate
from sidecar._errors import StoreError
from sidecar._outbox import Outbox
from sidecar._storage import PutAway
from sidecar._store import (
    BACKSTOP_PAGES,
    SqliteAlertStore,
    SqliteStore,
    hold_file,
    prepare_db_file,
)


def test_an_alert_commit_never_checkpoints_the_wal_itself(tmp_path: Path) -> None:
    """The store's thread checkpoints (CHECKPOINT_INTERVAL); a COMMIT on the way of an
    alert must not copy a busy WAL into the database file itself, as SQLite's default
    (1,000 pages) made every alert's COMMIT do under load (6-30 ms each)."""
    path = tmp_path / "sidecar.db"
    box = Outbox(path, [])
    intake = sqlite3.connect(path, isolation_level=None)
    intake.execute("PRAGMA wal_autocheckpoint = 0")  # the store's thread is not running here
    intake.execute("CREATE TABLE filler(x BLOB)")
    intake.execute("BEGIN")
    intake.executemany("INSERT INTO filler VALUES (?)", [(os.urandom(3000),)] * 1500)
    intake.execute("COMMIT")  # ~1,500 pages in the WAL: past SQLite's default, not ours
    assert BACKSTOP_PAGES > 1500
    size = path.stat().st_size
    try:
        assert box.add(evaluate(view("r1"), unwinding("r1"), now=2.0)) == 1
        assert path.stat().st_size == size  # nothing was copied into the database file
    finally:
        intake.close()
        box.close()


def _away(run_id: str, last_seen: float) -> PutAway:
    return PutAway(run_id, last_seen - 10, "completed", "refund", last_seen)


def _ready(store: SqliteStore) -> SqliteStore:
    """The store once its filter is built (on the store's thread, after open)."""
    assert store._away_done.wait(30)
    assert store.put_away_filter_ready
    return store


def _selects(store: SqliteStore) -> list[str]:
    """Statements the store's connection runs from now on (sqlite3's trace callback)."""
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    return seen


def test_a_new_run_is_looked_up_without_reading_the_database(tmp_path: Path) -> None:
    """The filter in front of put_away_of: a run id never put away costs no read
    transaction (on every group commit that opens a run)."""
    store = _ready(SqliteStore(tmp_path / "sidecar.db"))
    try:
        store.put_away([_away("run-old", 100.0)])
        seen = _selects(store)
        assert store.put_away_of(["run-new-1", "run-new-2"]) == set()
        assert seen == []
        assert store.put_away_of(["run-new-3", "run-old"]) == {"run-old"}
        assert len(seen) == 1 and "run_index" in seen[0]
    finally:
        store.close()


def test_runs_put_away_before_a_restart_are_found_after_it(tmp_path: Path) -> None:
    """The filter is rebuilt from the index at open: a late span of a run put away by
    the last process still finds its run."""
    first = SqliteStore(tmp_path / "sidecar.db")
    first.put_away([_away(f"run-{i}", 100.0 + i) for i in range(50)])
    first.close()
    again = _ready(SqliteStore(tmp_path / "sidecar.db"))
    try:
        asked = [f"run-{i}" for i in range(0, 60, 7)]
        assert again.put_away_of(asked) == {r for r in asked if int(r[4:]) < 50}
    finally:
        again.close()


class _Gate:
    """Holds the store's filter builder at its first rows (its read snapshot taken)
    until opened; counts the chunks it adds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.held = threading.Event()  # the builder is at the gate, its read begun
        self.adds = 0
        gate = self

        class Held(_putaway_filter.PutAwayFilter):
            def add(self, rows: Iterable[tuple[str, float]]) -> None:
                rows = list(rows)
                if rows:  # the constructor's own add is empty
                    gate.held.set()
                    assert gate.open.wait(30)
                    gate.adds += 1
                super().add(rows)

        monkeypatch.setattr(_store, "PutAwayFilter", Held)


def test_the_store_answers_while_its_filter_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening does not wait for the filter (a second per million runs put away, before
    the ports listen): until it is built the index answers, and what is put away or
    pruned meanwhile is right once the filter takes over."""
    first = SqliteStore(tmp_path / "sidecar.db")
    first.put_away([_away(f"run-{i}", 100.0 + i) for i in range(50)])
    first.close()
    gate = _Gate(monkeypatch)
    store = SqliteStore(tmp_path / "sidecar.db")  # returns with the builder held
    try:
        assert gate.held.wait(30)
        assert not store.put_away_filter_ready
        seen = _selects(store)
        assert store.put_away_of(["run-3", "run-new"]) == {"run-3"}
        assert len(seen) == 1 and "run_index" in seen[0]  # the index, not a filter
        store.put_away([_away("run-late", 500.0)])  # after the builder's read began
        assert store.prune_put_away(110.0) == 10  # run-0 .. run-9
        assert store.put_away_of(["run-late", "run-0", "run-10"]) == {"run-late", "run-10"}
        gate.open.set()
        _ready(store)
        asked = ["run-late", "run-0", "run-9", "run-10", "run-49", "run-new"]
        assert store.put_away_of(asked) == {"run-late", "run-10", "run-49"}
        del seen[:]
        assert store.put_away_of(["run-new-1", "run-new-2"]) == set()
        assert seen == []  # the filter answers now
    finally:
        gate.open.set()
        store.close()


def test_closing_stops_a_filter_being_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store closed during the build (a CLI command, a failed start) does not read
    the rest of the index first."""
    first = SqliteStore(tmp_path / "sidecar.db")
    first.put_away([_away(f"run-{i}", 100.0 + i) for i in range(50)])
    first.close()
    monkeypatch.setattr(_store, "_AWAY_CHUNK", 10)
    gate = _Gate(monkeypatch)
    store = SqliteStore(tmp_path / "sidecar.db")
    assert gate.held.wait(30)
    closer = threading.Thread(target=store.close)
    closer.start()
    assert store._closing.wait(30)
    gate.open.set()
    closer.join(30)
    assert not closer.is_alive() and not store._away_builder.is_alive()
    assert gate.adds == 1  # the chunk in hand; the other four were never read


def test_a_failed_build_is_logged_and_the_index_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first = SqliteStore(tmp_path / "sidecar.db")
    first.put_away([_away("run-old", 100.0)])
    first.close()

    def broken() -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(_store, "PutAwayFilter", broken)
    with caplog.at_level(logging.WARNING, logger="sidecar"):
        store = SqliteStore(tmp_path / "sidecar.db")
        try:
            assert store._away_done.wait(30)
            assert not store.put_away_filter_ready
            store.put_away([_away("run-next", 200.0)])
            assert store.put_away_of(["run-old", "run-next", "run-new"]) == {
                "run-old",
                "run-next",
            }
        finally:
            store.close()
    (record,) = [r for r in caplog.records if r.getMessage() == "sidecar.db.putaway_filter_failed"]
    assert "disk I/O error" in record.__dict__["error"]


def test_a_pruned_slice_never_hides_a_run_put_away_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune drops the filter's old slices; a reopened run (not pruned: it is back in
    memory) put away again later is found again, as is everything newer."""
    monkeypatch.setattr(_putaway_filter, "SLICE_ITEMS", 2)
    store = _ready(SqliteStore(tmp_path / "sidecar.db"))
    try:
        store.put_away([_away("run-a", 10.0), _away("run-b", 11.0)])
        store.put_away([_away("run-c", 50.0), _away("run-d", 51.0), _away("run-e", 52.0)])
        store.load_runs(["run-a"], 0.0, reopen=True)  # back in memory: status NULL
        assert store.prune_put_away(20.0) == 1  # run-b only
        assert store.put_away_of(["run-a", "run-b", "run-c", "run-d", "run-e"]) == {
            "run-a",  # reopened rows stay in the index: still asked and found
            "run-c",
            "run-d",
            "run-e",
        }
        store.put_away([_away("run-a", 60.0)])
        store.prune_put_away(55.0)
        assert store.put_away_of(["run-a", "run-c"]) == {"run-a"}
    finally:
        store.close()


def test_a_partial_prune_keeps_the_filter_slices_of_runs_not_yet_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune batch that stops at its limit leaves older runs in the index: the filter's
    old slices must stay until the last batch, or those runs' late spans would be taken
    for new runs."""
    monkeypatch.setattr(_putaway_filter, "SLICE_ITEMS", 2)
    store = _ready(SqliteStore(tmp_path / "sidecar.db"))
    try:
        store.put_away([_away(f"run-{i}", 10.0 + i) for i in range(6)])  # 3 slices
        store.put_away([_away("run-new", 100.0)])
        assert store.prune_put_away(50.0, limit=2) == 2  # run-0, run-1: more are left
        left = ["run-2", "run-3", "run-4", "run-5", "run-new"]
        assert store.put_away_of(["run-0", "run-1", *left]) == set(left)
        assert store.prune_put_away(50.0, limit=2) == 2
        assert store.prune_put_away(50.0, limit=2) == 2
        assert store.prune_put_away(50.0, limit=2) == 0  # the last batch: slices dropped
        assert store.put_away_of(["run-0", "run-5", "run-new"]) == {"run-new"}
        assert store._away is not None and store._away.slices == 1
    finally:
        store.close()


def _backfilled(path: Path) -> int:
    """WAL frames copied into the database file by the last checkpoint: nBackfill, the
    native u32 at byte 96 of the -shm file (SQLite's wal-index, after its two 48-byte
    header copies)."""
    return int.from_bytes(Path(f"{path}-shm").read_bytes()[96:100], sys.byteorder)


def test_a_prune_batch_has_the_wal_checkpointed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog pruned a batch at a time writes the WAL faster than a checkpoint a
    second copies it: at the backstop a COMMIT on the loop would copy it all (~150 ms
    measured). Each batch asks the store's thread for a checkpoint now instead."""
    monkeypatch.setattr(_store, "CHECKPOINT_INTERVAL", 3600.0)  # only when asked
    path = tmp_path / "sidecar.db"
    store = _ready(SqliteStore(path))
    try:
        store.put_away([_away(f"run-{i}", 10.0 + i) for i in range(20)])
        store.write(
            [
                (f"run-{i}", f"{j:016x}", 1.0, "svc", "i-1", b"x" * 400)
                for i in range(20)
                for j in range(10)
            ]
        )
        assert _backfilled(path) == 0
        assert store.prune_put_away(100.0, limit=5) == 5
        for _ in range(1000):
            if _backfilled(path) > 0:
                break
            time.sleep(0.01)
        assert _backfilled(path) > 0
    finally:
        store.close()


def test_a_second_serve_on_the_same_file_stops_at_start(tmp_path: Path) -> None:
    """One sidecar a SQLite file (the store is its only writer): a second ``serve`` says
    which file and what to do instead, and the first serves on; once the first is
    SIGKILLed the file is free at once (the kernel drops the lock with the process)."""
    db = tmp_path / "sidecar.db"
    first, ports = start_sidecar(db)
    try:
        saga_sidecar = str(Path(sys.executable).parent / "saga-sidecar")
        argv = [saga_sidecar, "serve", "--db", str(db), "--log-level", "error"]
        argv += ["--otlp-http-port", "0", "--otlp-grpc-port", "0", "--api-port", "0"]
        second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert "another sidecar already serves" in lines[0] and str(db) in lines[0]
        assert "--db" in lines[0] and "PostgreSQL" in lines[0]
        health = httpx.get(f"http://127.0.0.1:{ports['api']}/healthz", timeout=10)
        assert health.status_code == 200  # the first one never noticed
    finally:
        first.kill()
        first.wait()
    again, _ = start_sidecar(db)  # would fail if a dead holder kept the lock
    again.terminate()
    assert again.wait(timeout=30) == 0


needs_proc_locks = pytest.mark.skipif(
    not Path("/proc/locks").exists(), reason="reads the kernel's lock table (Linux)"
)


def _posix_locks(pid: int, path: Path) -> list[str]:
    """The POSIX locks process ``pid`` holds on ``path``, as /proc/locks lists them
    ("1: POSIX ADVISORY READ <pid> <maj:min:inode> <start> <end>")."""
    inode = f":{os.stat(path).st_ino}"
    held = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = [f for f in line.split() if f != "->"]  # "->": a waiter, not a holder
        if fields[1] == "POSIX" and fields[4] == str(pid) and fields[5].endswith(inode):
            held.append(line)
    return held


@needs_proc_locks
def test_opening_the_file_again_keeps_sqlites_lock_on_it(tmp_path: Path) -> None:
    """What a serving process does to its file after the store opened it (the outbox's
    store, the hold, another prepare) leaves SQLite's shared lock on it. Closing a
    descriptor of our own on the file dropped that lock, and any other process closing
    the file (a sqlite3 query, a backup) then deleted the -wal still committed into."""
    db = tmp_path / "sidecar.db"
    store = SqliteStore(db)
    held: int | None = None
    try:
        store.write([("run-1", f"{1:016x}", 1.0, "svc", "i-1", b"x")])
        assert _posix_locks(os.getpid(), db)
        alerts = SqliteAlertStore(db)
        held = hold_file(db)
        prepare_db_file(db)
        assert _posix_locks(os.getpid(), db)
        alerts.close()
    finally:
        store.close()
        if held is not None:
            os.close(held)


def _send_runs(otlp_port: int, runs: int) -> set[tuple[str, str]]:
    """POST ``runs`` new runs one request each; the (run id, span id) of each, all 200."""
    sent: set[tuple[str, str]] = set()
    for _ in range(runs):
        run = open_run()
        spans = run.spans()
        answer = httpx.post(
            f"http://127.0.0.1:{otlp_port}/v1/traces",
            content=encode_spans(spans).SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        sent |= {(run.run_id, f"{s.context.span_id:016x}") for s in spans}
    return sent


_READ_AND_CLOSE = (
    "import sqlite3, sys; db = sqlite3.connect(sys.argv[1]); "
    "db.execute('SELECT count(*) FROM spans').fetchall(); db.close()"
)


@needs_proc_locks
@pytest.mark.parametrize("outsider", ["a sqlite3 reader", "a refused second serve"])
def test_acknowledged_spans_survive_kill_9_after_another_process_closed_the_file(
    tmp_path: Path, outsider: str
) -> None:
    """A 200 means stored, whoever opened and closed the file meanwhile: an operator's
    query, a backup, a second ``serve`` refused at start. Each believed it was the
    file's last connection (the sidecar's lock was gone), checkpointed and deleted the
    -wal: what the sidecar committed after that went into a deleted file, and a kill -9
    lost it."""
    db = tmp_path / "sidecar.db"
    proc, ports = start_sidecar(db)
    try:
        acked = _send_runs(ports["otlp_http"], 10)
        if outsider == "a sqlite3 reader":
            argv = [sys.executable, "-c", _READ_AND_CLOSE, str(db)]
            subprocess.run(argv, check=True, timeout=60)
        else:
            argv = [sys.executable, "-c", "from sidecar._cli import main; main()", "serve"]
            argv += ["--db", str(db), "--api-port", "0"]
            argv += ["--otlp-http-port", "0", "--otlp-grpc-port", "0"]
            second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert second.returncode == 1 and "already serves" in second.stderr, second.stderr
        assert Path(f"{db}-wal").exists()
        assert _posix_locks(proc.pid, db)
        acked |= _send_runs(ports["otlp_http"], 10)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with contextlib.closing(sqlite3.connect(db)) as opened:
        stored = set(opened.execute("SELECT run_id, span_id FROM spans").fetchall())
    lost = acked - stored
    assert not lost, f"{len(lost)} of {len(acked)} acknowledged spans lost"


def test_a_refused_sidecar_never_opened_the_database(tmp_path: Path) -> None:
    """The hold comes before any connection: install_alerting claims the file before
    its outbox opens it, so a sidecar refused because another serves the file has
    not opened it (nor written the outbox's tables into it)."""
    db = tmp_path / "sidecar.db"
    held = hold_file(db)  # as the serving sidecar does
    try:
        sidecar = Sidecar(settings_for(tmp_path))
        with pytest.raises(StoreError, match="another sidecar already serves"):
            install_alerting(sidecar, AlertSettings(log_sink=False))
        assert db.stat().st_size == 0
        assert not Path(f"{db}-wal").exists()
    finally:
        os.close(held)


async def test_a_hold_taken_before_start_is_let_go_by_stop(tmp_path: Path) -> None:
    """install_alerting holds the file from before start: a sidecar stopped without
    having started lets it go, so a next sidecar in the process may serve the file."""
    unstarted = Sidecar(settings_for(tmp_path))
    service = install_alerting(unstarted, AlertSettings(log_sink=False))
    await unstarted.stop()
    service.close()
    os.close(hold_file(tmp_path / "sidecar.db"))


@pytest.mark.parametrize("opener", [SqliteStore, SqliteAlertStore])
def test_a_file_that_is_no_database_is_named_with_what_to_do(
    tmp_path: Path, opener: type[SqliteStore] | type[SqliteAlertStore]
) -> None:
    """A file that is not SQLite (a wrong --db, a damaged disk) is not mended by a
    writable path or a local disk, which the message said to check."""
    db = tmp_path / "sidecar.db"
    db.write_bytes(b"not a database " * 300)
    with pytest.raises(StoreError) as info:
        opener(db)
    (line,) = str(info.value).splitlines()
    assert repr(str(db)) in line and "not a SQLite database" in line
    assert "move it aside" in line and "restore a backup" in line
    assert "writable" not in line and "network" not in line
