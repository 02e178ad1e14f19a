"""`saga-otel`: every expected mistake is one line naming the fix, with its exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from saga_otel import RetryPolicy, Saga, configure, tool
from saga_otel._cli import EXIT_ERROR, EXIT_NOTHING_TO_DO, EXIT_REFUSED, main
from saga_otel._state import STATE
from saga_otel.testing import start_sidecar

ROOT = Path(__file__).resolve().parents[2]
SAGA_OTEL = str(Path(sys.executable).parent / "saga-otel")
REGISTRY = ["--tools", "examples.demo_tools:registry"]


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SAGA_OTEL, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": "/usr/bin:/bin",
            "SAGA_OTEL_LOG_LEVEL": "error",
            "SAGA_DEMO_WORLD": "http://127.0.0.1:9",
            **env,
        },
    )


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["recover", "r1"], "--tools is required"),
        (["recover", "r1", "--tools", "examples.world:World"], "is a World, not a ToolRegistry"),
        (["recover", "r1", "--tools", "no_such_module:x"], "cannot load 'no_such_module:x'"),
        (["recover", "r1", "--tools", "examples.demo_tools"], "is not MODULE:NAME"),
        (
            ["recover", "r1", "--tools", "examples.demo_tools:registry", "--force"],
            "--force needs --reason",
        ),
        (["recover", "r1", "--lease-ttl", "0"], "--lease-ttl"),
        (["recover"], "the following arguments are required: RUN_ID"),
        (["rescue", "r1"], "invalid choice: 'rescue'"),
        (
            ["recover", "r1", *REGISTRY, "--sidecar", "127.0.0.1:1"],
            "is not the sidecar's URL: give the scheme and address",
        ),
        (
            ["recover", "r1", *REGISTRY, "--sidecar", "http://127.0.0.1:9"],
            "cannot reach the sidecar at http://127.0.0.1:9",
        ),
    ],
)  # fmt: skip
def test_each_mistake_is_one_line_naming_the_fix(args: list[str], expect: str) -> None:
    done = run(*args)
    assert done.returncode == EXIT_ERROR, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert expect in lines[0] and "Traceback" not in done.stderr
    # It names a flag (the fix), never a Python parameter.
    assert "sidecar=" not in lines[0] and "tools=" not in lines[0]


def test_a_registry_factory_that_fails_is_one_line() -> None:
    # examples.demo_tools:registry needs SAGA_DEMO_WORLD; without it, it raises.
    done = run("recover", "r1", "--tools", "examples.demo_tools:registry", SAGA_DEMO_WORLD="")
    assert done.returncode == EXIT_ERROR and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert (
        "the factory 'examples.demo_tools:registry' failed: RuntimeError: set SAGA_DEMO_WORLD"
        in line
    )


def test_help_and_version() -> None:
    assert run("--version").stdout.startswith("saga-otel ")
    for args in (["-h"], ["recover", "-h"]):
        done = run(*args)
        assert done.returncode == 0 and "usage: saga-otel" in done.stdout
    assert "exit codes:" in run("recover", "-h").stdout


def test_recover_takes_any_unique_prefix_of_a_run_id(tmp_path: Path) -> None:
    @tool("read")
    def look(n: int) -> int:
        return n

    with start_sidecar(tmp_path) as sc:
        export = configure(sc.otlp)
        try:
            saga = Saga("lookups", tools=[look], retry=RetryPolicy(attempts=1))
            for run_id in ("prefix-run-aaa", "prefix-run-abb"):
                with saga.run_sync(run_id) as r:
                    r.call("look", n=1)
            assert export.force_flush(10.0)
        finally:
            export.shutdown()
        base = ["--tools", "examples.demo_tools:registry", "--sidecar", sc.api, "--otlp", sc.otlp]
        # A unique prefix names the run: it completed, so there is nothing to do (exit 4).
        done = run("recover", "prefix-run-aa", *base)
        assert done.returncode == EXIT_NOTHING_TO_DO, done.stdout + done.stderr
        assert "prefix-run-aaa" in done.stdout
        # An ambiguous one lists the candidates and runs nothing.
        done = run("recover", "prefix-run-a", *base)
        assert done.returncode == EXIT_ERROR
        assert "matches 2 runs (prefix-run-aaa, prefix-run-abb)" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


class _Answers(BaseHTTPRequestHandler):
    """Not the sidecar: what a proxy's login page or another service on the port answers.
    ``bad`` is (method, path prefix, content type, body); every other request is answered
    as the sidecar would, knowing one run, ``r1``: orphaned, nothing on its stack."""

    bad = ("", "", "", "")
    bad_status = 200

    def _answer(self) -> None:
        method, prefix, ctype, body = self.bad
        status = self.bad_status
        if self.command != method or not self.path.startswith(prefix):
            status = 200
            ctype = "application/json"
            if self.path.startswith("/runs?"):
                body = '{"runs": [{"run_id": "r1"}], "next_cursor": null}'
            elif self.path.startswith("/runs/r1"):
                body = '{"status": "orphaned"}'
            else:
                status, body = 404, '{"error": "no such run"}'
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def not_a_sidecar() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    _Answers.bad = ("", "", "", "")
    _Answers.bad_status = 200
    STATE.reset()  # main() configured the export path in this process


@pytest.mark.parametrize(
    ("route", "ctype", "body", "expect"),
    [
        (("GET", "/runs?"), "text/html", "<html>proxy login</html>", "not JSON"),
        (("GET", "/runs?"), "application/json", '{"runs": [{"id": "r1"}]}', '"runs" is not'),
        (("GET", "/runs/r1"), "application/json", "[]", "JSON array, not an object"),
        (("GET", "/runs/r1"), "application/json", '{"status": "orphaned", "stack": [{}]}',
         "not a compensation record"),
        (("POST", "/runs/r1/lease"), "application/json", '{"ok": true}', '"token" is None'),
        (("POST", "/runs/r1/lease"), "application/json", '{"token": "7"}', "\"token\" is '7'"),
    ],
)  # fmt: skip
def test_an_answer_unlike_the_sidecars_is_one_line_naming_the_url_and_the_fix(
    not_a_sidecar: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    route: tuple[str, str],
    ctype: str,
    body: str,
    expect: str,
) -> None:
    _Answers.bad = (*route, ctype, body)
    monkeypatch.setenv("SAGA_OTEL_LOG_LEVEL", "error")
    monkeypatch.setenv("SAGA_DEMO_WORLD", "http://127.0.0.1:9")
    code = main(["recover", "r", *REGISTRY, "--sidecar", not_a_sidecar, "--otlp",
                 "http://127.0.0.1:9"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_ERROR, err
    (line,) = err.strip().splitlines()
    assert f"{not_a_sidecar}{route[1]}" in line and "is not the sidecar's API" in line, line
    assert expect in line, line
    assert "--sidecar URL" in line and "API port" in line, line


HOSTILE = "\x1b]0;pwned\x07\x1b[2J\u202e"  # retitles and clears the terminal, reverses text
SHOWN = "\\x1b]0;pwned\\x07\\x1b[2J\\u202e"  # the same, as a person should see it


def test_recover_shows_a_holder_and_a_tool_from_outside_quoted_and_escaped(
    sidecar_process: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any API client names its lease holder, and an agent names its undo tools: both
    reached the terminal raw in `saga-otel recover`'s refusals, so the terminal obeyed
    their escape sequences. Now quoted (where a name begins and ends) and escaped."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from tests.sidecar.sidecar_testkit import RunScript

    monkeypatch.setenv("SAGA_OTEL_LOG_LEVEL", "error")
    monkeypatch.setenv("SAGA_DEMO_WORLD", "http://127.0.0.1:9")
    sc = sidecar_process()
    held = RunScript().do(0, "issue_credit", comp=("reverse_credit", {"credit_id": "c"}, "u"))
    foreign = RunScript().do(0, "issue_credit", comp=(f"undo{HOSTILE}", {"a": 1}, "u"))
    exporter = OTLPSpanExporter(endpoint=f"{sc.otlp}/v1/traces", timeout=10)
    try:
        exporter.export(held.spans() + foreign.spans())
    finally:
        exporter.shutdown()
    holder = f"ops{HOSTILE}host:1"
    grant = {"holder": holder, "ttl_s": 600, "force": True, "reason": "audit"}
    assert httpx.post(f"{sc.api}/runs/{held.run_id}/lease", json=grant).status_code == 200
    options = [*REGISTRY, "--sidecar", sc.api, "--otlp", sc.otlp, "--force", "--reason", "t"]
    try:
        assert main(["recover", held.run_id, *options]) == EXIT_REFUSED
        err = capsys.readouterr().err
        assert "\x1b" not in err and "\u202e" not in err and "\x07" not in err, repr(err)
        assert f"is being recovered by 'ops{SHOWN}host:1' (lease token 1" in err, err
        assert main(["recover", foreign.run_id, *options]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert "\x1b" not in err and "\u202e" not in err and "\x07" not in err, repr(err)
        assert f"needs the tools 'undo{SHOWN}', which the given registry lacks" in err, err
    finally:
        STATE.reset()  # main() configured the export path in this process


def test_every_line_saga_otel_prints_is_escaped_whatever_its_source(
    not_a_sidecar: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal's text comes from the sidecar (or whatever answers on its port): shown
    with escapes, not only where a message quotes a name."""
    refusal = {"error": f"held by {HOSTILE}x", "reason": "held", "holder": HOSTILE}
    _Answers.bad = ("POST", "/runs/r1/lease", "application/json", json.dumps(refusal))
    _Answers.bad_status = 409
    monkeypatch.setenv("SAGA_OTEL_LOG_LEVEL", "error")
    monkeypatch.setenv("SAGA_DEMO_WORLD", "http://127.0.0.1:9")
    code = main(["recover", "r", *REGISTRY, "--sidecar", not_a_sidecar, "--otlp",
                 "http://127.0.0.1:9"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == EXIT_REFUSED, err
    assert "\x1b" not in out + err and "\u202e" not in out + err, repr(err)
    assert f"saga-otel: recovery refused: held by {SHOWN}x" in err, err


def test_a_run_id_that_begins_with_a_dash_goes_after_double_dash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    @tool("read")
    def look(n: int) -> int:
        return n

    monkeypatch.setenv("SAGA_OTEL_LOG_LEVEL", "error")
    monkeypatch.setenv("SAGA_DEMO_WORLD", "http://127.0.0.1:9")
    try:
        with start_sidecar(tmp_path) as sc:
            export = configure(sc.otlp)
            try:
                saga = Saga("lookups", tools=[look], retry=RetryPolicy(attempts=1))
                with saga.run_sync("-x1") as r:
                    r.call("look", n=1)
                assert export.force_flush(10.0)
            finally:
                export.shutdown()
            options = [*REGISTRY, "--sidecar", sc.api, "--otlp", sc.otlp]
            assert main(["recover", *options, "--", "-x1"]) == EXIT_NOTHING_TO_DO
            assert "run '-x1' is completed" in capsys.readouterr().out
            # Before '--', the id is taken for an option: the error says where it goes.
            with pytest.raises(SystemExit) as exited:
                main(["recover", "-x1", *options])
            assert exited.value.code == EXIT_ERROR
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert "a run id that begins with '-' goes last, after '--'" in line
    finally:
        STATE.reset()
    with pytest.raises(SystemExit):
        main(["recover", "-h"])
    assert "after '--': saga-otel recover --tools MODULE:NAME -- -RUN" in " ".join(
        capsys.readouterr().out.split()
    )


def test_a_recovery_report_shows_what_the_agent_sent_as_escapes_never_obeyed() -> None:
    """The report quotes the undos' descriptions (the agent's text, via the sidecar) and
    what the undos raised: a terminal control sequence in them is shown, not run."""
    from saga_otel._cli import report_text
    from saga_otel.testing import capture

    @tool("compensable", compensate="reverse_credit", describe="reverse \x1b[2J\u202ecr_1")
    def issue_credit() -> str:
        return "cr_1"

    @tool("convergent", retry=RetryPolicy(attempts=1))
    def reverse_credit(**_: Any) -> None:
        raise RuntimeError("ledger \x1b]0;pwned\x07 down")

    saga = capture().saga("refund", tools=[issue_credit, reverse_credit])
    with pytest.raises(RuntimeError), saga.run_sync() as run:
        run.call("issue_credit")
        raise RuntimeError("the reply failed")
    assert run.report is not None
    text = report_text(run.report)
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "reverse \\x1b[2J\\u202ecr_1" in text and "ledger \\x1b]0;pwned\\x07 down" in text
    assert text.count("\n") >= 4  # the card keeps its lines
