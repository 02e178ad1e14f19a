"""Recovery leases with real processes: one recoverer at a time, never behind a live
agent, a killed recoverer followed by another, a stalled one that lost its lease,
odd run ids, and every exit code.

Ground truth: the tools' own log (recovery_kit.py), never the sidecar's view."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import SidecarProcess, wait_until

from saga_otel import RunStatus, recover
from saga_otel import semconv as sc
from saga_otel._cli import EXIT_REFUSED
from saga_otel._cli import main as cli
from saga_otel._state import STATE
from sidecar import Sidecar
from sidecar._alerting import build_card, render_card
from tests.saga_otel import recovery_kit as kit
from tests.saga_otel.recovery_kit import BIN, ROOT, TOOLS, kit_env, race, start_agent, truth_lines
from tests.sidecar.sidecar_testkit import (
    FakeClock,
    export_http,
    heartbeat_spans,
    open_run,
    settings_for,
)

pytestmark = pytest.mark.timeout(300)


def view(s: SidecarProcess, run_id: str) -> dict[str, Any]:
    resp = httpx.get(f"{s.api}/runs/{sc.run_id_segment(run_id)}", timeout=5)
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


def recover_cli(
    s: SidecarProcess, run_id: str, truth: Path, *extra: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "saga-otel"), "recover", run_id, "--tools", TOOLS, "--sidecar", s.api,
         "--otlp", s.otlp, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=kit_env(truth, **env),
    )  # fmt: skip


def sidecar_cli(s: SidecarProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "saga-sidecar"), "runs", *args, "--api", s.api],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def kill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_orphaned(s: SidecarProcess, run_ids: list[str]) -> None:
    for run_id in run_ids:
        wait_until(lambda r=run_id: view(s, r)["status"] == "orphaned", what=f"{run_id} orphaned")


def test_two_racing_recoverers_one_undoes_the_other_names_the_holder(
    sidecar_process: Any, tmp_path: Path
) -> None:
    s = sidecar_process()
    stats = race(s.api, s.otlp, tmp_path, trials=3)
    assert stats["loser_named_holder"] == 3


def test_recover_is_refused_behind_a_live_agent_and_forced_with_a_reason(
    sidecar_process: Any, tmp_path: Path
) -> None:
    s = sidecar_process()
    truth = tmp_path / "truth.log"
    agent, (run_id,) = start_agent(s.otlp, ["live-run"], truth)
    try:
        refused = recover_cli(s, run_id, truth)
        assert refused.returncode == 3, refused.stderr
        assert "agent is alive" in refused.stderr and "last heard from" in refused.stderr
        assert "--force --reason" in refused.stderr and "force=True" not in refused.stderr
        assert truth_lines(truth, run_id) == []  # nothing was undone
        assert view(s, run_id)["recovery"] is None

        no_reason = recover_cli(s, run_id, truth, "--force")
        assert no_reason.returncode == 2 and "--reason" in no_reason.stderr

        why = "agent wedged on a dead socket; ops ticket 4411"
        forced = recover_cli(s, run_id, truth, "--force", "--reason", why)
        assert forced.returncode == 0, forced.stderr
        undos = [ref for kind, ref, _ in truth_lines(truth, run_id) if kind == "undo"]
        assert undos == [2, 1, 0]
        after = view(s, run_id)
        assert after["recovery"]["override"]["reason"] == why
        assert after["recovery"]["released"] is True
        shown = sidecar_cli(s, "show", run_id)
        assert (
            shown.returncode == 0 and "FORCED" in shown.stdout and "ops ticket 4411" in shown.stdout
        )
        card = build_card(sc.ALERT_COMPENSATION_FAILED, after, "http://x")
        assert card["recovery_override"]["reason"] == why
        assert why in render_card(card)
    finally:
        kill(agent)


def test_a_recoverer_killed_mid_unwind_is_followed_and_no_acknowledged_undo_repeats(
    sidecar_process: Any, tmp_path: Path
) -> None:
    s = sidecar_process()
    truth = tmp_path / "truth.log"
    agent, (run_id,) = start_agent(s.otlp, ["killed-mid-unwind"], truth)
    kill(agent)
    wait_orphaned(s, [run_id])
    first = subprocess.Popen(
        [str(BIN / "saga-otel"), "recover", run_id, "--tools", TOOLS, "--sidecar", s.api,
         "--otlp", s.otlp, "--lease-ttl", "2"],
        cwd=ROOT, env=kit_env(truth, SAGA_HANG_AT="1"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_until(lambda: ("call", 1, first.pid) in truth_lines(truth, run_id), what="hung at #1")
    kill(first)  # mid-unwind: #2 undone and acknowledged, #1 running

    deadline = time.monotonic() + 60
    while True:
        second = recover_cli(s, run_id, truth)
        if second.returncode != 3:
            break
        assert "being recovered by" in second.stderr and f":{first.pid}:" in second.stderr
        assert time.monotonic() < deadline, second.stderr
        time.sleep(0.5)
    assert second.returncode == 0, second.stderr
    lines = truth_lines(truth, run_id)
    calls = [(ref, pid) for kind, ref, pid in lines if kind == "call"]
    undos = sorted(ref for kind, ref, _ in lines if kind == "undo")
    assert undos == [0, 1, 2]  # every effect exactly once
    assert [c for c in calls if c[0] == 2] == [(2, first.pid)]  # acknowledged: never again
    assert len([c for c in calls if c[0] == 1]) == 2  # unacknowledged: repeated, same key
    assert [c for c in calls if c[0] == 0] != [] and all(p != first.pid for r, p in calls if r == 0)
    wait_until(lambda: view(s, run_id)["status"] == "recovered", what="recovered")


ODD_IDS = ["x/../victim", "a/b?c#d", "50% off", "spaced id", "ünï-日本", "...", "%2F"]


def test_odd_run_ids_round_trip_through_every_command(sidecar_process: Any, tmp_path: Path) -> None:
    s = sidecar_process()
    truth = tmp_path / "truth.log"
    agent, runs = start_agent(s.otlp, ["victim", *ODD_IDS], truth)
    assert runs == ["victim", *ODD_IDS]
    kill(agent)
    wait_orphaned(s, runs)
    for run_id in ODD_IDS:
        shown = sidecar_cli(s, "show", run_id, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["run_id"] == run_id
        stack = sidecar_cli(s, "stack", run_id, "--json")
        assert stack.returncode == 0 and len(json.loads(stack.stdout)["stack"]) == 3
    out = recover_cli(s, "x/../victim", truth)
    assert out.returncode == 0, out.stderr
    assert truth_lines(truth, "victim") == []  # the victim was not touched
    procs = [
        subprocess.Popen(
            [
                str(BIN / "saga-otel"),
                "recover",
                r,
                "--tools",
                TOOLS,
                "--sidecar",
                s.api,
                "--otlp",
                s.otlp,
            ],
            cwd=ROOT,
            env=kit_env(truth),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ODD_IDS[1:]
    ]
    for proc in procs:
        assert proc.wait(120) == 0, proc.stderr.read() if proc.stderr else ""
    for run_id in ODD_IDS:
        undos = [ref for kind, ref, _ in truth_lines(truth, run_id) if kind == "undo"]
        assert undos == [2, 1, 0], (run_id, undos)
        wait_until(lambda r=run_id: view(s, r)["status"] == "recovered", what=f"{run_id}")
        resolved = sidecar_cli(s, "resolve", run_id, "--note", "checked")
        assert resolved.returncode == 0 and run_id in resolved.stdout
        assert view(s, run_id)["resolution"]["note"] == "checked"
    assert view(s, "victim")["status"] == "orphaned" and view(s, "victim")["resolution"] is None


def test_each_recover_outcome_has_its_own_exit_code(sidecar_process: Any, tmp_path: Path) -> None:
    s = sidecar_process()
    truth = tmp_path / "truth.log"
    agent, (done, open_run) = start_agent(s.otlp, ["done:finished", "open"], truth)
    kill(agent)
    wait_orphaned(s, [open_run])
    finished = recover_cli(s, done, truth)
    assert finished.returncode == 4, finished.stderr
    assert "is completed" in finished.stdout and "nothing to do" in finished.stdout
    assert "pivot" not in finished.stdout
    assert recover_cli(s, open_run, truth).returncode == 0
    again = recover_cli(s, open_run, truth)
    assert again.returncode == 4 and "is recovered" in again.stdout
    unknown = recover_cli(s, "no-such-run", truth)
    assert unknown.returncode == 2 and "no run 'no-such-run'" in unknown.stderr
    as_json = recover_cli(s, done, truth, "--json")
    assert json.loads(as_json.stdout)["outcome"] == "nothing_to_do"
    assert sys.executable  # the codes are documented in `saga-otel recover --help`
    helped = subprocess.run([str(BIN / "saga-otel"), "recover", "--help"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    for code in ("0  recovered", "1  failed", "2  error", "3  refused", "4  nothing to do"):
        assert code in helped.stdout


def test_recovering_a_run_whose_agent_ended_it_compensation_failed_blames_no_dead_agent(
    sidecar_process: Any, tmp_path: Path
) -> None:
    s = sidecar_process()
    truth = tmp_path / "truth.log"
    agent, (run_id,) = start_agent(s.otlp, ["fail:undo-failed"], truth, SAGA_UNDO_FAIL="1")
    try:  # the agent stays alive: it ended the run itself, so recovery is not behind it
        wait_until(lambda: view(s, run_id)["status"] == "compensation_failed", what="failed")
        again = recover_cli(s, run_id, truth, SAGA_UNDO_FAIL="1")
        assert again.returncode == 1, again.stderr
        assert "stopped before finishing" not in again.stdout
        assert "ended compensation_failed" in again.stdout
        fixed = recover_cli(s, run_id, truth)
        assert fixed.returncode == 0, fixed.stderr
        undos = sorted(ref for kind, ref, _ in truth_lines(truth, run_id) if kind == "undo")
        assert undos == [0, 1, 2]
    finally:
        kill(agent)


async def test_a_recoverer_that_lost_its_lease_during_its_last_undo_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its undo ran, and the acknowledgement it then saw was the new holder's: still not
    a recovery of its own, so it says who took over instead of reporting success."""
    clock = FakeClock()  # the sidecar's: the test moves it past the lease's ttl
    kit.PAUSED.clear()
    kit.GO.clear()
    try:
        async with Sidecar(settings_for(tmp_path), clock=clock) as sidecar:
            api = f"http://127.0.0.1:{sidecar.api_port}"
            run = open_run(instance="agent-1")  # its stack: reverse_credit
            await export_http(sidecar, run.spans())
            clock.now += sidecar.settings.idle_timeout + 1
            sidecar.tick()  # the agent is gone
            # 600 s: its renewer (every 200 s) never beats the test's clock.
            argv = ["recover", run.run_id, "--tools", f"{kit.__name__}:paused_registry",
                    "--sidecar", api, "--otlp", f"http://127.0.0.1:{sidecar.otlp_http_port}",
                    "--lease-ttl", "600"]  # fmt: skip
            first = asyncio.ensure_future(asyncio.to_thread(cli, argv))
            assert await asyncio.to_thread(kit.PAUSED.wait, 60), "the first undo never started"
            clock.now += 601  # paused past its lease's ttl: another recoverer takes over
            report = await asyncio.to_thread(
                recover, run.run_id, tools=kit.paused_registry(), sidecar=api, holder="rec-b"
            )
            assert report.status is RunStatus.COMPENSATED
            kit.GO.set()  # the first recoverer's undo returns
            code = await asyncio.wait_for(first, 60)
            assert view_of(sidecar, run.run_id)["recovery"]["holder"] == "rec-b"
    finally:
        kit.GO.set()
        STATE.reset()
    err = capsys.readouterr().err
    assert code == EXIT_REFUSED, err
    assert "lost its recovery lease (token 1)" in err and "held by 'rec-b' (token 2)" in err, err


def view_of(sidecar: Sidecar, run_id: str) -> dict[str, Any]:
    found = sidecar.state.view(run_id)
    assert found is not None
    return found


async def test_a_recoverer_stops_before_its_next_undo_when_the_agent_comes_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agent was paused past the orphan window, not dead: it speaks about its run
    while the recoverer's first undo runs. The recoverer's renewal after that undo is
    refused, so the second undo never runs under the working agent; it exits 3 saying
    the agent came back, and leaves the run open for the agent."""
    clock = FakeClock()
    kit.PAUSED.clear()
    kit.GO.clear()
    try:
        async with Sidecar(settings_for(tmp_path), clock=clock) as sidecar:
            api = f"http://127.0.0.1:{sidecar.api_port}"
            run = open_run(instance="agent-1")  # step 1: reverse_credit cr_1
            run.do(2, "issue_credit", comp=("reverse_credit", {"credit_id": "cr_2"}, "cr_2"))
            await export_http(sidecar, run.spans())
            clock.now += sidecar.settings.idle_timeout + 1
            sidecar.tick()  # the agent looks gone
            argv = ["recover", run.run_id, "--tools", f"{kit.__name__}:paused_registry",
                    "--sidecar", api, "--otlp", f"http://127.0.0.1:{sidecar.otlp_http_port}",
                    "--lease-ttl", "600"]  # fmt: skip
            first = asyncio.ensure_future(asyncio.to_thread(cli, argv))
            assert await asyncio.to_thread(kit.PAUSED.wait, 60), "the first undo never started"
            clock.now += 1
            await export_http(sidecar, heartbeat_spans("agent-1", [run.run_id], at=0.0))
            kit.GO.set()  # the undo of step 2 returns
            code = await asyncio.wait_for(first, 60)
            view = view_of(sidecar, run.run_id)
    finally:
        kit.GO.set()
        STATE.reset()
    err = capsys.readouterr().err
    assert code == EXIT_REFUSED, err
    assert "its agent came back while this process recovered it" in err, err
    assert "goes on with the run" in err, err
    steps = {s["index"]: s for s in view["steps"]}
    assert steps[2]["compensated"] and not steps[1]["compensated"], steps
    assert view["status"] not in ("recovered", "compensated"), view["status"]
    assert view["recovery"]["released"] is True
