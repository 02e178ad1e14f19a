"""`saga-sidecar runs ...` against an in-process sidecar's API."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from click.testing import CliRunner, Result
from sidecar_testkit import compensation_failed_run, completed_run, export_http, stuck_run

from saga_otel import semconv as sc
from sidecar import Sidecar
from sidecar._cli import main


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
