"""A real Alertmanager between the outbox and a webhook receiver: fire, then resolve."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from saga_otel import semconv as sc
from sidecar._alert_service import AlertService
from sidecar._alert_settings import AlertSettings

pytestmark = pytest.mark.e2e

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CONFIG = """
global:
  resolve_timeout: 5m
route:
  receiver: hook
  group_by: [alertname, run_id]
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: http://127.0.0.1:{hook_port}/hook
        send_resolved: true
"""


@pytest.fixture
async def hook() -> AsyncIterator[tuple[int, list[dict[str, Any]]]]:
    got: list[dict[str, Any]] = []

    async def handle(request: web.Request) -> web.Response:
        got.append(await request.json())
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port, got
    await runner.cleanup()


@pytest.fixture
def alertmanager(tmp_path: Path, hook: tuple[int, list[dict[str, Any]]]) -> Iterator[str]:
    config = tmp_path / "alertmanager.yml"
    config.write_text(CONFIG.format(hook_port=hook[0]))
    port = free_port()
    proc = subprocess.Popen(
        [
            ALERTMANAGER,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(url: str, limit: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"{url}/-/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert loop.time() < deadline, "Alertmanager did not become ready"
            await asyncio.sleep(0.05)


async def wait_for(cond: Any, limit: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def view(status: str, **over: Any) -> dict[str, Any]:
    base = {
        "run_id": "e2e-run-1",
        "saga": "refund",
        "service": "refund-agent",
        "instance": "i1",
        "status": status,
        "updated_at": 1.0,
        "failed_step": "send_reply",
        "unwind_reason": "SMTPError: mail down",
        "unwind_started_at": None,
        "steps": [],
        "stack": [],
        "escalation": None,
        "resolution": None,
    }
    base.update(over)
    return base


async def test_compensation_started_reaches_alertmanager_and_resolves(
    tmp_path: Path, alertmanager: str, hook: tuple[int, list[dict[str, Any]]]
) -> None:
    _, got = hook
    await wait_ready(alertmanager)
    service = AlertService(
        tmp_path / "sidecar.db",
        AlertSettings(alertmanager_urls=(alertmanager,), log_sink=False),
    )
    await service.start()
    try:
        started = time.time()
        running = view("running")
        unwinding = view("unwinding", unwind_started_at=started, updated_at=started)
        assert [e.alertname for e in service.on_change(running, unwinding, started)] == [
            sc.ALERT_COMPENSATION_STARTED
        ]

        def firing() -> list[dict[str, Any]]:
            return [a for n in got for a in n["alerts"] if a["status"] == "firing"]

        await wait_for(lambda: firing())
        alert = firing()[0]
        assert alert["labels"]["alertname"] == sc.ALERT_COMPENSATION_STARTED
        assert alert["labels"]["run_id"] == "e2e-run-1"
        assert alert["labels"]["severity"] == "warning"
        assert alert["annotations"]["description"].startswith(
            "refund run e2e-run-1 unwinding after send_reply failed"
        )
        assert alert["generatorURL"].endswith("/runs/e2e-run-1")

        done = time.time()
        compensated = view("compensated", unwind_started_at=started, updated_at=done, ended_at=done)
        events = service.on_change(unwinding, compensated, done)
        assert [e.action.value for e in events] == ["resolve"]

        def resolved() -> list[dict[str, Any]]:
            return [a for n in got for a in n["alerts"] if a["status"] == "resolved"]

        await wait_for(lambda: resolved())
        assert resolved()[0]["labels"] == alert["labels"]
        assert got[-1]["status"] == "resolved"
    finally:
        await service.stop()
        service.close()


async def test_an_alert_from_an_agent_whose_clock_runs_ahead_reaches_alertmanager(
    tmp_path: Path, alertmanager: str
) -> None:
    """An agent an hour fast: its times are past Alertmanager's now + resolve_timeout, and
    Alertmanager refused the alert (400), which the outbox marked failed: the page was lost.
    It starts at the sidecar's now instead."""
    await wait_ready(alertmanager)
    service = AlertService(
        tmp_path / "sidecar.db",
        AlertSettings(alertmanager_urls=(alertmanager,), log_sink=False),
    )
    await service.start()
    try:
        now = time.time()
        ahead = now + 3600.0
        failed = view(
            "compensation_failed",
            run_id="e2e-ahead",
            unwind_started_at=ahead,
            updated_at=ahead,
            ended_at=ahead,
        )
        events = service.on_change(None, failed, now)
        assert sc.ALERT_COMPENSATION_FAILED in [e.alertname for e in events]
        found: list[dict[str, Any]] = []
        async with aiohttp.ClientSession() as session:

            async def alerts() -> list[dict[str, Any]]:
                async with session.get(f"{alertmanager}/api/v2/alerts") as resp:
                    assert resp.status == 200
                    got: list[dict[str, Any]] = await resp.json()
                    return got

            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30.0
            while not found:
                assert loop.time() < deadline, "the alert never reached Alertmanager"
                found = [
                    a
                    for a in await alerts()
                    if a["labels"].get("run_id") == "e2e-ahead"
                    and a["labels"]["alertname"] == sc.ALERT_COMPENSATION_FAILED
                ]
                await asyncio.sleep(0.05)
        assert found[0]["status"]["state"] == "active"
        assert "in the sidecar's future" in found[0]["annotations"]["agent_clock_ahead"]
    finally:
        await service.stop()
        service.close()
