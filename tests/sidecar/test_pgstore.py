"""`--db` picks the backend; a bad or unreachable database is one line; the password never shows."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import psycopg
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from pg_server import PgServer
from sidecar_testkit import compensation_failed_run, open_run

from sidecar._errors import ConfigError
from sidecar._pgstore import CONNECTIONS_EACH, connect_error
from sidecar._storage import parse_db, redact_url

SERVE = [sys.executable, "-c", "from sidecar._cli import main; main()", "serve"]
PORTS = ["--otlp-http-port", "0", "--otlp-grpc-port", "0", "--api-port", "0"]


def _serve(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SERVE, *PORTS, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("text", "backend"),
    [
        ("state/sidecar.db", "sqlite"),
        ("sqlite:///var/lib/saga/sidecar.db", "sqlite"),
        ("postgresql://saga@db.internal:5432/saga", "postgresql"),
        ("postgres://saga:pw@db.internal/saga", "postgresql"),
    ],
)
def test_db_forms_pick_the_backend(text: str, backend: str) -> None:
    target = parse_db(text)
    assert target.backend == backend
    if backend == "sqlite":
        assert target.path is not None and str(target.path).endswith("sidecar.db")
        assert not str(target.path).startswith(("sqlite:", "postgres"))


@pytest.mark.parametrize("text", ["mysql://h/db", "http://h/x", "postgresql:/db", "sqlite://x"])
def test_other_schemes_are_one_line_naming_the_forms(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_db(text)
    (line,) = str(info.value).splitlines()
    assert "sqlite:///PATH" in line and "postgresql://" in line


def test_the_password_is_masked_wherever_the_url_is_shown() -> None:
    url = "postgresql://saga:s3cret@h:5432/db?sslmode=require&password=s3cret"
    shown = redact_url(url)
    assert "s3cret" not in shown and "saga:***@h:5432/db" in shown
    assert "s3cret" not in repr(parse_db(url)) and "s3cret" not in str(parse_db(url))


def test_an_unsupported_scheme_is_an_error_and_creates_no_file(tmp_path: Path) -> None:
    out = _serve("--db", "postgresql:/saga", cwd=tmp_path)
    assert out.returncode != 0
    (line,) = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr and "postgresql://USER@HOST" in line
    assert list(tmp_path.iterdir()) == []  # no postgresql:/ folder, no SQLite file


def test_an_unreachable_database_is_one_line_naming_the_host(tmp_path: Path) -> None:
    # Nothing listens on port 1 of loopback.
    out = _serve("--db", "postgresql://saga:hunter2-secret@127.0.0.1:1/saga", cwd=tmp_path)
    assert out.returncode != 0
    (line,) = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr
    assert "cannot connect to PostgreSQL at 127.0.0.1:1/saga" in line
    assert "refused" in line.lower()
    assert "hunter2-secret" not in out.stderr + out.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_server_out_of_connections_is_told_to_raise_max_connections() -> None:
    """A server with "too many clients already" is full: not a wrong URL, nor down."""
    server = 'connection to server at "127.0.0.1", port 5432 failed: FATAL:  sorry, '
    exc = psycopg.OperationalError(f"connection failed: {server}too many clients already")
    (line,) = str(connect_error(parse_db("postgresql://saga@127.0.0.1/saga"), exc)).splitlines()
    assert "too many clients already" in line and "max_connections" in line
    assert f"up to {CONNECTIONS_EACH} connections" in line and "server is up" not in line
    scaling = (Path(__file__).parents[2] / "docs" / "scaling.md").read_text()
    assert f"holds up to {CONNECTIONS_EACH} connections" in " ".join(scaling.split())


def test_a_role_at_its_connection_limit_is_one_line_naming_the_limit(
    tmp_path: Path, postgres: PgServer
) -> None:
    role = f"capped_{os.getpid()}"
    with psycopg.connect(postgres.url(), autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'capped-pw' CONNECTION LIMIT 0")
    try:
        url = f"postgresql://{role}:capped-pw@127.0.0.1:{postgres.port}/postgres"
        out = _serve("--db", url, cwd=tmp_path)
        assert out.returncode != 0
        (line,) = out.stderr.strip().splitlines()
        assert "Traceback" not in out.stderr
        assert "too many connections for role" in line and "CONNECTION LIMIT" in line
        assert "server is up" not in line and "capped-pw" not in out.stderr
    finally:
        with psycopg.connect(postgres.url(), autocommit=True) as admin:
            admin.execute(f"DROP ROLE {role}")


def test_a_wrong_password_is_one_line_without_the_password(
    tmp_path: Path, postgres: PgServer
) -> None:
    url = postgres.url().replace(postgres.password, "wrong-pass-987")
    out = _serve("--db", url, cwd=tmp_path)
    assert out.returncode != 0
    (line,) = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr
    assert f"127.0.0.1:{postgres.port}/postgres" in line and "password" in line.lower()
    assert "wrong-pass-987" not in out.stderr + out.stdout


def test_saga_sidecar_db_selects_postgresql_and_the_password_never_shows(
    tmp_path: Path, postgres: PgServer
) -> None:
    """Spans and alerts land in PostgreSQL; nothing printed, logged or served has the password."""
    name = postgres.create()
    try:
        url = postgres.url(name)
        proc = subprocess.Popen(
            [*SERVE, *PORTS, "--log-level", "DEBUG"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "SAGA_SIDECAR_DB": url, "XDG_STATE_HOME": str(tmp_path)},
        )
        try:
            assert proc.stdout is not None
            listening = json.loads(proc.stdout.readline())
            assert listening["db"] == f"postgresql://saga:***@127.0.0.1:{postgres.port}/{name}"
            run, failed = open_run(), compensation_failed_run()
            exporter = OTLPSpanExporter(
                endpoint=f"http://127.0.0.1:{listening['otlp_http']}/v1/traces", timeout=10
            )
            assert exporter.export(run.spans() + failed.spans()) is SpanExportResult.SUCCESS
            api = f"http://127.0.0.1:{listening['api']}"
            served = [
                httpx.get(f"{api}/metrics").text,
                httpx.get(f"{api}/runs").text,
                httpx.get(f"{api}/runs/{failed.run_id}").text,
                httpx.get(f"{api}/ui/runs/{failed.run_id}").text,
            ]
        finally:
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
        with psycopg.connect(url) as conn:
            (spans,) = conn.execute("SELECT count(*) FROM spans").fetchone() or (0,)
            (alerts,) = conn.execute("SELECT count(*) FROM alert_outbox").fetchone() or (0,)
        assert spans == len(run.spans()) + len(failed.spans())
        assert alerts >= 1  # the failed compensation paged (the log sink)
        assert not (tmp_path / "saga-sidecar").exists()  # no SQLite file on the side
        everything = "\n".join([stdout, stderr, *served])
        assert postgres.password not in everything
    finally:
        postgres.drop(name)


async def test_losing_the_database_is_503_with_retry_after_then_heals(
    tmp_path: Path, postgres: PgServer
) -> None:
    """Never a 200 without the commit; no restart needed once the database is back."""
    from sidecar_testkit import FakeClock, settings_for

    from sidecar import Sidecar

    name = postgres.create()
    admin = psycopg.connect(postgres.url(), autocommit=True)
    try:
        settings = settings_for(tmp_path, db_url=postgres.url(name), db_path=None)
        async with Sidecar(settings, clock=FakeClock()) as sidecar:
            url = f"http://127.0.0.1:{sidecar.otlp_http_port}/v1/traces"
            first, second = open_run(), open_run()

            def body(run: Any) -> bytes:
                return encode_spans(run.spans()).SerializeToString()

            headers = {"Content-Type": "application/x-protobuf"}
            async with httpx.AsyncClient(timeout=30) as client:
                ok = await client.post(url, content=body(first), headers=headers)
                assert ok.status_code == 200
                # The database goes away: no new connection, the open ones cut.
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (name,),
                )
                down = await client.post(url, content=body(second), headers=headers)
                assert down.status_code == 503 and down.headers["Retry-After"]
                assert postgres.password not in down.text
                assert second.run_id not in sidecar.state  # not folded: not stored
                # The same over gRPC: UNAVAILABLE (an exporter retries it), nothing folded.
                target = f"127.0.0.1:{sidecar.otlp_grpc_port}"
                async with grpc.aio.insecure_channel(target) as channel:
                    export = channel.unary_unary(
                        "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await export(body(second), timeout=30)
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
                assert postgres.password not in (refused.value.details() or "")
                assert second.run_id not in sidecar.state
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
                for _ in range(100):  # the pool reconnects by itself
                    again = await client.post(url, content=body(second), headers=headers)
                    if again.status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                assert again.status_code == 200
                assert second.run_id in sidecar.state
        with psycopg.connect(postgres.url(name)) as conn:
            rows = conn.execute("SELECT DISTINCT run_id FROM spans").fetchall()
        assert {r for (r,) in rows} == {first.run_id, second.run_id}
    finally:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.close()
        postgres.drop(name)


def test_the_fixture_finds_debians_server_programs_off_the_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh Debian has initdb/pg_ctl only under /usr/lib/postgresql/VERSION/bin."""
    import glob
    import shutil

    import pg_server

    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    assert pg_server.pg_bin("initdb").startswith("/usr/lib/postgresql/")
    monkeypatch.setattr(glob, "glob", lambda *a, **k: [])
    with pytest.raises(AssertionError, match="scripts/debian-deps"):
        pg_server.pg_bin("pg_ctl")
