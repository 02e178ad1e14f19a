"""A secret argument leaves a real sidecar process nowhere: no sink, log, API or CLI answer.

The bug this reproduces: with ``--redact-key api_key``, the key of a compensation
that SUCCEEDED (so absent from the stack) while another compensation failed came
out unmasked in the SagaCompensationFailed card, its text, the details and the
alert log line.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from receivers import RawReceiver
from sidecar_testkit import BOTH_BACKENDS, FakeClock, RunScript, export_http, settings_for

from saga_otel import semconv as sc
from saga_otel.testing import AlertReceiver, SidecarProcess, start_sidecar
from sidecar import Sidecar
from sidecar._alert_service import install_alerting
from sidecar._alert_settings import AlertSettings

pytestmark = BOTH_BACKENDS

SECRET = "sk_live_9f8e7d6c5b4a"
OTHER = "pat-0a1b2c3d4e"  # caught by --redact-pattern, not by the key
REVOKE = ("revoke_key", {"api_key": SECRET, "user": "u-42"}, f"revoke key {SECRET}")
CREDIT = ("reverse_credit", {"credit_id": "cr_1", "auth_token": OTHER}, "reverse credit cr_1")


def failed_unwind() -> RunScript:
    """revoke_key undone fine, reverse_credit fails: SagaCompensationStarted + ...Failed."""
    r = RunScript(saga="provision")
    r.do(0, "create_key", "compensable", comp=REVOKE)
    r.do(1, "issue_credit", "compensable", comp=CREDIT)
    r.do(2, "notify", "compensable", ok=False, error=f"ValueError: bad key {SECRET}")
    stack = [
        {"step": "issue_credit", "index": 1, "tool": CREDIT[0], "args": CREDIT[1],
         "description": CREDIT[2]},
        {"step": "create_key", "index": 0, "tool": REVOKE[0], "args": REVOKE[1],
         "description": REVOKE[2]},
    ]  # fmt: skip
    r.unwind(f"ValueError: bad key {SECRET}", "notify", stack)
    r.compensate(1, "issue_credit", CREDIT[0], CREDIT[1], ok=False, error=f"HTTPError: {OTHER}")
    r.compensate(0, "create_key", REVOKE[0], REVOKE[1])  # succeeded: not on the stack any more
    r.escalate(
        sc.ESCALATION_COMPENSATION_FAILED,
        {
            "saga": "provision",
            "reason": "compensation_failed",
            "undone": [f"revoke_key(api_key={SECRET})"],
            "not_undone": [f"reverse_credit(credit_id=cr_1, auth_token={OTHER})"],
            "decide": [f"check key {SECRET} is revoked"],
        },
    )
    return r.end(sc.STATUS_COMPENSATION_FAILED, "notify")


def compensated_unwind() -> RunScript:
    """Undone in full, its failure quoting the key: a settled run, put away from memory.
    Sent in one request, its SagaCompensationStarted fires and resolves late, the stack
    already empty: the alert holds the key's value, not its argument."""
    r = RunScript(saga="provision")
    r.do(0, "create_key", "compensable", comp=REVOKE)
    r.do(1, "notify", "compensable", ok=False, error=f"ValueError: bad key {SECRET}")
    stack = [
        {"step": "create_key", "index": 0, "tool": REVOKE[0], "args": REVOKE[1],
         "description": REVOKE[2]},
    ]  # fmt: skip
    r.unwind(f"ValueError: bad key {SECRET}", "notify", stack)
    r.compensate(0, "create_key", REVOKE[0], REVOKE[1])
    return r.end(sc.STATUS_COMPENSATED, "notify")


def stuck() -> RunScript:
    r = RunScript(saga="provision")
    r.do(0, "create_key", "compensable", comp=REVOKE)
    r.do(1, "send_mail", "irreversible", pivot=True)
    r.do(2, "close", "convergent", ok=False, error=f"RuntimeError: key {SECRET} refused")
    r.escalate(sc.ESCALATION_STUCK, {"decide": [f"retry with key {SECRET}"]})
    return r.end(sc.STATUS_STUCK, "close")


def orphan() -> RunScript:
    r = RunScript(saga="provision", instance="agent-dies")
    r.do(0, "create_key", "compensable", comp=REVOKE)
    return r


def export(side: SidecarProcess, run: RunScript) -> None:
    exporter = OTLPSpanExporter(endpoint=f"{side.otlp}/v1/traces", timeout=10)
    try:
        assert exporter.export(run.spans()) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()


def wait_for(check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_secret_leaves_through_no_sink_log_api_or_cli(tmp_path: Path) -> None:
    hook, am, pd = RawReceiver(), RawReceiver(), RawReceiver()
    side = start_sidecar(
        tmp_path,
        "--alert-log",
        "--webhook", f"{hook.url}/hook",
        "--alertmanager", am.url,
        "--pagerduty-routing-key", "routing-key-0123456789abcdef0123",
        "--pagerduty-url", f"{pd.url}/v2/enqueue",
        "--redact-key", "api_key",
        "--redact-pattern", "(?i)token",
        "--idle-timeout", "1s",
        "--log-level", "DEBUG",
    )  # fmt: skip
    try:
        runs = [failed_unwind(), stuck(), orphan()]
        for run in runs:
            export(side, run)
        expected = {
            (sc.ALERT_COMPENSATION_STARTED, runs[0].run_id),
            (sc.ALERT_COMPENSATION_FAILED, runs[0].run_id),
            (sc.ALERT_RUN_STUCK, runs[1].run_id),
            (sc.ALERT_RUN_ORPHANED, runs[2].run_id),
        }

        def arrived(receiver: RawReceiver) -> Callable[[], bool]:
            def check() -> bool:
                got = set()
                for doc in receiver.docs():
                    labels = doc.get("labels") or doc.get("payload", {}).get("custom_details", {})
                    labels = labels.get("labels", labels)
                    got.add((labels.get("alertname"), labels.get("run_id")))
                return expected <= got

            return check

        for name, receiver in (("webhook", hook), ("alertmanager", am), ("pagerduty", pd)):
            wait_for(arrived(receiver), f"every alert at the {name} receiver")
        api_answers = []
        for run in runs:
            for path in (f"/runs/{run.run_id}", f"/runs/{run.run_id}/stack"):
                resp = httpx.get(f"{side.api}{path}", timeout=10)
                assert resp.status_code == 200
                api_answers.append(resp.content)
        api_answers.append(httpx.get(f"{side.api}/runs", timeout=10).content)
        # The run pages and the review queue a person opens from the alert's link.
        pages = [httpx.get(f"{side.api}/review", timeout=10).content]
        for run in runs:
            page = httpx.get(f"{side.api}/ui/runs/{run.run_id}", timeout=10)
            assert page.status_code == 200 and b"<html" in page.content.lower()
            pages.append(page.content)
        cli = [str(Path(sys.executable).parent / "saga-sidecar")]
        cli_out = []
        for args in (
            ["runs", "list"],
            ["runs", "list", "--json"],
            ["runs", "show", runs[0].run_id],
            ["runs", "show", runs[0].run_id, "--json"],
            ["runs", "stack", runs[2].run_id],
            ["runs", "stack", runs[2].run_id, "--json"],
        ):
            done = subprocess.run(
                [*cli, *args, "--api", side.api], capture_output=True, timeout=60, check=True
            )
            cli_out.append(done.stdout + done.stderr)
        # Recovery still gets the real arguments it must run.
        revealed = httpx.get(
            f"{side.api}/runs/{runs[2].run_id}", params={"reveal": "args"}, timeout=10
        ).json()
        assert revealed["stack"][0]["args"]["api_key"] == SECRET
    finally:
        side.stop()
        for receiver in (hook, am, pd):
            receiver.stop()
    sink_bytes = {"webhook": hook.raw(), "alertmanager": am.raw(), "pagerduty": pd.raw()}
    everything = {
        **sink_bytes,
        "sidecar log (stderr)": Path(side.log).read_bytes(),
        "API answers": b"\n".join(api_answers),
        "CLI output": b"\n".join(cli_out),
        "run pages": b"\n".join(pages),
    }
    for where, data in everything.items():
        assert data, f"nothing captured from {where}"
        for secret in (SECRET, OTHER):
            assert secret.encode() not in data, f"{secret} leaked through {where}"
    # The masks are there, where the values were (not just an empty payload).
    for where in sink_bytes:
        assert b"***" in sink_bytes[where], where
    log = Path(side.log).read_text()
    assert "saga.alert" in log and sc.ALERT_COMPENSATION_FAILED in log
    assert json.dumps(SECRET) not in log


async def test_alerts_waiting_when_redaction_is_added_leave_masked(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Alerts written while the sink was down, before ``--redact-key`` was set: restarted
    with it, the waiting alerts leave masked. A row holds the masking in force when it
    was written (the start's re-evaluation masks its events anew, and the row's key
    keeps the old one), and a sink's own pass sees only the alert, not the compensations
    that succeeded, whose arguments the card and the description quote. The runs' whole
    views mask them again at start, a run put away from memory's too."""
    receiver = AlertReceiver(start=False)  # down while the alerts are written
    runs = [failed_unwind(), compensated_unwind()]
    first = Sidecar(settings_for(tmp_path), clock=clock)
    service = install_alerting(first, AlertSettings(webhook_urls=(receiver.url,), log_sink=False))
    outbox = service.outbox
    async with first:
        for run in runs:
            await export_http(first, run.spans())
        for _ in range(3000):
            await outbox.flush()
            if await outbox.call(outbox.depth) == 4:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError(f"not every alert written: {outbox.rows()}")
        assert await first.evict_async() == [runs[1].run_id]  # settled: put away
    receiver.start()
    second = Sidecar(settings_for(tmp_path), clock=clock)
    settings = AlertSettings(
        webhook_urls=(receiver.url,),
        log_sink=False,
        redact_keys=("api_key",),
        redact_patterns=("(?i)token",),
    )
    outbox = install_alerting(second, settings).outbox
    try:
        async with second:
            assert runs[1].run_id not in second.state
            for _ in range(3000):
                if len(receiver.alerts) >= 4 and await outbox.call(outbox.depth) == 0:
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError(f"not every alert delivered: {receiver.alerts}")
    finally:
        receiver.stop()
    got = {(a["alertname"], a["run_id"], a["status"]) for a in receiver.alerts}
    assert got == {
        (sc.ALERT_COMPENSATION_STARTED, runs[0].run_id, "firing"),
        (sc.ALERT_COMPENSATION_FAILED, runs[0].run_id, "firing"),
        (sc.ALERT_COMPENSATION_STARTED, runs[1].run_id, "firing"),
        (sc.ALERT_COMPENSATION_STARTED, runs[1].run_id, "resolved"),
    }
    sent = json.dumps(receiver.alerts)
    for secret in (SECRET, OTHER):
        assert secret not in sent, secret
    assert "***" in sent


async def test_a_resolve_after_redaction_was_added_repeats_its_fire_masked(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A fire delivered before ``--redact-key`` was set still fires: its resolve repeats its
    labels and annotations (the card quoting the key of a revoke that succeeded, which
    the alert's own stack no longer holds), and an Alertmanager is sent it again. The
    start masks the fires still firing too."""
    receiver = AlertReceiver()
    run = failed_unwind()
    first = Sidecar(settings_for(tmp_path), clock=clock)
    install_alerting(first, AlertSettings(webhook_urls=(receiver.url,), log_sink=False))
    try:
        async with first:
            await export_http(first, run.spans())
            for _ in range(3000):
                if receiver.find(sc.ALERT_COMPENSATION_FAILED, run.run_id):
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError(f"no alert delivered: {receiver.alerts}")
        before = len(receiver.alerts)
        second = Sidecar(settings_for(tmp_path), clock=clock)
        settings = AlertSettings(
            webhook_urls=(receiver.url,), log_sink=False, redact_keys=("api_key",)
        )
        service = install_alerting(second, settings)
        async with second:
            await asyncio.wait_for(service.reevaluated.wait(), 15)
            await second.resolve(run.run_id, "revoked by hand", by="dana")
            for _ in range(3000):
                if receiver.find(sc.ALERT_COMPENSATION_FAILED, run.run_id, "resolved"):
                    break
                await asyncio.sleep(0.005)
            else:
                raise AssertionError(f"no resolve delivered: {receiver.alerts}")
    finally:
        receiver.stop()
    after = receiver.alerts[before:]
    assert (sc.ALERT_COMPENSATION_FAILED, "resolved") in {
        (a["alertname"], a["status"]) for a in after
    }
    sent = json.dumps(after)
    assert SECRET not in sent
    assert "***" in sent
