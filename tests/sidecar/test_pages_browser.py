"""The run page and the review queue in a real browser (headless Chromium), against real agents.

Four real agents (saga_otel's engine) end a run compensated, compensation_failed,
stuck and orphaned (killed mid-run) against a real ``saga-sidecar serve``; the
browser follows each alert's ``run_url`` and reads what a person would see, then
submits the resolve form. Screenshots land in ``test-artifacts/pages`` (and, with
``SAGA_DOC_IMAGES=docs/img``, the two shown in docs/operations.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from chromium_cdp import CHROMIUM, Chromium

from saga_otel import semconv as sc
from saga_otel.testing import AlertReceiver, SidecarProcess, start_sidecar

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "pages"
AGENT = Path(__file__).with_name("pages_agent.py")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason="needs Debian's chromium: apt-get install -y chromium (scripts/debian-deps)",
    ),
    pytest.mark.timeout(300),
]


def agent(sidecar: SidecarProcess, mode: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(AGENT), "--otlp", sidecar.otlp, "--mode", mode, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "SAGA_OTEL_LOG_LEVEL": "ERROR", "OTEL_SERVICE_NAME": "checkout-agent"},
    )  # fmt: skip


def finished(sidecar: SidecarProcess, mode: str, *extra: str) -> str:
    proc = agent(sidecar, mode, *extra)
    out, _ = proc.communicate(timeout=120)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] == mode, result
    run_id: str = result["run_id"]
    return run_id


def killed_mid_run(sidecar: SidecarProcess) -> str:
    proc = agent(sidecar, "orphaned")
    assert proc.stdout is not None
    paused = json.loads(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run_id: str = paused["run_id"]
    return run_id


def wait_alert(receiver: AlertReceiver, alertname: str, run_id: str, status: str) -> Any:
    from support import wait_until

    return wait_until(
        lambda: receiver.find(alertname, run_id, status), 60, f"{alertname} {status} {run_id}"
    )


def doc_images(folder: Path, run_page: Path, review: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_page, folder / "run-page.png")
    shutil.copy(review, folder / "review-queue.png")


async def get_json(url: str, headers: dict[str, str] | None = None) -> Any:
    """The JSON API as a client sees it (Accept: */*, no browser)."""
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as resp:
        return await resp.json()


HOSTILE = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"


async def no_markup_from_data(page: Chromium) -> None:
    # The pages carry no script or image at all; a served tag from data would show here.
    assert await page.evaluate("document.querySelectorAll('script, img, iframe').length") == 0
    assert await page.evaluate("typeof window.pwned") == "undefined"


async def test_a_person_reads_the_runs_and_resolves_one_in_chromium(tmp_path: Path) -> None:
    receiver = AlertReceiver()
    sidecar = start_sidecar(tmp_path, "--webhook", receiver.url, "--idle-timeout", "3s")
    try:
        compensated = finished(sidecar, "compensated", "--order", "A-1")
        failed = finished(sidecar, "compensation_failed", "--order", "A-2")
        # The agent's data reaches the page: an order id that is markup stays text.
        stuck = finished(sidecar, "stuck", "--order", "A-3" + HOSTILE)
        orphan = killed_mid_run(sidecar)
        alerts = {
            failed: wait_alert(receiver, sc.ALERT_COMPENSATION_FAILED, failed, "firing"),
            stuck: wait_alert(receiver, sc.ALERT_RUN_STUCK, stuck, "firing"),
            orphan: wait_alert(receiver, sc.ALERT_RUN_ORPHANED, orphan, "firing"),
            compensated: wait_alert(
                receiver, sc.ALERT_COMPENSATION_STARTED, compensated, "resolved"
            ),
        }
        # The link in every alert is the API actually bound (port 0 here), not 4320.
        for run_id, alert in alerts.items():
            assert alert["annotations"]["run_url"] == f"{sidecar.api}/runs/{run_id}"
        # The JSON API is unchanged for clients.
        assert (await get_json(f"{sidecar.api}/runs/{stuck}"))["status"] == "stuck"

        async with Chromium(tmp_path / "profile") as page:
            await page.goto(alerts[compensated]["annotations"]["run_url"])
            text = await page.text()
            assert "COMPENSATED" in text.upper() and "checkout" in text
            assert "#2 check_fraud (read)" in text
            assert re.search(r"✓ #1 hold_stock  \d attempts?\s+release_stock\(", text), text
            assert re.search(r"✓ #0 charge_card  \d attempts?\s+refund_charge\(", text), text
            assert "(empty: nothing left to undo)" in text
            assert "No person is asked anything about this run." in text
            assert "SagaCompensationStarted" in text and "resolve" in text
            assert "Resolve this run" not in text
            await no_markup_from_data(page)
            await page.screenshot(ARTIFACTS / "run-compensated.png")

            await page.goto(alerts[failed]["annotations"]["run_url"])
            text = await page.text()
            assert "compensation_failed" in text
            assert re.search(r"✓ #1 hold_stock  \d attempts?\s+release_stock\(", text), text
            assert re.search(r"✗ #0 charge_card  \d attempts?\s+refund_charge\(", text), text
            assert "billing refused the refund of ch_A-2 (503)" in text
            assert "needs a person: compensation_failed" in text
            assert "Could NOT be undone:" in text and "You must decide:" in text
            assert "SagaCompensationFailed" in text
            await no_markup_from_data(page)
            failed_shot = await page.screenshot(ARTIFACTS / "run-compensation-failed.png")

            await page.goto(alerts[stuck]["annotations"]["run_url"])
            text = await page.text()
            assert "stuck" in text
            assert "PIVOT: send_receipt (#2)" in text and "no undo past this line" in text
            assert "✗ #3 ship_order (convergent)" in text
            assert f"warehouse rejected order A-3{HOSTILE}" in text
            assert "past the pivot: a person decides about these" in text
            assert "needs a person: stuck" in text and "Finish forward" in text
            assert "Will be undone" not in text  # past the pivot nothing is
            await no_markup_from_data(page)
            await page.screenshot(ARTIFACTS / "run-stuck.png")

            await page.goto(alerts[orphan]["annotations"]["run_url"])
            text = await page.text()
            assert "orphaned" in text and "#0 charge_card: refund_charge" in text
            assert "needs a person: orphaned" in text
            recover = f"saga-otel recover {orphan} --sidecar {sidecar.api} --otlp {sidecar.otlp}"
            assert recover in text
            assert "SagaRunOrphaned" in text
            await no_markup_from_data(page)
            await page.screenshot(ARTIFACTS / "run-orphaned.png")

            # The queue: the three runs that need a person, oldest first, each a link.
            await page.goto(f"{sidecar.api}/review")
            text = await page.text()
            assert compensated not in text
            positions = [text.index(r) for r in (failed, stuck, orphan)]
            assert positions == sorted(positions), text
            assert "check_fraud" in text and "ship_order" in text  # failed steps
            assert "(silent after charge_card)" in text  # where the orphan's agent died
            links = await page.evaluate(
                "[...document.querySelectorAll('#queue a')].map(a => a.href)"
            )
            assert links == [f"{sidecar.api}/runs/{r}" for r in (failed, stuck, orphan)]
            await no_markup_from_data(page)
            review_shot = await page.screenshot(ARTIFACTS / "review.png")

            # Follow the queue's link to the stuck run and resolve it with the form.
            await page.goto(links[1])
            await page.submit("#resolve", {"note": "Shipped by hand; ticket <A-3> closed."})
            assert await page.url() == f"{sidecar.api}/runs/{stuck}", await page.text()
            text = await page.text()
            assert "Resolved " in text and "Shipped by hand; ticket <A-3> closed." in text
            assert "Resolve this run" not in text
            await page.screenshot(ARTIFACTS / "run-stuck-resolved.png")
            # The resolution resolves its alert, and the run leaves the queue.
            resolved = wait_alert(receiver, sc.ALERT_RUN_STUCK, stuck, "resolved")
            assert "Shipped by hand" in resolved["annotations"]["resolution"]
            await page.goto(f"{sidecar.api}/review")
            text = await page.text()
            assert stuck not in text and failed in text and orphan in text

        images = os.environ.get("SAGA_DOC_IMAGES")
        if images:  # scripts/doc-screenshots: the two pictures of docs/operations.md
            await asyncio.to_thread(doc_images, Path(images), failed_shot, review_shot)
    finally:
        sidecar.stop()
        receiver.stop()


async def test_with_a_token_the_browser_asks_for_it_and_the_form_carries_it(
    tmp_path: Path,
) -> None:
    token = "t0ken-for-browsers"
    sidecar = start_sidecar(tmp_path, "--token", token)
    try:
        stuck = finished(sidecar, "stuck", "--token", token)
        url = f"{sidecar.api}/runs/{stuck}"
        async with Chromium(tmp_path / "profile") as page:
            await page.answer_auth(None)  # the prompt comes up; the person cancels it
            await page.goto(url)
            text = await page.text()
            assert "The sidecar needs its token" in text and stuck not in text
            await page.screenshot(ARTIFACTS / "run-token-refused.png")
            # A person types the token into the browser's prompt (any user name).
            await page.answer_auth("oncall", token)
            await page.goto(url)
            text = await page.text()
            assert "needs a person: stuck" in text
            assert "SAGA_OTEL_TOKEN" in text  # the recover hint says where the token goes
            await page.submit("#resolve", {"note": "retried ship_order by hand"})
            assert "Resolved " in await page.text()
        view = await get_json(url, {"Authorization": f"Bearer {token}"})
        assert view["resolution"]["note"] == "retried ship_order by hand"
    finally:
        sidecar.stop()


async def test_a_page_renamed_by_dns_rebinding_can_neither_read_nor_change_a_run(
    tmp_path: Path,
) -> None:
    """A page at http://rebind.attacker.example:PORT whose name then resolves to 127.0.0.1
    (Chromium's resolver is told so here, as the attacker's DNS would answer) is
    same-origin with a sidecar on loopback: its scripts send ``Origin`` of their own and
    ``Sec-Fetch-Site: same-origin``, and need no token there. Only the Host says it."""
    sidecar = start_sidecar(tmp_path, "--redact-key", "charge_id")
    try:
        stuck = finished(sidecar, "stuck", "--order", "A-9")
        port = urlsplit(sidecar.api).port
        rebound = f"http://rebind.attacker.example:{port}"
        rules = "--host-resolver-rules=MAP rebind.attacker.example 127.0.0.1"
        async with Chromium(tmp_path / "profile", args=(rules,)) as page:
            # The attacker's own page has no Content-Security-Policy of the sidecar's.
            await page.send("Page.setBypassCSP", enabled=True)
            await page.goto(f"{rebound}/healthz")
            assert await page.url() == f"{rebound}/healthz"
            status, text = await page.request("GET", f"/runs/{stuck}?reveal=args")
            assert status == 421 and "ch_A-9" not in text and "--public-url" in text, text
            for path, body in (
                (f"/runs/{stuck}/resolve", '{"note": "resolved by the attacker"}'),
                (f"/runs/{stuck}/lease", '{"holder": "evil", "force": true, "reason": "x"}'),
                (f"/ui/runs/{stuck}/resolve", "note=forged"),
            ):
                status, text = await page.request("POST", path, body)
                assert status == 421, (path, text)
            # The spans port too (same-origin: JSON needs no preflight): no forged runs.
            otlp = f"http://rebind.attacker.example:{urlsplit(sidecar.otlp).port}"
            await page.goto(f"{otlp}/v1/traces")
            spans = '{"resourceSpans": []}'
            status, text = await page.request("POST", "/v1/traces", spans, "application/json")
            assert status == 421, text
            # The same browser under the sidecar's own name reads the run.
            await page.goto(f"{sidecar.api}/runs/{stuck}")
            assert "needs a person: stuck" in await page.text()
        view = await get_json(f"{sidecar.api}/runs/{stuck}")
        assert view["resolution"] is None and view["recovery"] is None
    finally:
        sidecar.stop()
