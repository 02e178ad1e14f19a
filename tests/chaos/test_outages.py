"""Outages: an alert sink down for a while, and the sidecar killed under load.

SAGA_CHAOS_OUTAGE_S sets how long the sink stays down (default 30 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from support import (
    AlertReceiver,
    SidecarProcess,
    resent_cut_by_the_kill,
    restart_port,
    start_sidecar,
    wait_until,
)

from examples.world import World
from examples.world_server import serve_world

sys.path.insert(0, str(Path(__file__).parents[1] / "sidecar"))
from sidecar_testkit import open_run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
OUTAGE = float(os.environ.get("SAGA_CHAOS_OUTAGE_S", "30"))


@pytest.fixture
def world() -> Iterator[tuple[World, str]]:
    w = World(mail_down=True)
    server, url = serve_world(w)
    yield w, url
    server.shutdown()


def agent(sc_otlp: str, world_url: str, runs: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "examples.demo_agent", "--world", world_url, "--otlp", sc_otlp,
         "--runs", str(runs)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "SAGA_OTEL_LOG_LEVEL": "ERROR"},
    )  # fmt: skip


def test_a_sink_down_for_a_while_gets_every_alert_once(
    tmp_path: Path, sidecar_process: Any, world: tuple[World, str], chaos_results: dict[str, Any]
) -> None:
    pager = AlertReceiver(start=False)  # the sink is down from the start
    sc = sidecar_process("--webhook", pager.url)
    proc = agent(sc.otlp, world[1], runs=5)
    out, _ = proc.communicate(timeout=120)
    runs = [json.loads(line)["run_id"] for line in out.splitlines()]
    assert len(runs) == 5
    time.sleep(OUTAGE)  # the pager is down all this while; the sidecar keeps retrying
    back = time.monotonic()
    pager.start()
    try:
        expected = {
            (f"saga-otel/SagaCompensationStarted/{r}", s)
            for r in runs
            for s in ("firing", "resolved")
        }
        wait_until(lambda: expected <= set(pager.keys()), timeout=120, what="every alert")
        keys = pager.keys()
        assert set(keys) == expected
        assert all(n == 1 for n in keys.values()), keys  # once per dedup key and status
        with pager.lock:
            order = [(a["dedup_key"], a["status"]) for a in pager.alerts]
        for r in runs:  # a resolve never overtakes its fire
            key = f"saga-otel/SagaCompensationStarted/{r}"
            assert order.index((key, "firing")) < order.index((key, "resolved"))
        chaos_results["sink_outage"] = {
            "outage_s": OUTAGE,
            "alerts_expected": len(expected),
            "alerts_delivered": sum(keys.values()),
            "duplicates": sum(n - 1 for n in keys.values()),
            "delivered_within_s_of_return": round(time.monotonic() - back, 1),
        }
    finally:
        pager.stop()


def test_sidecar_killed_under_load_loses_no_acknowledged_span(
    tmp_path: Path,
    world: tuple[World, str],
    chaos_results: dict[str, Any],
    db_backend: str | None,
) -> None:
    pager = AlertReceiver()
    ports = [str(restart_port()) for _ in range(3)]
    args = ("--otlp-http-port", ports[0], "--otlp-grpc-port", ports[1], "--api-port", ports[2])
    first = start_sidecar(tmp_path, "--webhook", pager.url, *args, db=db_backend)
    second: SidecarProcess | None = None
    proc = agent(first.otlp, world[1], runs=40)
    try:
        assert proc.stdout is not None
        seen: list[dict[str, Any]] = []
        for line in proc.stdout:
            if line.startswith('{"run_id"'):
                seen.append(json.loads(line))
            if len(seen) == 12:
                break
        # Runs the sidecar acknowledged before the kill.
        before = [r["run_id"] for r in seen]
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        time.sleep(1.0)  # the agent keeps going; its exports fail and are retried
        # Alerts received before this were sent by the killed sidecar (the receiver may
        # read one sent just before the kill a little after it: not the kill's moment).
        restarted_at = time.time()
        second = start_sidecar(tmp_path, "--webhook", pager.url, *args, db=first.db)
        rest, _ = proc.communicate(timeout=180)
        noise = [line for line in rest.splitlines() if not line.startswith('{"run_id"')]
        seen += [json.loads(line) for line in rest.splitlines() if line not in noise]
        assert noise == [], noise
        assert proc.returncode == 0
        assert len(seen) == 40

        def view(run_id: str) -> dict[str, Any]:
            resp = httpx.get(f"{second.api}/runs/{run_id}", timeout=5)
            return resp.json() if resp.status_code == 200 else {}

        for run_id in before:  # acknowledged before the kill: on disk, nothing lost
            v = view(run_id)
            assert v.get("status") == "compensated", v
            assert v["stack"] == []
        # Everything else arrives too, from the agent's retrying exporter.
        for r in seen:
            wait_until(
                lambda r=r: view(r["run_id"]).get("status") == r["status"],
                timeout=60,
                what=f"run {r['run_id']} {r['status']}",
            )
        # No alert paged twice, across the crash and the restart's re-evaluation, but
        # the one send the kill may have cut between the receiver's accept and the mark.
        wait_until(lambda: len(pager.keys()) >= 2 * len(before), timeout=60, what="alerts")
        time.sleep(1.0)  # let the restarted outbox finish anything it still holds
        twice = resent_cut_by_the_kill(pager, restarted_at)
        chaos_results["sidecar_kill" if db_backend is None else "sidecar_kill_postgresql"] = {
            "runs": len(seen),
            "acknowledged_before_kill": len(before),
            "lost": 0,
            "alerts_delivered": sum(pager.keys().values()),
            "resent_after_the_kill": len(twice),
        }
    finally:
        if proc.poll() is None:
            proc.kill()
        first.stop()
        if second is not None:
            second.stop()
        pager.stop()


class SilentSink:
    """A sink that accepts every connection, reads what is sent and never answers."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.connections: list[socket.socket] = []
        self.bytes_read = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.connections.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: Any) -> None:
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.bytes_read += len(data)

    def close(self) -> None:
        # shutdown() first: a bare close() leaves a socket open while a thread is
        # blocked in its accept() or recv().
        for sock in (self._listener, *self.connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_a_silent_sink_delays_only_its_own_alerts(
    sidecar_process: Any, world: tuple[World, str], chaos_results: dict[str, Any]
) -> None:
    """A sink that takes the connection and never answers (a hung proxy, a stopped VM)
    holds up its own deliveries only: the other sink gets every alert meanwhile, the
    agents are acknowledged, and once the silent one answers again it gets each alert
    once, each resolve after its fire."""
    silent = SilentSink()
    pager = AlertReceiver()
    # Each request to the silent sink waits out the whole timeout: longer than the wait
    # below for the other sink, so alerts queued behind it would never make that wait.
    sc = sidecar_process(
        "--webhook", silent.url, "--webhook", pager.url,
        "--alert-timeout", "120s", "--alert-retry-max", "2s",
    )  # fmt: skip
    proc = agent(sc.otlp, world[1], runs=4)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    runs = [json.loads(line)["run_id"] for line in out.splitlines()]
    assert len(runs) == 4
    expected = {
        (f"saga-otel/SagaCompensationStarted/{r}", s) for r in runs for s in ("firing", "resolved")
    }
    try:
        wait_until(lambda: expected <= set(pager.keys()), timeout=60, what="the other sink")
        assert all(n == 1 for n in pager.keys().values()), pager.keys()
        assert silent.bytes_read > 0, "the sidecar never tried the silent sink"
        assert len(silent.connections) <= 2, "one request at a time to a silent sink"
        # It answers again (on the same port): what it holds is delivered, once each.
        port = silent.port
        silent.close()
        back = AlertReceiver(port)
        try:
            wait_until(lambda: expected <= set(back.keys()), timeout=120, what="the silent sink")
            time.sleep(1.0)  # nothing more may come
            keys = back.keys()
            assert set(keys) == expected and all(n == 1 for n in keys.values()), keys
            with back.lock:
                order = [(a["dedup_key"], a["status"]) for a in back.alerts]
            for r in runs:
                key = f"saga-otel/SagaCompensationStarted/{r}"
                assert order.index((key, "firing")) < order.index((key, "resolved"))
            chaos_results["silent_sink"] = {
                "alerts": len(expected),
                "other_sink_delivered_while_silent": len(pager.keys()),
                "silent_sink_connections": len(silent.connections),
                "delivered_once_after_it_answered": sum(keys.values()),
            }
        finally:
            back.stop()
    finally:
        silent.close()
        pager.stop()


def _gauge(api: str, name: str) -> float:
    for line in httpx.get(f"{api}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_a_stalled_database_shows_on_healthz_and_metrics_and_loses_nothing(
    tmp_path: Path, postgres: Any, chaos_results: dict[str, Any]
) -> None:
    """PostgreSQL stops answering (its backends SIGSTOPped: a hung disk, a lock held by
    hand): the requests waiting for their commit show as the intake's age on /healthz
    and /metrics (saga_sidecar_intake_waiting_seconds, which the SagaSidecarIntakeStalled
    rule watches) while both still answer; once it answers again the waiting request is
    committed and acknowledged and the age is back to 0."""
    name = postgres.create()
    url = postgres.url(name)
    sc = start_sidecar(tmp_path, db=url)
    stopped: list[int] = []
    try:
        first, second = open_run(), open_run()

        def post(run: Any) -> int:
            return httpx.post(
                f"{sc.otlp}/v1/traces",
                content=encode_spans(run.spans()).SerializeToString(),
                headers={"Content-Type": "application/x-protobuf"},
                timeout=120,
            ).status_code

        assert post(first) == 200
        assert httpx.get(f"{sc.api}/healthz", timeout=5).json()["intake_waiting_s"] == 0
        with psycopg.connect(postgres.url(), autocommit=True) as conn:
            stopped = [
                int(pid)
                for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s", (name,)
                ).fetchall()
            ]
        assert stopped, "the sidecar holds no connection to its database"
        stopped_once = list(stopped)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        answers: list[int] = []
        sender = threading.Thread(target=lambda: answers.append(post(second)), daemon=True)
        sender.start()
        wait_until(
            lambda: _gauge(sc.api, "saga_sidecar_intake_waiting_seconds") > 2,
            timeout=60,
            what="the intake's wait on /metrics",
        )
        health = httpx.get(f"{sc.api}/healthz", timeout=5)
        assert health.status_code == 200 and health.json()["intake_waiting_s"] > 2
        shown = health.json()["intake_waiting_s"]
        assert answers == [], "answered while the database was stopped"
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped = []
        sender.join(120)
        assert answers == [200]
        wait_until(
            lambda: _gauge(sc.api, "saga_sidecar_intake_waiting_seconds") == 0,
            timeout=30,
            what="the gauge back to 0",
        )
        for run in (first, second):
            view = httpx.get(f"{sc.api}/runs/{run.run_id}", timeout=5).json()
            assert len(view["steps"]) == 2, view
        chaos_results["stalled_database"] = {
            "backends_stopped": len(stopped_once),
            "intake_waiting_s_shown": shown,
            "answer_after_resume": answers[0],
            "lost": 0,
        }
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        sc.stop()
        postgres.drop(name)


def test_a_replica_whose_database_stalls_is_not_ready_while_the_other_is(
    tmp_path: Path, postgres: Any, chaos_results: dict[str, Any]
) -> None:
    """Two replicas on one PostgreSQL database; only replica a's backends are SIGSTOPped
    (its connections hung: a network path, a backend stuck on a lock) while an agent's
    request waits at it for its commit. Replica a answers /readyz 503 naming the stall
    (a load balancer takes it out of rotation) and /healthz 200 (alive: a restart would
    drop the waiting request); replica b, which still commits, answers /readyz 200. Each
    reports its own intake. Once a's database answers, its request is acknowledged and
    /readyz is 200 again."""
    name = postgres.create()
    url = postgres.url(name)
    a = start_sidecar(tmp_path, "--ready-stall", "2s", db=f"{url}?application_name=saga-a")
    b = start_sidecar(tmp_path, "--ready-stall", "2s", db=f"{url}?application_name=saga-b")
    stopped: list[int] = []

    def post(sidecar: SidecarProcess, run: Any) -> int:
        return httpx.post(
            f"{sidecar.otlp}/v1/traces",
            content=encode_spans(run.spans()).SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
            timeout=120,
        ).status_code

    def ready(sidecar: SidecarProcess) -> httpx.Response:
        return httpx.get(f"{sidecar.api}/readyz", timeout=5)

    try:
        assert post(a, open_run()) == 200 and post(b, open_run()) == 200
        assert ready(a).status_code == 200 and ready(b).status_code == 200
        with psycopg.connect(postgres.url(), autocommit=True) as conn:
            stopped = [
                int(pid)
                for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s "
                    "AND application_name = 'saga-a'",
                    (name,),
                ).fetchall()
            ]
        assert stopped, "replica a holds no connection to its database"
        stopped_once = len(stopped)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        waiting = open_run()
        answers: list[int] = []
        sender = threading.Thread(target=lambda: answers.append(post(a, waiting)), daemon=True)
        sender.start()
        wait_until(lambda: ready(a).status_code == 503, timeout=60, what="a not ready")
        body = ready(a).json()
        assert body["status"] == "stalled" and body["reason"] == "intake_stalled", body
        assert body["intake_waiting_s"] > 2 and body["ready_stall_s"] == 2.0
        assert "--ready-stall" in body["fix"]
        health = httpx.get(f"{a.api}/healthz", timeout=5)
        assert health.status_code == 200 and health.json()["ready"] is False
        # The other replica still commits, and says so.
        assert post(b, open_run()) == 200
        other = ready(b)
        assert other.status_code == 200 and other.json()["status"] == "ready", other.text
        assert httpx.get(f"{b.api}/healthz", timeout=5).json()["ready"] is True
        assert answers == [], "answered while its database was stopped"
        shown = body["intake_waiting_s"]
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped = []
        sender.join(120)
        assert answers == [200]
        wait_until(lambda: ready(a).status_code == 200, timeout=30, what="a ready again")
        assert ready(a).json()["status"] == "ready"
        assert httpx.get(f"{a.api}/healthz", timeout=5).json()["ready"] is True
        wait_until(  # committed: the other replica reads it from the database
            lambda: httpx.get(f"{b.api}/runs/{waiting.run_id}", timeout=5).status_code == 200,
            timeout=30,
            what="the waiting run at b",
        )
        chaos_results["stalled_replica_readiness"] = {
            "backends_stopped": stopped_once,
            "stalled_readyz": f"503 {body['reason']} at {shown} s",
            "other_replica_readyz": other.status_code,
            "answer_after_resume": answers[0],
            "lost": 0,
        }
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        a.stop()
        b.stop()
        postgres.drop(name)
