"""`saga-sidecar runs ...` against an in-process sidecar's API."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
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


async def test_a_unique_prefix_names_a_run_and_an_ambiguous_one_lists_candidates(
    sidecar: Sidecar,
) -> None:
    one, two = stuck_run(run_id="abc123-one"), stuck_run(run_id="abc123-two")
    await export_http(sidecar, one.spans() + two.spans())

    result = await cli(sidecar, "runs", "show", "abc123-o")
    assert result.exit_code == 0, result.output
    assert "abc123-one" in result.output
    result = await cli(sidecar, "runs", "stack", "abc123-t", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["run_id"] == "abc123-two"

    result = await cli(sidecar, "runs", "resolve", "abc", "--note", "which one?")
    assert result.exit_code == 1
    assert "'abc' starts more than one run id" in result.output
    assert "abc123-one" in result.output and "abc123-two" in result.output
    result = await cli(sidecar, "runs", "resolve", "abc123-t", "--note", "settled")
    assert result.exit_code == 0 and "resolved abc123-two" in result.output
    result = await cli(sidecar, "runs", "show", "zzz")
    assert result.exit_code == 1 and "no run 'zzz'" in result.output
