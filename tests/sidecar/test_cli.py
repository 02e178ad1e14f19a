"""`saga-sidecar runs ...` against an in-process sidecar's API."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner, Result
from sidecar_testkit import (
    BOTH_BACKENDS,
    STEERING_SAGA,
    RunScript,
    compensation_failed_run,
    completed_run,
    export_http,
    steering,
    steering_run,
    stuck_run,
)

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar import _cli as cli_module
from sidecar._cli import main

pytestmark = BOTH_BACKENDS


async def cli(sidecar: Sidecar, *args: str, **env: str) -> Result:
    api = f"http://127.0.0.1:{sidecar.api_port}"
    return await asyncio.to_thread(
        CliRunner().invoke, main, list(args), env={"SAGA_SIDECAR_API": api, **env}
    )


async def test_runs_commands(sidecar: Sidecar) -> None:
    failed, stuck, done = compensation_failed_run(), stuck_run(), completed_run()
    await export_http(sidecar, failed.spans() + stuck.spans() + done.spans())

    result = await cli(sidecar, "runs", "list", "--json")
    assert result.exit_code == 0, result.output
    assert {r["run_id"] for r in json.loads(result.output)["runs"]} == {
        failed.run_id,
        stuck.run_id,
        done.run_id,
    }
    result = await cli(sidecar, "runs", "list", "--needs-person")
    assert result.exit_code == 0
    assert stuck.run_id[:8] in result.output and done.run_id[:8] not in result.output

    result = await cli(sidecar, "runs", "stack", failed.run_id, "--json")
    assert result.exit_code == 0
    body: dict[str, Any] = json.loads(result.output)
    assert body["status"] == sc.STATUS_COMPENSATION_FAILED
    assert [i["tool"] for i in body["stack"]] == ["reverse_credit"]

    result = await cli(sidecar, "runs", "show", failed.run_id)
    assert result.exit_code == 0
    assert "UNWIND (reverse order)" in result.output and "✗ #1 issue_credit" in result.output

    result = await cli(sidecar, "runs", "resolve", stuck.run_id, "--note", "closed by hand")
    assert result.exit_code == 0 and "closed by hand" in result.output
    view = sidecar.state.view(stuck.run_id)
    assert view is not None and view["resolution"]["note"] == "closed by hand"


async def test_cli_errors_are_messages(sidecar: Sidecar) -> None:
    result = await cli(sidecar, "runs", "show", "no-such-run")
    assert result.exit_code == 1
    assert "no run 'no-such-run'" in result.output
    result = await cli(sidecar, "runs", "list", SAGA_SIDECAR_API="http://127.0.0.1:9")
    assert result.exit_code == 1
    assert "cannot reach the sidecar API" in result.output


async def test_resolve_keeps_the_first_note_and_replaces_it_only_when_asked(
    sidecar: Sidecar,
) -> None:
    """Alice resolved the run on its page; Bob's `runs resolve` replaced her note (the
    page promises the second sees the first's). Now it is refused, showing hers."""
    run = compensation_failed_run()
    await export_http(sidecar, run.spans())
    alice = "Alice: reversed cr_1 by hand \x1b]0;pwned\x07"
    page = f"http://127.0.0.1:{sidecar.api_port}/ui/runs/{run.run_id}/resolve"
    async with (
        aiohttp.ClientSession() as s,
        s.post(page, data={"note": alice}, allow_redirects=False) as resp,
    ):
        assert resp.status == 303
    result = await cli(sidecar, "runs", "resolve", run.run_id[:8], "--note", "Bob: no-op")
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"Error: run {run.run_id[:8]} is already resolved; your note was not saved."
    assert lines[1].startswith("  resolved ") and "ago): Alice: reversed cr_1 by hand" in lines[1]
    assert "\x1b" not in result.output and "\\x1b]0;pwned\\x07" in lines[1], lines[1]
    assert lines[2] == "  your note: Bob: no-op"
    assert lines[3] == (
        f"  to put yours in its place: saga-sidecar runs resolve {run.run_id[:8]} "
        "--note 'Bob: no-op' --replace"
    )
    view = sidecar.state.view(run.run_id)
    assert view is not None and view["resolution"] is not None
    assert view["resolution"]["note"] == alice
    # The same note again (a retry) is no conflict.
    result = await cli(sidecar, "runs", "resolve", run.run_id, "--note", alice)
    assert result.exit_code == 0, result.output
    result = await cli(sidecar, "runs", "resolve", run.run_id, "--note", "Bob: no-op", "--replace")
    assert result.exit_code == 0, result.output
    view = sidecar.state.view(run.run_id)
    assert view is not None and view["resolution"] is not None
    assert view["resolution"]["note"] == "Bob: no-op"


async def test_resolve_says_who_by_default_the_login_name(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`runs resolve` sends --by, by default the login name; --by '' or a login name
    that cannot be found sends none (nothing made up). The name is printed escaped by
    `resolve`, `show` and the refusal of a second note, which repeats --by."""
    runs = {k: stuck_run(run_id=f"run-{k}") for k in ("login", "given", "none", "unknown")}
    await export_http(sidecar, [s for r in runs.values() for s in r.spans()])

    async def resolve(key: str, *args: str) -> str:
        result = await cli(sidecar, "runs", "resolve", f"run-{key}", "--note", "n", *args,
                           LOGNAME="carol", COLUMNS="200")  # fmt: skip
        assert result.exit_code == 0, result.output
        return result.output

    def by(key: str) -> object:
        view = sidecar.state.view(f"run-{key}")
        assert view is not None and view["resolution"] is not None
        return view["resolution"]["by"]

    assert await resolve("login") == f"resolved run-login ({sc.STATUS_STUCK}) by carol: n\n"
    assert by("login") == "carol"
    hostile = "Eve\x1b]0;pwned\x07\u202e"
    out = await resolve("given", "--by", hostile)
    assert by("given") == hostile
    assert steering(out) == [] and "by Eve\\x1b]0;pwned\\x07\\u202e: n" in out, out
    assert await resolve("none", "--by", "") == f"resolved run-none ({sc.STATUS_STUCK}): n\n"
    assert by("none") is None

    def nameless() -> str:
        raise OSError("no such user")  # what getuser raises for a uid with no name

    monkeypatch.setattr(cli_module.getpass, "getuser", nameless)
    await resolve("unknown")
    assert by("unknown") is None
    monkeypatch.undo()

    shown = await cli(sidecar, "runs", "show", "run-given", COLUMNS="200")
    assert shown.exit_code == 0, shown.output
    assert steering(shown.output) == [], shown.output
    assert "by Eve\\x1b]0;pwned\\x07\\u202e: n" in shown.output
    refused = await cli(sidecar, "runs", "resolve", "run-login", "--note", "other", "--by", "dan")
    assert refused.exit_code == 1, refused.output
    lines = refused.output.splitlines()
    assert lines[1].startswith("  resolved ") and lines[1].endswith("ago) by carol: n"), lines
    assert lines[3].endswith("--note other --by dan --replace"), lines


async def test_ids_and_undo_args_are_never_cut(sidecar: Sidecar) -> None:
    """At 80 columns the list keeps whole run ids; piped, `show` keeps whole undo arguments."""
    runs = [compensation_failed_run(), stuck_run(), completed_run()]
    await export_http(sidecar, [s for r in runs for s in r.spans()])
    result = await cli(sidecar, "runs", "list", COLUMNS="80")
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    for r in runs:
        assert r.run_id in result.output
    # CliRunner's stdout is not a terminal: the piped case.
    result = await cli(sidecar, "runs", "show", runs[0].run_id)
    assert result.exit_code == 0
    stack = json.loads((await cli(sidecar, "runs", "stack", runs[0].run_id, "--json")).output)
    for comp in stack["stack"]:
        for value in comp["args"].values():
            assert json.dumps(value) in result.output


async def test_any_unique_prefix_names_a_run_and_an_ambiguous_one_lists_candidates(
    sidecar: Sidecar,
) -> None:
    a = stuck_run(run_id="abc123" + "0" * 26)
    b = stuck_run(run_id="abc124" + "0" * 26)
    await export_http(sidecar, a.spans() + b.spans())
    for command in (["show"], ["stack"], ["resolve", "--note", "seen"]):
        result = await cli(sidecar, "runs", command[0], "abc123", *command[1:])
        assert result.exit_code == 0, result.output
        assert a.run_id in result.output
    result = await cli(sidecar, "runs", "show", "abc12")
    assert result.exit_code == 1
    assert "matches 2 runs" in result.output and a.run_id in result.output
    assert b.run_id in result.output and "give more characters" in result.output
    result = await cli(sidecar, "runs", "stack", "zzz")
    assert result.exit_code == 1 and "no run id starts with it" in result.output


async def test_a_prefix_past_one_page_of_runs_says_more_than_a_page(
    sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One page of the prefix lookup is 1,000 runs; 2 here, so three runs are past it.
    monkeypatch.setattr(cli_module, "PREFIX_PAGE", 2)
    runs = [stuck_run(run_id=f"job-{n}" + "0" * 20) for n in (1, 2, 3)]
    await export_http(sidecar, [s for r in runs for s in r.spans()])
    result = await cli(sidecar, "runs", "show", "job-")
    assert result.exit_code == 1
    assert "matches more than 2 runs" in result.output, result.output


async def test_show_prints_local_times_with_age_and_the_card_as_text(sidecar: Sidecar) -> None:
    failed = compensation_failed_run()
    await export_http(sidecar, failed.spans())
    result = await cli(sidecar, "runs", "show", failed.run_id[:10])
    assert result.exit_code == 0, result.output
    # ISO-8601 with the machine's offset, then how long ago.
    assert re.search(
        r"started \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d \(\d+d \d+h ago\)", result.output
    )
    view = sidecar.state.view(failed.run_id)
    assert view is not None and view["escalation"] is not None
    assert "needs a person" in result.output and "You must decide:" in result.output
    assert '"decide"' not in result.output  # text for a person, not the JSON
    as_json = await cli(sidecar, "runs", "show", failed.run_id, "--json")
    assert json.loads(as_json.output)["escalation"]["card"] == view["escalation"]["card"]


async def test_version_help_and_log_level_spelling(sidecar: Sidecar) -> None:
    result = await cli(sidecar, "--version")
    assert result.exit_code == 0 and result.output.startswith("saga-sidecar, version ")
    for args in (["-h"], ["runs", "-h"], ["runs", "show", "-h"], ["serve", "-h"]):
        result = await cli(sidecar, *args)
        assert result.exit_code == 0 and "Usage:" in result.output, args
    result = await cli(sidecar, "serve", "--log-level", "warp")
    assert result.exit_code == 2 and "'warp' is not one of" in result.output


async def test_api_address_mistakes_are_one_line(sidecar: Sidecar) -> None:
    for api, expect in (
        ("127.0.0.1:4320", "is not a URL: give the scheme and address"),
        ("http://127.0.0.1:9", "cannot reach the sidecar API at http://127.0.0.1:9"),
    ):
        result = await cli(sidecar, "runs", "list", "--api", api)
        assert result.exit_code == 1
        assert len(result.output.strip().splitlines()) == 1 and expect in result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize("flag", ["--otlp-http-port", "--otlp-grpc-port", "--api-port"])
def test_a_busy_port_on_any_transport_is_one_line(flag: str, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = {"--otlp-http-port": "0", "--otlp-grpc-port": "0", "--api-port": "0"}
        ports[flag] = str(busy.getsockname()[1])
        saga_sidecar = str(Path(sys.executable).parent / "saga-sidecar")
        argv = [saga_sidecar, "serve", "--db", str(tmp_path / "db")]
        argv += [x for kv in ports.items() for x in kv] + ["--log-level", "error"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot listen" in lines[0] and "free" in lines[0]


async def test_runs_list_never_cuts_ids_and_times_are_local_iso_with_age(sidecar: Sidecar) -> None:
    failed, stuck = compensation_failed_run(), stuck_run()
    await export_http(sidecar, failed.spans() + stuck.spans())
    # 80 columns, as a pipe or a small terminal gets.
    result = await cli(sidecar, "runs", "list", COLUMNS="80")
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80, result.output
    assert failed.run_id in result.output and stuck.run_id in result.output
    assert sc.STATUS_COMPENSATION_FAILED in result.output and "…" not in result.output
    view = sidecar.state.view(failed.run_id)
    assert view is not None and view["started_at"] is not None
    local = datetime.fromtimestamp(view["started_at"]).astimezone().isoformat(timespec="seconds")
    assert local in result.output and " ago" in result.output, result.output


async def test_needs_person_past_the_limit_says_so_and_the_cursor_lists_the_rest(
    sidecar: Sidecar,
) -> None:
    runs = [stuck_run(run_id=f"stuck-{i:02d}", t0=1_700_000_000.0 + i * 60) for i in range(52)]
    await export_http(sidecar, [s for r in runs for s in r.spans()])

    def rows(out: str) -> list[str]:
        return [line.split()[0] for line in out.splitlines() if line.lstrip().startswith("stuck-")]

    first = await cli(sidecar, "runs", "list", "--needs-person")
    assert first.exit_code == 0, first.output
    assert rows(first.stdout) == [f"stuck-{i:02d}" for i in range(51, 1, -1)]
    # The hint is on stderr alone: piped, stdout stays rows.
    assert "more runs" not in first.stdout
    found = re.search(r"more runs than --limit 50: .* --cursor (\S+) ", first.stderr)
    assert found, first.stderr
    rest = await cli(sidecar, "runs", "list", "--needs-person", "--cursor", found[1])
    assert rest.exit_code == 0, rest.output
    assert rows(rest.stdout) == ["stuck-01", "stuck-00"]
    assert rest.stderr == ""


async def test_what_an_agent_sent_is_printed_with_its_terminal_controls_escaped(
    sidecar: Sidecar,
) -> None:
    run = steering_run(run_id="run-ctl")
    await export_http(sidecar, run.spans())
    outputs = {}
    for command in (["show", "run-ctl"], ["stack", "run-ctl"], ["list"],
                    ["resolve", "run-ctl", "--note", "seen"]):  # fmt: skip
        result = await cli(sidecar, "runs", *command, COLUMNS="200")
        assert result.exit_code == 0, result.output
        assert steering(result.output) == [], (command, result.output)
        outputs[command[0]] = result.output
    assert "issue_credit\\x1b[2J\\x1b]0;pwned" in outputs["show"]
    assert "reverse_credit\\x1b[8m hidden" in outputs["show"]
    assert "Boom\\x1b[2K\\x0dfake: all good\\x9b31m" in outputs["show"]
    assert "reverse\\u2067 it\\x7f" in outputs["show"] and "credit\\x1b[1mid=" in outputs["show"]
    assert (
        "issue_credit\\x1b[2J" in outputs["stack"] and "reverse_credit\\x1b[8m" in outputs["stack"]
    )
    # Shown as sent, escaped: not taken as rich markup either.
    assert "refund[bold]\\u202egnp.exe" in outputs["list"]
    assert STEERING_SAGA.replace("\u202e", "\\u202e") in outputs["show"]


async def test_an_agents_escalation_reason_is_shown_as_text_not_rich_markup(
    sidecar: Sidecar,
) -> None:
    reason = "[/] [link=https://evil.example/]x[/link] :smile:"
    run = stuck_run(run_id="run-markup")
    run.escalate(reason, {"decide": ["look"]})
    await export_http(sidecar, run.spans())
    shown = await cli(sidecar, "runs", "show", "run-markup", COLUMNS="200", FORCE_COLOR="1")
    assert shown.exit_code == 0, shown.output
    assert f"ESCALATED: {reason}" in re.sub(r"\x1b\[[0-9;]*m", "", shown.output), shown.output
    assert "\x1b]8;" not in shown.output  # no hidden terminal hyperlink


async def test_a_newline_an_agent_sent_never_starts_a_line_of_its_own(sidecar: Sidecar) -> None:
    # Lines that read as the sidecar's own: a status under the real one, a stack header.
    fake = "\nrun ok (completed): 0 left\n"
    run = RunScript(run_id="run-lines", saga="refund\ncompleted\n(resolved)\n")
    comp = ("reverse_credit", {"credit_id": "cr_1"}, f"undo{fake}")
    run.do(0, f"issue_credit{fake}", "compensable", comp=comp)
    run.do(1, "notify", "compensable", ok=False, error=f"Boom{fake}")
    stack = [{"step": f"issue_credit{fake}", "index": 0, "tool": comp[0], "args": comp[1],
              "description": comp[2]}]  # fmt: skip
    run.unwind(f"Boom{fake}", "notify", stack)
    run.compensate(0, f"issue_credit{fake}", comp[0], comp[1], ok=False, error=f"No{fake}")
    run.end(sc.STATUS_COMPENSATION_FAILED, "notify")
    await export_http(sidecar, run.spans())
    for command in (["list"], ["show", "run-lines"], ["stack", "run-lines"]):
        result = await cli(sidecar, "runs", *command, COLUMNS="200")
        assert result.exit_code == 0, result.output
        lines = [line.strip() for line in result.output.splitlines()]
        assert "run ok (completed): 0 left" not in lines, (command, result.output)
        assert not any(line.startswith(("completed", "(resolved)")) for line in lines), lines
    shown = await cli(sidecar, "runs", "show", "run-lines", COLUMNS="200")
    assert "refund\\ncompleted\\n(resolved)\\n" in shown.output, shown.output


def test_serve_logs_json_lines_with_event_names_start_to_sigterm(tmp_path: Path) -> None:
    """One format: every stderr line is a JSON object with an event name, no repr."""
    import signal

    saga_sidecar = str(Path(sys.executable).parent / "saga-sidecar")
    argv = [saga_sidecar, "serve", "--db", str(tmp_path / "db"), "--log-level", "info"]
    argv += ["--otlp-http-port", "0", "--otlp-grpc-port", "0", "--api-port", "0"]
    # A forward target that refuses: a degraded state, which must be logged once.
    argv += ["--forward", "http://127.0.0.1:9/v1/traces"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    listening = json.loads(proc.stdout.readline())
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{listening['otlp_http']}/v1/traces")
    spans = stuck_run().spans()
    for _ in range(3):
        exporter.export(spans)
    exporter.shutdown()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.strip().splitlines()]
    events = [line["event"] for line in lines]
    assert all(isinstance(e, str) and e for e in events), err
    assert events[0] == "sidecar.started" and lines[0]["otlp_http"] == listening["otlp_http"]
    assert events[-2:] == ["sidecar.stopping", "sidecar.stopped"]
    assert lines[-2]["signal"] == "SIGTERM"
    # The forward target was down for three requests: said once, not three times.
    assert events.count("sidecar.forward.down") == 1
    assert all({"level", "timestamp"} <= line.keys() for line in lines), err
    assert "<" not in err and "object at 0x" not in err  # no Python repr anywhere
