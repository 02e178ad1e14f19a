"""A secret argument leaves a real sidecar process nowhere: no sink, log, API or CLI answer.

The bug this reproduces: with ``--redact-key api_key``, the key of a compensation
that SUCCEEDED (so absent from the stack) while another compensation failed came
out unmasked in the SagaCompensationFailed card, its text, the details and the
alert log line.
"""

from __future__ import annotations

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
from sidecar_testkit import BOTH_BACKENDS, RunScript

from saga_otel import semconv as sc
from saga_otel.testing import SidecarProcess, start_sidecar

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
